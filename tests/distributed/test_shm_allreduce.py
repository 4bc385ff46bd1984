"""The shared-memory all-reduce against gloo's, between real processes: exact in fp32 (a sum of
two numbers does not depend on their order), bf16 equal to the fp32 sum of every rank's bf16
values rounded once; many consecutive calls (the double-buffered slots reused); all-to-all
calls as gloo's, interleaved with all-reduces, and ranks that disagree named; a rank that
dies fails the others' next call within the timeout; bad arguments fail at once."""

from __future__ import annotations

import os
import threading
import time
import uuid
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kiln.distributed.shm_allreduce import ShmAllReduce, segment_path
from tests.kernels.common import needs_cpu_kernels

pytestmark = needs_cpu_kernels

WORLD = 2
CHUNK_BYTES = 4096  # the groups' max_bytes: 1024 fp32 or 2048 bf16 elements per chunk
# one element, odd sizes, a batch-1 and a batch-64 hidden state of the default model (576),
# and sizes of several chunks (the last not a whole one)
SHAPES = [(1,), (7,), (1001,), (1, 576), (64, 576), (2 * 1024 + 3,)]


def unique_name() -> str:
    return f"test-{uuid.uuid4().hex[:12]}"


def run_ranks(fn, *args, timeout_s: float = 240.0) -> None:
    """Run fn(rank, *args) in WORLD spawned processes; a rank's exception fails the test, and
    so does a rank still running after timeout_s (killed, never left hanging)."""
    ranks = mp.start_processes(fn, args=args, nprocs=WORLD, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not ranks.join(timeout=1):
        if time.monotonic() > deadline:
            for process in ranks.processes:
                process.kill()
            pytest.fail(f"ranks still running after {timeout_s} s")


def bf16_reference(x: torch.Tensor, group) -> torch.Tensor:
    """Every rank's bf16 tensor summed in fp32 in rank order, rounded once."""
    parts = [torch.empty_like(x) for _ in range(WORLD)]
    dist.all_gather(parts, x, group=group)
    total = parts[0].float()
    for part in parts[1:]:
        total = total + part.float()
    return total.bfloat16()


def gloo_reference(x: torch.Tensor, group) -> torch.Tensor:
    if x.dtype == torch.bfloat16:
        return bf16_reference(x, group)
    out = x.clone()
    dist.all_reduce(out, group=group)
    return out


def _two_ranks(rank: int, store: str, name: str) -> None:
    """Every two-process check, one group each, in one pair of processes (starting a process
    that imports torch costs seconds)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank,
                            world_size=WORLD, timeout=timedelta(seconds=60))
    _matches_gloo(rank, name + "-gloo")
    _consecutive_calls(rank, name + "-calls")
    _mismatched_tensors(rank, name + "-mismatch")
    _all_to_all_matches_gloo(rank, name + "-a2a")
    _all_to_all_mismatches(rank, name + "-a2a-mismatch")
    dist.destroy_process_group()
    _one_rank_exits(rank, name + "-exit")


def _matches_gloo(rank: int, name: str) -> None:
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=60)
    generator = torch.Generator().manual_seed(1234 + rank)
    for shape in SHAPES:
        for dtype in (torch.float32, torch.bfloat16):
            x = torch.randn(shape, generator=generator).to(dtype)
            expected = gloo_reference(x, None)
            shm.all_reduce_(x)
            assert torch.equal(x, expected), f"{shape} {dtype}: max error " \
                f"{(x.float() - expected.float()).abs().max()}"
    shm.close()


def _consecutive_calls(rank: int, name: str) -> None:
    """200 calls in a row with values every rank can predict and both dtypes; every call
    must see only its own values. Sizes of 1 to 3 chunks start a call's steps on either slot;
    one of 40 chunks runs 40 steps back to back in C++, where a rank that reused a slot too
    early would overwrite it while the other still reads it. Values are small integers:
    exact in fp32 and bf16."""
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=60)
    for call in range(200):
        numel = (1, 576, 1500, 2500, 40 * 1024)[call % 5]
        dtype = torch.bfloat16 if call % 3 == 0 else torch.float32
        values = [call_values(call, numel, r) for r in range(WORLD)]
        x = values[rank].to(dtype)
        shm.all_reduce_(x)
        expected = sum(values).to(dtype)
        assert torch.equal(x, expected), f"call {call}: {x[:8]} != {expected[:8]}"
    shm.close()


def call_values(call: int, numel: int, rank: int) -> torch.Tensor:
    return torch.arange(numel) % 7 + (call % 11) * (rank + 1)


def _mismatched_tensors(rank: int, name: str) -> None:
    """Ranks passing different element counts both fail with a message naming them, and the
    group refuses later calls."""
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=60)
    with pytest.raises(RuntimeError, match="same element count"):
        shm.all_reduce_(torch.ones(10 + rank))
    with pytest.raises(RuntimeError, match="broken"):
        shm.all_reduce_(torch.ones(10))
    shm.close()


# all-to-all calls: rows each rank sends each rank (rank-major), of rows [R, 5] int32 (20
# bytes): from none to ~20 windows of the 4096-byte chunk (less its 64-byte header of offsets)
A2A_ROWS = [[[0, 0], [0, 0]], [[1, 2], [3, 0]], [[700, 3], [0, 2500]], [[0, 4000], [1, 0]],
            [[5, 6], [7, 8]]]


def _all_to_all_matches_gloo(rank: int, name: str) -> None:
    """Every call's rows arrive as gloo's all_to_all_single delivers them, the all-to-all
    steps interleaved with all-reduces on the same segment (its step counter)."""
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=60)
    for call, rows in enumerate(A2A_ROWS):
        send_rows, recv_rows = rows[rank], [rows[r][rank] for r in range(WORLD)]
        send = (torch.arange(sum(send_rows) * 5) * (rank + 1) + call).to(torch.int32)
        send = send.view(-1, 5)
        expected = torch.empty(sum(recv_rows), 5, dtype=torch.int32)
        dist.all_to_all_single(expected, send, recv_rows, send_rows)
        got = torch.empty_like(expected)
        shm.all_to_all(send, [n * 20 for n in send_rows], got, [n * 20 for n in recv_rows])
        assert torch.equal(got, expected), f"call {call}"
        x = torch.full((700,), float(rank + call))
        shm.all_reduce_(x)
        assert x.tolist() == [float(1 + 2 * call)] * 700
    shm.close()


def _all_to_all_mismatches(rank: int, name: str) -> None:
    """A rank expecting other sizes than its peer sends it, or whose peer calls all-reduce
    meanwhile, fails with a message naming them."""
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=60)
    if rank == 0:
        with pytest.raises(RuntimeError, match="rank 0 expects 8 bytes from rank 1, which "
                                               "sends it 4"):
            shm.all_to_all(torch.zeros(4, dtype=torch.uint8), [4, 0], torch.zeros(12,
                           dtype=torch.uint8), [4, 8])
    else:  # what it expects is what rank 0 sends it: only rank 0 can tell
        shm.all_to_all(torch.zeros(4, dtype=torch.uint8), [4, 0], torch.zeros(0,
                       dtype=torch.uint8), [0, 0])
    shm.close()
    other = ShmAllReduce(name + "-kind", rank, WORLD, CHUNK_BYTES, timeout_s=60)
    with pytest.raises(RuntimeError, match="exchanges all-to-all|every rank must call the "
                                           "same collective"):
        if rank == 0:
            other.all_reduce_(torch.ones(4))
        else:
            other.all_to_all(torch.zeros(0, dtype=torch.uint8), [0, 0],
                             torch.zeros(0, dtype=torch.uint8), [0, 0])
    other.close()


def _one_rank_exits(rank: int, name: str) -> None:
    """Rank 1 exits after attaching; rank 0's next call fails within its 2-second timeout."""
    shm = ShmAllReduce(name, rank, WORLD, CHUNK_BYTES, timeout_s=2)
    if rank == 1:
        os._exit(0)  # dies without a word: no close, no call
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="gave up waiting for rank 1"):
        shm.all_reduce_(torch.ones(576))
    assert time.monotonic() - start < 10
    with pytest.raises(RuntimeError, match="broken"):
        shm.all_reduce_(torch.ones(576))


def test_two_ranks_match_gloo_reuse_slots_and_fail_fast(tmp_path):
    """Against gloo on random tensors; 200 consecutive calls; ranks passing different
    tensors; a rank that exits (each function's docstring says what)."""
    name = unique_name()
    run_ranks(_two_ranks, str(tmp_path / "store"), name)
    assert not any(segment_path(name + suffix).exists()
                   for suffix in ("-gloo", "-calls", "-mismatch", "-a2a", "-a2a-mismatch",
                                  "-a2a-mismatch-kind", "-exit"))


def test_a_rank_alone_gives_up_within_the_timeout():
    name = unique_name()
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 1 gave up waiting for rank 0 to create"):
        ShmAllReduce(name, 1, WORLD, CHUNK_BYTES, timeout_s=0.3)
    with pytest.raises(RuntimeError, match="rank 0 gave up waiting for rank 1 to attach"):
        ShmAllReduce(name, 0, WORLD, CHUNK_BYTES, timeout_s=0.3)
    assert time.monotonic() - start < 10
    assert not segment_path(name).exists()


def test_ranks_that_disagree_on_max_bytes_are_told_so():
    """Rank 0 in a thread (the kernels release the GIL while they wait), rank 1 here."""
    name, failures = unique_name(), []

    def rank_0():
        try:
            ShmAllReduce(name, 0, WORLD, CHUNK_BYTES, timeout_s=2)
        except RuntimeError as exc:
            failures.append(str(exc))

    thread = threading.Thread(target=rank_0)
    thread.start()
    with pytest.raises(RuntimeError, match="do all ranks pass the same world_size and max_bytes"):
        ShmAllReduce(name, 1, WORLD, 2 * CHUNK_BYTES, timeout_s=10)
    thread.join()
    assert failures and "gave up waiting for rank 1 to attach" in failures[0]
    assert not segment_path(name).exists()


def test_one_rank_reduces_to_itself_in_chunks():
    shm = ShmAllReduce(unique_name(), 0, 1, CHUNK_BYTES)
    x = torch.randn(5000)
    expected = x.clone()
    shm.all_reduce_(x)
    assert torch.equal(x, expected)
    shm.close()
    with pytest.raises(RuntimeError, match="closed"):
        shm.all_reduce_(x)


@pytest.mark.parametrize("arguments, message", [
    (("bad/name", 0, 2, 64), "name"),
    (("ok", 2, 2, 64), "rank=2 is outside"),
    (("ok", 0, 0, 64), "world_size=0"),
    (("ok", 0, 2, 0), "max_bytes=0"),
])
def test_bad_arguments_are_named(arguments, message):
    with pytest.raises(ValueError, match=message):
        ShmAllReduce(*arguments)


def test_bad_tensors_are_refused_before_any_exchange():
    shm = ShmAllReduce(unique_name(), 0, 1, CHUNK_BYTES)
    with pytest.raises(TypeError, match="float16"):
        shm.all_reduce_(torch.ones(4, dtype=torch.float16))
    with pytest.raises(ValueError, match="strided"):
        shm.all_reduce_(torch.ones(4, 4).t())
    x = torch.ones(3)
    shm.all_reduce_(x)  # the group is not broken by refused input
    assert torch.equal(x, torch.ones(3))
    shm.close()
