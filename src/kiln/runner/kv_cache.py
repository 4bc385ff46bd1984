"""The runner's paged KV cache: its shape (`KVCacheSpec`), how many blocks fit, its tensors,
and moving slots inside them (a draft tree's accepted path, kiln.runner.model_runner).

Every layer holds `layout.num_tensors` tensors [slots, num_kv_heads, head_dim] (K and V; one
latent tensor for MLA: kiln.models.layers.kv_layout); block b owns slots
[b * block_size, (b + 1) * block_size).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kiln.config import CacheConfig
from kiln.engine.contract import ScheduledRequest
from kiln.models.layers.kv_layout import CacheHolds, CacheLayout
from kiln.runner.device_memory import DeviceMemory, gpu_kv_blocks
from kiln.runner.kv_io import KVCaches


@dataclass(frozen=True)
class KVCacheSpec:
    """Every layer's cache: `layout.num_tensors` tensors [slots, num_kv_heads, head_dim]
    (K and V; one latent tensor for MLA: kiln.models.layers.kv_layout)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    holds: CacheHolds = CacheHolds.KEY_VALUE

    @property
    def layout(self) -> CacheLayout:
        return CacheLayout(self.holds, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.layout.bytes_per_token(self.num_layers, self.dtype)


def num_kv_blocks(spec: KVCacheSpec, cache: CacheConfig, max_model_len: int,
                  max_num_seqs: int, device_memory: DeviceMemory | None = None) -> int:
    """Blocks that fit the configured budget; else, on a GPU (`device_memory` given), what
    gpu_memory_utilization leaves (kiln.runner.device_memory); else max_model_len x
    max_num_seqs tokens (capped)."""
    if cache.kv_cache_memory is not None:
        return cache.kv_cache_memory // spec.bytes_per_block
    if device_memory is not None:
        return gpu_kv_blocks(device_memory, cache.gpu_memory_utilization, spec.bytes_per_block)
    wanted = -(-max_model_len // spec.block_size) * max_num_seqs
    return max(1, min(wanted, cache.max_kv_cache_memory // spec.bytes_per_block))


def allocate_kv_caches(spec: KVCacheSpec, num_layers: int, num_blocks: int,
                       device: torch.device) -> KVCaches:
    """`num_layers` layers' caches of `num_blocks` blocks each, [num_blocks * block_size, Hkv,
    D] per tensor. Left uninitialized, so the OS maps pages only as blocks are first written;
    attention reads only written slots, except padded lanes of the reference path, which read
    slot 0 (masked out, but 0 x NaN would still be NaN): so block 0 is zeroed."""
    shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
    kv_caches = []
    for _ in range(num_layers):
        tensors = tuple(torch.empty(shape, dtype=spec.dtype, device=device)
                        for _ in range(spec.layout.num_tensors))
        for t in tensors:
            t[:spec.block_size].zero_()
        kv_caches.append(tensors)
    return kv_caches


def move_kv_slots(kv_caches: KVCaches, src: torch.Tensor, dst: torch.Tensor,
               one_call: bool) -> None:
    """Copy every layer's K and V from slots `src` to `dst` (gathered, then written);
    `one_call`: by the C++ kernels' kiln::move_slots, every layer at once."""
    if one_call:
        torch.ops.kiln.move_slots([c for kv in kv_caches for c in kv], src, dst)
    else:
        for cache in (t for layer in kv_caches for t in layer):
            cache[dst] = cache[src]


@dataclass
class PathMoves:
    """Where a step's accepted draft-tree paths go: KV slots `src` to `dst`, and the flat
    batch rows of the same tokens, `row_src` to `row_dst`."""

    src: list[int] = field(default_factory=list)
    dst: list[int] = field(default_factory=list)
    row_src: list[int] = field(default_factory=list)
    row_dst: list[int] = field(default_factory=list)


def path_moves(scheduled: list[ScheduledRequest], query_starts: list[int],
               paths: list[list[int] | None], block_size: int) -> PathMoves:
    """Draft c accepted at depth j sat in slot r + 1 + c, r the root's position: it moves to
    the slot of position r + 1 + j (and its flat row alike), so the cache reads as if the
    path alone had been computed. A draft already in place does not move."""
    moves = PathMoves()
    for item, path, q_start in zip(scheduled, paths, query_starts, strict=True):
        if not path:
            continue
        root = len(item.token_ids) - 1 - item.num_draft_tokens
        for j, c in enumerate(path):
            if c == j:
                continue
            for pos, out in ((item.start_pos + root + 1 + c, moves.src),
                             (item.start_pos + root + 1 + j, moves.dst)):
                out.append(item.block_ids[pos // block_size] * block_size + pos % block_size)
            moves.row_src.append(q_start + root + 1 + c)
            moves.row_dst.append(q_start + root + 1 + j)
    return moves
