"""The rank group's pieces with real gloo groups: two ranks as two threads of this process
(each group is an object of its own, so this is the same code two processes run)."""

from __future__ import annotations

import threading

import pytest
import torch

from kiln.distributed.launch import join_groups, join_store, open_store
from kiln.distributed.step_channel import HEADER_BYTES
from kiln.models.layers.parallel import HeadSplit, TensorParallel, check_tensor_parallel


def run_ranks(body, all_reduce: str = "gloo") -> list:
    """body(group) on rank 0 and rank 1 at once; their results, in rank order. `all_reduce`:
    the group's (gloo, or shm: shared memory)."""
    store = open_store(2, 30)
    results: list = [None, None]
    errors: list[BaseException] = []

    def rank(r: int) -> None:
        try:
            s = store if r == 0 else join_store(store.port, 2, 30)
            group = join_groups(s, r, 2, 30, all_reduce, name=f"test-{store.port}")
            results[r] = body(group)
            group.close()
        except BaseException as exc:  # re-raised in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    if errors:
        raise errors[0]
    return results


PAYLOADS = [b"", b"x", bytes(range(256)) * 31, b"a" * (HEADER_BYTES - 8),
            b"b" * (HEADER_BYTES - 7), bytes(70_000)]


def test_step_channel_carries_every_size():
    def body(group):
        if group.rank == 0:
            for payload in PAYLOADS:
                group.steps.send(payload)
            return None
        return [group.steps.receive() for _ in PAYLOADS]

    assert run_ranks(body)[1] == PAYLOADS


def test_all_reduce_and_gather():
    def body(group):
        r = group.rank
        fp32 = group.comm.all_reduce_(torch.tensor([1.5, -2.0]) * (r + 1))
        bf16 = group.comm.all_reduce_(torch.tensor([1.0, 256.0], dtype=torch.bfloat16) * (r + 1))
        gathered = group.comm.gather_to_first(torch.full((2, 3), float(r)))
        return fp32, bf16, gathered

    (fp32, bf16, gathered), (fp32_1, bf16_1, none) = run_ranks(body)
    assert fp32.tolist() == fp32_1.tolist() == [4.5, -6.0]
    # bf16 in, bf16 out (summed in fp32 on the way), the same on both ranks
    assert bf16.dtype == torch.bfloat16 and bf16.tolist() == bf16_1.tolist() == [3.0, 768.0]
    assert [t[0, 0].item() for t in gathered] == [0.0, 1.0] and none is None


class _Rank:
    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size


@pytest.mark.parametrize("size, kv_heads, expected", [
    (2, 4, [HeadSplit(4, 2, 0, 0), HeadSplit(4, 2, 4, 2)]),  # KV heads split
    (4, 2, [HeadSplit(2, 1, 2 * r, r // 2) for r in range(4)]),  # each KV head on 2 ranks
    (2, 1, [HeadSplit(4, 1, 0, 0), HeadSplit(4, 1, 4, 0)]),  # one KV head, replicated
])
def test_head_split(size, kv_heads, expected):
    assert [TensorParallel(_Rank(r, size)).heads(8, kv_heads) for r in range(size)] == expected


def test_vocab_rows_cover_the_vocabulary_once():
    rows = [TensorParallel(_Rank(r, 3)).vocab_rows(100) for r in range(3)]
    assert rows == [slice(0, 34), slice(34, 68), slice(68, 100)]


def test_bad_shapes_name_the_numbers():
    with pytest.raises(ValueError, match="tensor_parallel_size 4 does not divide the model's "
                                         "6 attention heads, 3 KV heads .neither divides the "
                                         "other., intermediate size 30"):
        check_tensor_parallel(4, 6, 3, 30)
    check_tensor_parallel(4, 8, 2, 64)  # KV heads replicated: fine
