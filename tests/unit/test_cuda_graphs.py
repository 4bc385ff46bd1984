"""The CPU-testable half of CUDA graphs (kiln.runner.cuda_graphs): bucket sizes, which steps a
bucket serves, how the static buffers are filled and padded, and the padded decode path run
eagerly through the engine (capture=False), which must give the tokens of the plain path.
Capture and replay themselves are tests/gpu's."""

from __future__ import annotations

import torch

from kiln.engine.contract import SchedulerOutput
from kiln.models.layers.attention import SeqLayout
from kiln.runner.batch import BatchInputs
from kiln.runner.cuda_graphs import (
    DecodeBuffers,
    bucket_for,
    capture_sizes,
    is_decode_step,
    run_buckets_eagerly,
)


def test_capture_sizes():
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert capture_sizes(5) == (1, 2, 4, 5)
    assert capture_sizes(1) == (1,)
    assert capture_sizes(12) == (1, 2, 4, 8, 12)
    assert capture_sizes(1000)[-3:] == (240, 248, 256)


def test_bucket_for():
    sizes = capture_sizes(64)
    assert [bucket_for(n, sizes) for n in (1, 2, 3, 5, 8, 9, 63, 64)] == [1, 2, 4, 8, 8, 16, 64,
                                                                          64]
    assert bucket_for(65, sizes) is None and bucket_for(0, sizes) is None


class _Item:
    def __init__(self, n: int):
        self.token_ids = list(range(n))


def test_is_decode_step():
    def sched(*lens: int) -> SchedulerOutput:
        return SchedulerOutput([_Item(n) for n in lens], sum(lens))  # type: ignore[list-item]

    assert is_decode_step(sched(1, 1, 1))
    assert not is_decode_step(sched(1, 3))  # drafts or a prefill chunk
    assert not is_decode_step(sched())


def test_buffers_take_the_step_and_pad_on_the_scratch_block():
    buffers = DecodeBuffers(size=8, max_blocks=4, device=torch.device("cpu"))
    buffers.block_table.fill_(7)  # stale ids of an earlier step
    layout = SeqLayout(query_start=torch.tensor([0, 1, 2]), query_lens=torch.tensor([1, 1, 1]),
                       context_lens=torch.tensor([5, 20, 0]),
                       block_table=torch.tensor([[3, 0], [1, 2], [4, 0]]))
    batch = BatchInputs(input_ids=torch.tensor([11, 12, 13]), positions=torch.tensor([5, 20, 0]),
                        slot_positions=torch.tensor([5, 20, 0]), layout=layout,
                        logits_index=torch.tensor([0, 1, 2]), rows=[])
    slots = torch.tensor([53, 36, 64])
    buffers.load(batch, slots, size=4, scratch_block=9, block_size=16)
    assert buffers.input_ids.tolist() == [11, 12, 13, 0, 0, 0, 0, 0]
    assert buffers.positions[:4].tolist() == [5, 20, 0, 0]
    assert buffers.slot_mapping[:4].tolist() == [53, 36, 64, 9 * 16]
    assert buffers.context_lens[:4].tolist() == [5, 20, 0, 0]
    assert buffers.seq_lens[:4].tolist() == [6, 21, 1, 1]
    assert buffers.block_table[:4].tolist() == [[3, 0, 7, 7], [1, 2, 7, 7], [4, 0, 7, 7],
                                                [9, 7, 7, 7]]
    view = buffers.layout(4)
    assert view.query_start.tolist() == [0, 1, 2, 3] and view.query_lens.tolist() == [1] * 4
    assert view.block_table.data_ptr() == buffers.block_table.data_ptr()  # views, not copies


def test_padded_decode_gives_the_plain_tokens(llama_path):
    """The engine's decode steps through the buckets' padded static buffers (run eagerly:
    capture=False) give the tokens of the plain path, inside the buckets (3 sequences in a
    bucket of 4) and beside them (5, above the largest bucket, eager)."""
    from kiln import LLM, SamplingParams

    prompts = ["The quick brown fox", "Paris is the capital", "def add(a, b):",
               "Large language models", "0123456789"]
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)

    def llm():
        return LLM(llama_path, dtype="float32", kv_cache_memory=2 << 20, num_threads=1,
                   attention_backend="torch", kernels="torch")

    plain = llm()
    padded = llm()
    runner = padded.engine.runner
    run_buckets_eagerly(runner, max_num_seqs=4, max_model_len=128)
    for batch in (prompts[:3], prompts, prompts[:1]):
        served = runner.graphs.served
        expected = [o.outputs[0].token_ids for o in plain.generate(batch, params,
                                                                   use_tqdm=False)]
        got = [o.outputs[0].token_ids for o in padded.generate(batch, params, use_tqdm=False)]
        assert got == expected
        # 5 decode steps each; 5 sequences exceed the largest bucket (4) and run eagerly
        assert runner.graphs.served - served == (0 if len(batch) > 4 else 5)
