"""What the Triton kernel tests share: the devices they run on, tolerances and small builders
of paged caches and flat batches."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from kiln.kernels.triton import INTERPRETED

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}
DTYPES = [torch.float32, torch.bfloat16]

# "cpu" runs under the interpreter (only where this process interprets: no CUDA device);
# "cuda" compiles the same kernels (gpu-marked: skipped without a GPU, run by
# benchmarks/gpu_check.py).
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(not INTERPRETED,
                                                 reason="kernels compile for the GPU here")),
    pytest.param("cuda", marks=pytest.mark.gpu),
]


def close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual.float().cpu(), expected.float().cpu(), atol=TOL[dtype],
                               rtol=TOL[dtype])


@dataclass(frozen=True)
class PagedBatch:
    """A flat batch of sequences over a random paged cache, blocks handed out shuffled."""

    q: torch.Tensor  # [T, Hq, D]
    k_cache: torch.Tensor  # [num_slots, Hkv, D]
    v_cache: torch.Tensor
    block_table: torch.Tensor  # [S, max_blocks] int64
    query_start: torch.Tensor  # [S]
    query_lens: torch.Tensor
    context_lens: torch.Tensor
    block_size: int

    @property
    def seq_lens(self) -> torch.Tensor:
        return self.context_lens + self.query_lens


def paged_batch(context_lens: list[int], query_lens: list[int], num_q_heads: int,
                num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                device: str, seed: int = 0) -> PagedBatch:
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [max(1, -(-(c + n) // block_size)) for c, n in
                      zip(context_lens, query_lens, strict=True)]
    num_blocks = sum(blocks_per_seq) + 2  # spare blocks the tables never name
    order = torch.randperm(num_blocks, generator=gen)
    table = torch.zeros(len(context_lens), max(blocks_per_seq), dtype=torch.int64)
    used = 0
    for s, count in enumerate(blocks_per_seq):
        table[s, :count] = order[used:used + count]
        used += count
    cache_shape = (num_blocks * block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    v_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    q = torch.randn(sum(query_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    query_lens_t = torch.tensor(query_lens)
    query_start = torch.cumsum(query_lens_t, 0) - query_lens_t
    return PagedBatch(q.to(device), k_cache.to(device), v_cache.to(device), table.to(device),
                      query_start.to(device), query_lens_t.to(device),
                      torch.tensor(context_lens).to(device), block_size)
