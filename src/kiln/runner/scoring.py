"""Teacher forcing: full-vocabulary next-token distributions of a kiln model over given text.

Quantization is judged by comparing these distributions between a quantized model and its
reference (kiln.quant.evaluate), position by position, so both must see exactly the same
tokens: no sampling, no engine, no scheduler. Each window of text is one sequence; a group of
windows is one flat batch computed in one step by the model's own forward, with a scratch
paged KV cache and the model's attention backend, exactly as the runner would prefill them.

A caller that changed only decoder blocks k.. (one quantized layer, say) need not recompute
blocks 0..k-1: `forward` can record every block's output once and later replay them, putting
a stand-in that returns the recorded output in place of each early block for one call. This
relies only on the model keeping its blocks in `model.model.layers` and calling them in order,
whatever each block passes to the next.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from kiln.models.layers.attention import SeqLayout
from kiln.models.layers.kv_layout import model_cache_layout

BlockOutput = object  # whatever a decoder block returns (a tensor, or a tuple of tensors)


@dataclass
class ForcedStep:
    """One flat batch of n windows of L tokens, with its attention metadata."""

    windows: torch.Tensor  # [n, L] token ids
    positions: torch.Tensor  # [n * L]
    meta: object  # the backend's attention metadata for this layout

    @property
    def scored_rows(self) -> torch.Tensor:
        """Flat rows that predict a token of their window: all but each window's last."""
        (n, length), device = self.windows.shape, self.windows.device
        return (torch.arange(n, device=device)[:, None] * length
                + torch.arange(length - 1, device=device)).reshape(-1)

    @property
    def targets(self) -> torch.Tensor:
        """[n * (L - 1)] the token each scored row predicts."""
        return self.windows[:, 1:].reshape(-1)


class TeacherForcer:
    """Runs `model` (a kiln causal LM) over token windows [S, L], `windows_per_step` at a time.

    Nothing persists between calls but the scratch KV cache, which each block overwrites
    before reading (it writes its keys, then attends).
    """

    def __init__(self, model: nn.Module, windows: torch.Tensor, block_size: int = 16,
                 windows_per_step: int = 4):
        self.model = model
        self.block_size = block_size
        self.blocks: nn.ModuleList = model.model.layers
        self.backend = self.blocks[0].self_attn.backend
        self.steps = [self._prepare(windows[i:i + windows_per_step])
                      for i in range(0, len(windows), windows_per_step)]
        per_window = -(-windows.shape[1] // block_size) * block_size
        self.kv = self._scratch_cache(min(len(windows), windows_per_step) * per_window)

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @torch.inference_mode()
    def forward(self, step: ForcedStep, replay: Sequence[BlockOutput] = (),
                record: list[BlockOutput] | None = None) -> torch.Tensor:
        """Final hidden states [n * L, H] of one step.

        replay: outputs of blocks 0..k-1 (from an earlier `record`), returned instead of
        computing those blocks. record: receives a copy of every computed block's output.
        """
        hooks = [] if record is None else [
            block.register_forward_hook(lambda _m, _a, out: record.append(_copy(out)))
            for block in self.blocks]
        try:
            with self._replaying(replay):
                return self.model(step.windows.reshape(-1), step.positions, self.kv, step.meta)
        finally:
            for hook in hooks:
                hook.remove()

    @torch.inference_mode()
    def log_probs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Hidden states [R, H] -> float32 next-token log-probabilities [R, V]."""
        return torch.log_softmax(self.model.compute_logits(hidden).float(), dim=-1)

    @contextmanager
    def _replaying(self, outputs: Sequence[BlockOutput]):
        originals = [self.blocks[i] for i in range(len(outputs))]
        try:
            for i, out in enumerate(outputs):
                self.blocks[i] = _Replay(out)
            yield
        finally:
            for i, block in enumerate(originals):
                self.blocks[i] = block

    def _prepare(self, windows: torch.Tensor) -> ForcedStep:
        """Window i owns blocks [i * B, (i + 1) * B), B = ceil(L / block_size); no context."""
        (n, length), device = windows.shape, windows.device
        blocks = -(-length // self.block_size)
        layout = SeqLayout(
            query_start=torch.arange(n, device=device) * length,
            query_lens=torch.full((n,), length, device=device),
            context_lens=torch.zeros(n, dtype=torch.int64, device=device),
            block_table=torch.arange(n * blocks, device=device).reshape(n, blocks))
        positions = torch.arange(length, device=device).repeat(n)  # [n * L]
        meta = self.backend.build_metadata(layout, positions, self.block_size)
        return ForcedStep(windows, positions, meta)

    def _scratch_cache(self, slots: int) -> list[tuple[torch.Tensor, ...]]:
        arch = self.model.arch
        like = self.model.model.embed_tokens.weight  # the model's dtype and device
        layout = model_cache_layout(self.model, arch.num_kv_heads, arch.head_dim)
        shape = (slots, layout.num_heads, layout.head_dim)
        return [tuple(torch.zeros(shape, dtype=like.dtype, device=like.device)
                      for _ in range(layout.num_tensors))
                for _ in range(arch.num_layers)]


class _Replay(nn.Module):
    """Stands in for a decoder block: returns a recorded output (copied, since later blocks
    may update their inputs in place)."""

    def __init__(self, output: BlockOutput):
        super().__init__()
        self.output = output

    def forward(self, *args, **kwargs) -> BlockOutput:
        return _copy(self.output)


def _copy(out: BlockOutput) -> BlockOutput:
    if isinstance(out, torch.Tensor):
        return out.clone()
    if isinstance(out, tuple):
        return tuple(_copy(o) for o in out)
    return out
