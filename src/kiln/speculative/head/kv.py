"""The EAGLE-style head's paged KV cache and a drafting round's rows on it.

The head's cache (`HeadKV`) is one layer's K and V over the target's own slots, indexed by the
target's block tables, and scratch blocks after them. A round's draft rows (`DraftRows`) are
paged sequences of their own on that cache, so the head's catch-up and its draft steps take
the same attention path: the target's C++ kernel, or the torch reference.
"""

from __future__ import annotations

import torch

from kiln.models.layers.attention import SeqLayout


class HeadKV:
    """The head's paged KV cache (one layer): the target's slots, so the head's KV of a
    position sits in the block where the target keeps its own, then scratch blocks for the
    rows of a drafting round (`DraftRows`), grown as rounds need more."""

    def __init__(self, slots: int, kv_heads: int, head_dim: int, dtype: torch.dtype,
                 block_size: int, device: torch.device):
        self.block_size, self.main_blocks = block_size, slots // block_size
        self.kv = tuple(torch.zeros(slots, kv_heads, head_dim, dtype=dtype, device=device)
                        for _ in range(2))

    def scratch(self, blocks: int) -> int:
        """The first of `blocks` consecutive scratch blocks (their contents are the
        caller's)."""
        have = len(self.kv[0]) // self.block_size - self.main_blocks
        if have < blocks:
            more = max(blocks, 2 * have) - have
            self.kv = tuple(torch.cat((t, t.new_zeros(more * self.block_size, *t.shape[1:])))
                            for t in self.kv)
        return self.main_blocks

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor, kernels: bool) -> None:
        """K and V of slots `src` into slots `dst` (each source read before any write)."""
        src, dst = src.reshape(-1), dst.reshape(-1)
        if kernels:
            torch.ops.kiln.move_slots(list(self.kv), src, dst)
        else:
            for t in self.kv:
                t[dst] = t[src]


class DraftRows:
    """A drafting round's rows, each a paged sequence of its own. Row r of sequence s (up to
    `width` rows per sequence: a beam search's beams) reads s's verified context from the
    head's cache blocks, as the catch-up left them, and then its own path's draft keys, which
    it writes to scratch blocks continuing the context's last, partial block (copied in when
    the round starts). Every draft step is then an ordinary short-query attention over the
    cache, for the target's C++ kernel or the torch reference alike, with nothing gathered
    per round: row r at step j is a query at position ctx_s + j whose keys are positions
    0..ctx_s + j. Row i's scratch blocks are consecutive, at a fixed place per row index in
    one of two areas; when a beam search keeps its best rows (`reorder`), the kept rows'
    scratch is copied to the other area, in their new order."""

    def __init__(self, cache: HeadKV, ctx_len: torch.Tensor, tables: torch.Tensor,
                 rows_per_seq: int, width: int, steps: int, kernels: bool):
        bs, device = cache.block_size, ctx_len.device
        blocks = (2 * bs - 2 + steps) // bs  # scratch blocks per row: ctx % bs + steps slots
        self.cache, self.kernels, self.span = cache, kernels, blocks * bs
        self.area_rows = len(ctx_len) * width
        self.base = cache.scratch(2 * self.area_rows * blocks) * bs  # area 0, row 0
        self.seq_ctx, self.offset = ctx_len, ctx_len % bs
        # per sequence, a row's table less its scratch: context blocks, then the scratch
        # block's index among the row's own (own_mask 1 there)
        first = (ctx_len // bs)[:, None]
        col = torch.arange(int(first.max()) + blocks, device=device)
        own = col >= first
        context = tables[:, col.clamp(max=tables.shape[1] - 1)]
        self.table_base = torch.where(own, col - first, context)
        self.own_mask = own.long()
        self.area = 0
        self._assign(torch.arange(len(ctx_len), device=device).repeat_interleave(rows_per_seq))
        partial = tables.gather(1, first.clamp(max=tables.shape[1] - 1))[:, 0] * bs
        offsets = torch.arange(bs, device=device)
        cache.copy_slots(partial[self.seq][:, None] + offsets,
                         self.row_slot[:, None] + offsets, kernels)

    def _assign(self, seq: torch.Tensor) -> None:
        """Rows of sequences `seq` ([n]), in order, on the current area."""
        n = len(seq)
        self.seq, self.ctx = seq, self.seq_ctx[seq]
        self.starts = torch.arange(n, device=seq.device)
        self.row_slot = self.base + (self.area * self.area_rows + self.starts) * self.span
        first_block = (self.row_slot // self.cache.block_size)[:, None]
        self.tables = self.table_base[seq] + self.own_mask[seq] * first_block
        self.slot0 = self.row_slot + self.offset[seq]  # the slot of position ctx
        self.ones = torch.ones(n, dtype=torch.long, device=seq.device)

    def layout(self, step: int) -> tuple[SeqLayout, torch.Tensor, torch.Tensor]:
        """Draft step `step` (0 = the round's first): each row one query token at position
        ctx + step -> (their layout, positions, cache slots)."""
        return (SeqLayout(self.starts, self.ones, self.ctx + step, self.tables),
                self.ctx + step, self.slot0 + step)

    def reorder(self, rows: torch.Tensor) -> None:
        """Row i continues row rows[i] (of the same sequence): its path's keys become that
        row's."""
        src = self.row_slot[rows]
        self.area = 1 - self.area
        self._assign(self.seq[rows])
        span = torch.arange(self.span, device=src.device)
        self.cache.copy_slots(src[:, None] + span, self.row_slot[:, None] + span, self.kernels)
