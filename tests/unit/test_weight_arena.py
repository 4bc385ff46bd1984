"""kiln.models.arena: a loaded model's weights gathered into one huge-page arena."""

from __future__ import annotations

import torch
from torch import nn

from kiln import LLM, SamplingParams
from kiln.models import arena


def _greedy(llm: LLM) -> list[tuple[list[int], list[float]]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": [3, 14, 15, 92, 65]},
                         {"prompt_token_ids": [2, 71, 82]}], params, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [lp[t].logprob for lp, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids,
                                             strict=True)]) for o in outs]


def _weights(model: nn.Module) -> list[torch.Tensor]:
    """The model's tensors of 4 KiB or more, parameters and packed copies alike, module order."""
    seen, out = set(), []
    for m in model.modules():
        for t in (*m._parameters.values(), *vars(m).values()):
            if isinstance(t, torch.Tensor) and t.nbytes >= 4096 and id(t) not in seen:
                seen.add(id(t))
                out.append(t)
    return out


def _arena_storages(model: nn.Module) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in _weights(model)}


def test_gathered_weights_serve_the_same_tokens_from_one_aligned_arena(llama_path, monkeypatch):
    monkeypatch.setattr(arena, "MIN_BYTES", 4096)  # the tiny model's weights are small
    monkeypatch.setenv("KILN_WEIGHT_ARENA", "0")
    scattered = LLM(llama_path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=1)
    monkeypatch.setenv("KILN_WEIGHT_ARENA", "1")
    gathered = LLM(llama_path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=1)
    model = gathered.engine.runner.model
    moved = _weights(model)
    assert moved and len(_arena_storages(model)) == 1
    assert moved[0].data_ptr() % arena.HUGE_PAGE == 0  # the first weight opens the arena
    offsets = [t.data_ptr() for t in moved]
    assert offsets == sorted(offsets)  # module order: the order a forward reads them
    assert len(_arena_storages(scattered.engine.runner.model)) > 1
    assert _greedy(gathered) == _greedy(scattered)


class _Held(nn.Module):
    def __init__(self):
        super().__init__()
        self.own = nn.Parameter(torch.ones(64, 64), requires_grad=False)
        self.small = nn.Parameter(torch.ones(4), requires_grad=False)
        stacked = torch.arange(2 * 64 * 64, dtype=torch.float32).view(2, 64, 64)
        self.stacked = stacked  # a plain attribute, as a packed weight
        self.expert = stacked[1]  # a view into it, as an expert's linear holds one


def test_a_shared_storage_moves_whole_with_every_tensor_holding_it(monkeypatch):
    monkeypatch.setattr(arena, "MIN_BYTES", 1024)
    held = _Held()
    own_id, stacked_ptr = id(held.own), held.stacked.data_ptr()
    stats = arena.gather_weights(held)
    # own; stacked, its view and the base both are views of (arange), together
    assert stats is not None and stats.tensors == 4
    assert stats.nbytes == 64 * 64 * 4 + 2 * 64 * 64 * 4
    assert id(held.own) == own_id and held.own.data_ptr() % arena.HUGE_PAGE == 0
    assert torch.equal(held.own, torch.ones(64, 64))
    assert held.stacked.data_ptr() != stacked_ptr
    assert held.expert.data_ptr() == held.stacked.data_ptr() + 64 * 64 * 4  # still its view
    assert torch.equal(held.expert, torch.arange(64 * 64, 2 * 64 * 64).view(64, 64).float())
    held.stacked[1, 0, 0] = -1.0  # a write through one is seen through the other
    assert held.expert[0, 0] == -1.0
    assert held.small.untyped_storage().nbytes() == 16  # below MIN_BYTES: stays


def test_a_storage_held_outside_the_model_stays(monkeypatch):
    monkeypatch.setattr(arena, "MIN_BYTES", 1024)
    held = _Held()
    outside = held.own.view(-1)  # e.g. a cache some other object keeps
    before = held.own.data_ptr()
    arena.gather_weights(held)
    assert held.own.data_ptr() == before == outside.data_ptr()


def test_disabled_leaves_the_weights_where_they_are(monkeypatch):
    monkeypatch.setattr(arena, "MIN_BYTES", 1024)
    monkeypatch.setenv("KILN_WEIGHT_ARENA", "0")
    held = _Held()
    before = held.own.data_ptr()
    assert arena.gather_weights(held) is None and held.own.data_ptr() == before


def _anon_huge_kib(address: int) -> int:
    """AnonHugePages of the mapping of this process that holds `address` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(a, 16) for a in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "AnonHugePages:":
                return int(line.split()[1])
    return 0


def test_the_arena_is_on_huge_pages_where_the_kernel_offers_them():
    mode = arena.transparent_huge_pages()
    buffer = arena.huge_page_buffer(8 << 20)
    buffer.fill_(1)
    assert buffer.data_ptr() % arena.HUGE_PAGE == 0 and buffer.numel() == 8 << 20
    if mode in ("always", "madvise"):  # THP off ("never", or no THP): 4 KiB pages, still one arena
        assert _anon_huge_kib(buffer.data_ptr()) >= 2048


def _rss() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmRSS"))


def test_trim_heap_hands_freed_heap_pages_back():
    # 128 MiB in 64 KiB chunks (below glibc's mmap threshold: on the heap), the last kept so
    # the heap's top cannot shrink on its own; freed, glibc keeps the pages until trimmed
    chunks = [bytearray(b"\x01" * (64 << 10)) for _ in range(2048)]
    keep = chunks[-1]
    del chunks
    freed = _rss()
    assert arena.trim_heap()
    assert freed - _rss() > 64 << 20
    assert keep[0] == 1
