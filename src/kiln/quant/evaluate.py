"""Fidelity of a quantized model: KL divergence of next-token distributions vs the reference.

For each position t of held-out text, both models see tokens 0..t (teacher forcing) and give
a distribution over the whole vocabulary for token t + 1. The loss of quantization at t is
  KL(P_ref || P_q) = sum_v P_ref(v) (log P_ref(v) - log P_q(v))   (nats),
reported as its mean and 99th percentile over positions, beside top-1 agreement (both argmaxes
equal) and both models' perplexity on the actual next tokens.

`KLProbe` holds the reference over fixed windows and measures variants of it: the reference
with some linear layers' weights replaced (one layer alone for sensitivity, a combination for
selection), or a whole other model (a quantized checkpoint as served). It caches the
reference's log-probabilities and each decoder block's output once, so a variant whose first
replaced layer sits in block k recomputes blocks k.. only.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kiln.models.layers.linear import Linear, get_linear_method, shard_rows
from kiln.runner.scoring import ForcedStep, TeacherForcer

ROWS_PER_CHUNK = 512  # logits rows per chunk: 512 x 49k x 4 B = 100 MB per temporary
_BLOCK = re.compile(r"\.layers\.(\d+)\.")


@dataclass(frozen=True)
class Fidelity:
    """How closely a model's next-token distributions follow the reference's."""

    mean_kl: float
    p99_kl: float
    top1_agreement: float  # fraction of positions with the same argmax
    ppl: float  # this model's perplexity on the text
    ref_ppl: float  # the reference's
    tokens: int  # positions measured


def kl_divergence(ref_logp: torch.Tensor, logp: torch.Tensor) -> torch.Tensor:
    """KL(P_ref || P) per row, in nats: log-probabilities [N, V] each -> [N].

    Terms where P_ref is 0 contribute 0 (even where log P is -inf there)."""
    p = ref_logp.exp()
    terms = torch.where(p > 0, p * (ref_logp - logp), torch.zeros_like(p))
    return terms.sum(dim=-1).clamp_min(0.0)  # rounding can leave -1e-9 for identical rows


@dataclass(frozen=True)
class RefRows:
    """The reference's distributions at some positions, in the form KL needs repeatedly:
    KL(P_ref || P) = sum P_ref log P_ref - sum P_ref log P = negentropy - <P_ref, log P>."""

    probs: torch.Tensor  # [N, V] float32
    negentropy: torch.Tensor  # [N]: sum_v P_ref log P_ref
    argmax: torch.Tensor  # [N]

    @classmethod
    def of(cls, ref_logp: torch.Tensor) -> RefRows:
        probs = ref_logp.exp()
        terms = torch.where(probs > 0, probs * ref_logp, torch.zeros_like(probs))
        return cls(probs, terms.sum(-1), ref_logp.argmax(-1))

    def __getitem__(self, rows: slice) -> RefRows:
        return RefRows(self.probs[rows], self.negentropy[rows], self.argmax[rows])

    def kl(self, logp: torch.Tensor) -> torch.Tensor:
        """KL(P_ref || P) per row for finite log-probabilities [N, V] (one pass over V)."""
        dot = torch.bmm(self.probs[:, None, :], logp[:, :, None]).reshape(-1)
        return (self.negentropy - dot).clamp_min(0.0)  # rounding: -1e-9 for equal rows


@dataclass
class PositionStats:
    """Per-position measurements, concatenated over chunks."""

    kl: list[torch.Tensor]
    agree: list[torch.Tensor]
    nll: list[torch.Tensor]

    @classmethod
    def empty(cls) -> PositionStats:
        return cls([], [], [])

    def add(self, ref: RefRows, logp: torch.Tensor, targets: torch.Tensor) -> None:
        self.kl.append(ref.kl(logp))
        self.agree.append(ref.argmax == logp.argmax(-1))
        self.nll.append(-logp.gather(1, targets[:, None]).squeeze(1))

    def summary(self, ref_nll: torch.Tensor) -> Fidelity:
        kl = torch.cat(self.kl).double()
        return Fidelity(
            mean_kl=kl.mean().item(), p99_kl=torch.quantile(kl, 0.99).item(),
            top1_agreement=torch.cat(self.agree).double().mean().item(),
            ppl=torch.cat(self.nll).double().mean().exp().item(),
            ref_ppl=ref_nll.double().mean().exp().item(), tokens=len(kl))


@dataclass
class _RefStep:
    step: ForcedStep
    block_outputs: list  # what each decoder block returned, to replay unchanged blocks
    rows: RefRows  # scored rows only: [n * (L - 1), V]
    nll: torch.Tensor  # [n * (L - 1)] the reference's loss on the actual next tokens


class KLProbe:
    """The reference `model` (dense; fp32 measures the weights alone) over token windows
    [S, L], and the fidelity of variants of it on the same windows."""

    def __init__(self, model: nn.Module, windows: torch.Tensor, windows_per_step: int = 4,
                 reuse_blocks: bool = True):
        self.model = model
        self.reuse_blocks = reuse_blocks  # keep block outputs (memory: 2 x T x H per block)
        self.forcer = TeacherForcer(model, windows, windows_per_step=windows_per_step)
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
        self.ref = [self._reference(step) for step in self.forcer.steps]
        self.ref_nll = torch.cat([r.nll for r in self.ref])

    @property
    def tokens(self) -> int:
        return len(self.ref_nll)

    def measure(self, weights: Mapping[str, torch.Tensor]) -> Fidelity:
        """The reference with each named linear layer computing with the given weight
        (float [out, in]) instead of its own."""
        start = min((self.block_of(name) for name in weights), default=self.forcer.num_blocks)
        stats = PositionStats.empty()
        with self.replaced(weights):
            for ref in self.ref:
                hidden = self.forcer.forward(ref.step, replay=ref.block_outputs[:start])
                self._compare(self.forcer, ref, hidden, stats)
        return stats.summary(self.ref_nll)

    def measure_model(self, other: nn.Module) -> Fidelity:
        """Another model of the same architecture (e.g. a quantized checkpoint as loaded)."""
        forcer = TeacherForcer(other, torch.cat([r.step.windows for r in self.ref]),
                               windows_per_step=len(self.ref[0].step.windows))
        stats = PositionStats.empty()
        for ref, step in zip(self.ref, forcer.steps, strict=True):
            self._compare(forcer, ref, forcer.forward(step), stats)
        return stats.summary(self.ref_nll)

    def block_of(self, name: str) -> int:
        """Decoder block index of a linear layer; the LM head comes after every block."""
        match = _BLOCK.search(f".{name}.")
        return int(match.group(1)) if match else self.forcer.num_blocks

    @contextmanager
    def replaced(self, weights: Mapping[str, torch.Tensor]):
        """Temporarily compute the named layers with fixed weights."""
        saved = {name: self.linears[name].method for name in weights}
        dtype = self.model.model.embed_tokens.weight.dtype
        try:
            for name, w in weights.items():
                self.linears[name].method = FixedWeightMethod(w.to(dtype))
            yield
        finally:
            for name, method in saved.items():
                self.linears[name].method = method

    def _reference(self, step: ForcedStep) -> _RefStep:
        outputs: list = []
        hidden = self.forcer.forward(step, record=outputs if self.reuse_blocks else None)
        rows = step.scored_rows
        logp = torch.cat([self.forcer.log_probs(hidden[rows[i:i + ROWS_PER_CHUNK]])
                          for i in range(0, len(rows), ROWS_PER_CHUNK)])
        nll = -logp.gather(1, step.targets[:, None]).squeeze(1)
        return _RefStep(step, outputs, RefRows.of(logp), nll)

    @staticmethod
    @torch.inference_mode()
    def _compare(forcer: TeacherForcer, ref: _RefStep, hidden: torch.Tensor,
                 stats: PositionStats) -> None:
        rows, targets = ref.step.scored_rows, ref.step.targets
        for i in range(0, len(rows), ROWS_PER_CHUNK):
            logp = forcer.log_probs(hidden[rows[i:i + ROWS_PER_CHUNK]])
            chunk = slice(i, i + ROWS_PER_CHUNK)
            stats.add(ref.rows[chunk], logp, targets[chunk])


class FixedWeightMethod:
    """A LinearMethod that computes with a given dense weight and the layer's own bias
    (swapped in by KLProbe.replaced; never loads or finalizes)."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight

    def apply(self, layer: Linear, x: torch.Tensor) -> torch.Tensor:
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return F.linear(x, self.weight.to(x.dtype), bias)


# -- the weights a layer computes with -------------------------------------------------------

def effective_weight(layer: Linear) -> torch.Tensor:
    """Float32 W [out, in] that `layer` computes with: dequantized, or its dense weight."""
    dequantize = getattr(layer.method, "dequantize_weight", None)
    if dequantize is not None:
        return dequantize(layer)
    return layer.method.dense_weight(layer).detach().float()


def quantized_weight(layer: Linear, fmt: str, source: torch.Tensor | None = None) -> torch.Tensor:
    """Float32 W [out, in] of `layer` (or of `source`) stored in format `fmt` and read back,
    shard by shard, exactly as the linear method serving `fmt` would hold it."""
    w = effective_weight(layer) if source is None else source
    method = get_linear_method(fmt)
    probe = Linear(layer.in_features, layer.out_shards, dtype=torch.float32, method=method)
    for shard in range(len(layer.out_shards)):
        method.load_shard(probe, shard, "weight", w[shard_rows(layer.out_shards, shard)])
    method.finalize(probe)
    return method.dequantize_weight(probe)

