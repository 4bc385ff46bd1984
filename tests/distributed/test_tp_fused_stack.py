"""The fused decoder stack at TP=2 (kiln::llama_stack summing o_proj's and down_proj's outputs
through the shared-memory all-reduce from inside its loop) against the per-layer path at TP=2
and one process: 2 real rank processes, tiny checkpoints.

fp32 activations with weight-only int8 weights (the stack's int8 GEMV serves decode steps; a
plain fp32 model has no stack) and bf16 weights (every step fused). The per-layer engines are
the same engines with KILN_DISABLE_FUSED_STACK set (their ranks inherit it). The last test
kills a rank of the bf16 engine, so it runs last.
"""

from __future__ import annotations

import signal
import threading
import time
from datetime import timedelta

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.distributed.communicator import GlooCommunicator, RankFailure, ShmCommunicator
from kiln.kernels import cpu as cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.load(), reason="kiln CPU kernels did not build")

PROMPTS = [[5, 6, 7, 8, 9], list(range(10, 50)), [100, 3, 77, 4]]  # 5, 40 and 4 tokens
GREEDY = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, prompt_logprobs=0,
                        logprobs=2)
TIMEOUT_S = 10  # a dead rank is seen when the shared-memory wait times out: keep it short
SETTINGS = dict(kv_cache_memory=4 << 20, max_num_batched_tokens=16, num_threads=1)


def tp2(path: str, monkeypatch, *, fused: bool, **settings) -> LLM:
    with monkeypatch.context() as env:
        if not fused:
            env.setenv("KILN_DISABLE_FUSED_STACK", "1")
        return LLM(path, **SETTINGS, **settings, tensor_parallel_size=2, all_reduce="shm",
                   dist_timeout_s=TIMEOUT_S)


@pytest.fixture(scope="module")
def module_monkeypatch():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def int8_engines(tiny_ckpt, module_monkeypatch):
    """One process, TP=2 fused, TP=2 layer by layer; fp32 activations, int8 weights; one KV
    head, replicated on both ranks (the bf16 model splits its two)."""
    path = tiny_ckpt("llama", num_key_value_heads=1)
    settings = dict(dtype="float32", quantization="int8")
    one = LLM(path, **SETTINGS, **settings)
    fused = tp2(path, module_monkeypatch, fused=True, **settings)
    layered = tp2(path, module_monkeypatch, fused=False, **settings)
    yield one, fused, layered
    fused.close()
    layered.close()


@pytest.fixture(scope="module")
def bf16_engines(tiny_ckpt, module_monkeypatch):
    """TP=2 fused and layer by layer, bf16 (head dim 64: long chunks fuse too); 2 KV heads,
    one per rank."""
    path = tiny_ckpt("llama", hidden_size=256, intermediate_size=512, num_hidden_layers=2)
    fused = tp2(path, module_monkeypatch, fused=True, dtype="bfloat16")
    layered = tp2(path, module_monkeypatch, fused=False, dtype="bfloat16")
    yield fused, layered
    fused.close()
    layered.close()


def results(llm: LLM) -> list[tuple[list[int], list[float], list]]:
    """Tokens, prompt logprobs and the sampled tokens' top logprobs of each prompt."""
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [(o.outputs[0].token_ids,
             [pos[t].logprob for pos, t in zip(o.prompt_logprobs[1:], o.prompt_token_ids[1:],
                                               strict=True)],
             [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs])
            for o in outs]


def fused_steps(llm: LLM) -> int:
    return llm.engine.runner.fused_steps


def test_int8_tp2_fused_matches_layers_and_one_process(int8_engines):
    one, fused, layered = int8_engines
    assert fused.engine.runner.stack.all_reduce is not None and layered.engine.runner.stack is None
    before = fused_steps(fused)
    reference, sharded, sharded_layers = results(one), results(fused), results(layered)
    assert fused_steps(fused) - before >= GREEDY.max_tokens - 1  # every decode step fused
    assert fused_steps(layered) == 0
    assert sharded == sharded_layers  # the same kernels and sums, to the bit
    for (ref_tokens, ref_lp, _), (tokens, lp, _) in zip(reference, sharded, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(ref_lp, lp, strict=True)) < 1e-4


def test_bf16_tp2_fused_matches_layers(bf16_engines):
    fused, layered = bf16_engines
    before = fused_steps(fused)
    sharded = results(fused)
    steps = fused_steps(fused) - before
    assert sharded == results(layered)
    assert steps >= GREEDY.max_tokens + 2  # prefill chunks too (40 tokens in 16-token steps)


def test_ranks_mix_fused_and_layered_steps(bf16_engines):
    """Rank 0 layer by layer while rank 1 runs the stack: the two paths make the same
    all-reduce calls on one segment, so they stay in step, with the same bits."""
    fused, layered = bf16_engines
    runner = fused.engine.runner
    stack, runner.stack = runner.stack, None
    try:
        mixed = results(fused)
    finally:
        runner.stack = stack
    assert mixed == results(layered)


def test_gloo_row_parallel_layers_stay_off_the_stack():
    """Over gloo a row-parallel layer hands the stack nothing (a C++ kernel cannot reduce
    over gloo), over shared memory its tensors and the group."""
    import torch.distributed as dist

    from kiln.models.layers.cpu_bf16 import CpuBf16LinearMethod
    from kiln.models.layers.linear import Linear
    from kiln.models.layers.parallel import RowParallel

    def row_layer(comm) -> Linear:
        layer = Linear(64, 32, dtype=torch.bfloat16,
                       method=RowParallel(CpuBf16LinearMethod(), slice(0, 64), comm))
        layer.method.load_shard(layer, 0, "weight", torch.randn(32, 64).bfloat16())
        layer.method.finalize(layer)
        return layer

    def group() -> dist.ProcessGroupGloo:
        return dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=5))

    gloo = row_layer(GlooCommunicator(group(), 5))
    shm_comm = ShmCommunicator(group(), 5, f"test-fused-{time.monotonic_ns()}")
    shm = row_layer(shm_comm)
    assert gloo.method.stack_tensors(gloo) is None
    assert shm.method.stack_tensors(shm).all_reduce is shm_comm
    shm_comm.close()


def test_a_rank_missing_inside_the_stack_times_out():
    """Rank 1 joins the group and never reduces: rank 0's stack raises from inside its
    first all-reduce after the timeout, and the group stays broken."""
    from kiln.distributed.shm_allreduce import ShmAllReduce

    name, joined = f"test-stack-{time.monotonic_ns()}", []
    peer = threading.Thread(target=lambda: joined.append(ShmAllReduce(name, 1, 2, 4096)))
    peer.start()
    group = ShmAllReduce(name, 0, 2, 4096, timeout_s=0.3)
    peer.join()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"^shm all-reduce: rank 0 gave up waiting for rank 1"):
        group.inside(lambda segment, rank, timeout_s: one_layer_stack(segment, rank, timeout_s))
    assert time.monotonic() - started < 5
    with pytest.raises(RuntimeError, match="broken by an earlier failed call"):
        group.all_reduce_(torch.zeros(4))


def one_layer_stack(segment: torch.Tensor, rank: int, timeout_s: float) -> torch.Tensor:
    """kiln::llama_stack over one random bf16 layer (plain weights through bf16_gemm; no
    attention tables, so the attention output is left as allocated: only the reduction
    matters here)."""
    hidden, heads, head_dim, inter = 64, 2, 32, 128

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape) * 0.05).bfloat16()

    ones = torch.ones(hidden, dtype=torch.bfloat16)
    cache = torch.zeros(16, heads, head_dim, dtype=torch.bfloat16)
    table = torch.zeros(8, head_dim)
    return torch.ops.kiln.llama_stack(
        w(1, hidden), torch.zeros(1, dtype=torch.int64), [ones],
        [w(3 * heads * head_dim, hidden)], [w(hidden, heads * head_dim)], [ones],
        [w(2 * inter, hidden)], [w(hidden, inter)], [], [], [], [], [], [], [None], [None], 0,
        False, ones, table, table,
        [cache], [cache.clone()], torch.zeros(1, dtype=torch.int64), None, None, None, None,
        None, None, None, None, None, 16, head_dim ** -0.5, 1e-5, heads, heads, head_dim, True,
        segment, rank, timeout_s)


def test_a_killed_rank_fails_the_fused_engine_fast(bf16_engines):
    fused, _ = bf16_engines
    follower = fused.engine.runner.leader.processes[0]
    long = SamplingParams(max_tokens=900, temperature=0, ignore_eos=True)
    killed_at: list[float] = []

    def kill() -> None:
        killed_at.append(time.monotonic())
        follower.send_signal(signal.SIGKILL)

    threading.Timer(0.3, kill).start()
    before = fused_steps(fused)
    with pytest.raises(RankFailure, match="a rank died"):
        fused.generate([[5, 6, 7 + i] for i in range(8)], long, use_tqdm=False)
    assert killed_at and time.monotonic() - killed_at[0] < TIMEOUT_S + 10
    assert fused_steps(fused) > before and follower.poll() is not None
    with pytest.raises(RankFailure):  # and stays failed, without hanging
        fused.generate([[5, 6, 7]], GREEDY, use_tqdm=False)
