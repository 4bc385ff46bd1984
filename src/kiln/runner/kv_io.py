"""Whole KV blocks out of and into the paged KV tensors, as raw bytes (KV transfer between
workers, kiln.cluster.transfer).

The runner's cache is a tuple of C tensors per layer, each [num_blocks * block_size, H, D]
(C = 2, K and V; C = 1, H = 1 for MLA's latent rows: kiln.models.layers.kv_layout); block b
owns slots [b * block_size, (b + 1) * block_size). An exported run of n blocks is one
contiguous tensor [num_layers, C, n * block_size, H, D] in the cache's dtype: its bytes go on
the wire as they are, with dtype and shape in a header, and are read back with `from_bytes`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch

KVCaches = list[tuple[torch.Tensor, ...]]

DTYPE_NAMES = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32",
               torch.float8_e4m3fn: "float8_e4m3fn", torch.uint8: "uint8", torch.int8: "int8"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


def block_shape(kv_caches: KVCaches, num_blocks: int, block_size: int) -> tuple[int, ...]:
    """[num_layers, C, num_blocks * block_size, H, D] for a run of `num_blocks` blocks."""
    _, heads, dim = kv_caches[0][0].shape
    return (len(kv_caches), len(kv_caches[0]), num_blocks * block_size, heads, dim)


def _slots(block_ids: Sequence[int], block_size: int, device: torch.device) -> torch.Tensor:
    ids = torch.tensor(list(block_ids), dtype=torch.long, device=device)
    return (ids[:, None] * block_size + torch.arange(block_size, device=device)).flatten()


@torch.inference_mode()
def export_blocks(kv_caches: KVCaches, block_ids: Sequence[int],
                  block_size: int) -> torch.Tensor:
    """A contiguous copy of the blocks' cache rows, [L, C, n * block_size, H, D]."""
    cache = kv_caches[0][0]
    slots = _slots(block_ids, block_size, cache.device)
    out = torch.empty(block_shape(kv_caches, len(block_ids), block_size), dtype=cache.dtype,
                      device=cache.device)
    for layer, tensors in enumerate(kv_caches):
        for i, tensor in enumerate(tensors):
            torch.index_select(tensor, 0, slots, out=out[layer, i])
    return out


@torch.inference_mode()
def import_blocks(kv_caches: KVCaches, block_ids: Sequence[int], block_size: int,
                  data: torch.Tensor) -> None:
    """Write `data` ([L, C, n * block_size, H, D], as `export_blocks` made it) into the
    blocks `block_ids` (n of them). The caller has checked shape and dtype."""
    slots = _slots(block_ids, block_size, kv_caches[0][0].device)
    for layer, tensors in enumerate(kv_caches):
        for i, tensor in enumerate(tensors):
            tensor.index_copy_(0, slots, data[layer, i])


def as_bytes(tensor: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous tensor (no copy; any dtype, bf16 included)."""
    return memoryview(tensor.contiguous().view(-1).view(torch.uint8).numpy())


def from_bytes(buffer, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    """A tensor viewing `buffer` (no copy; read-only use). Size must already be checked."""
    with warnings.catch_warnings():  # received buffers are read-only; we only read them
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.frombuffer(buffer, dtype=torch.uint8)
    return raw.view(dtype).view(tuple(shape))
