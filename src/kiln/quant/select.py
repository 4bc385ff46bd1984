"""Layer selection: which format each linear layer gets, under a budget, judged end to end.

Quantization errors of different layers do not simply add: they can compound or cancel. So
the selection measures each layer's sensitivity alone (one layer quantized, the rest dense),
uses those numbers only to *propose* plans, and judges every proposal by the end-to-end KL of
the whole combination on calibration text (kiln.quant.evaluate.KLProbe):

  1. starts: the uniform plan that fits the budget, "keep the most sensitive layers dense",
     and an additive greedy (upgrade the layer with the best predicted KL drop per bit);
     the best of them, measured, is the incumbent;
  2. local search: moves that upgrade one layer and, to stay in budget, downgrade others
     (cheapest predicted loss per freed bit first), ranked by their additive prediction; the
     top few are measured and the best is taken if it lowers the measured KL; until no move
     is left or the evaluation budget is spent.

Budgets are average bits per weight over the selected layers (scales and minimums included;
a dense layer counts as its dtype's bits), or a KL ceiling (`plan_for_kl`: fewest bits whose
measured KL stays under it).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

import torch

from kiln.quant.checkpoint import DENSE
from kiln.quant.evaluate import Fidelity, KLProbe
from kiln.quant.formats import get_format

Plan = dict[str, str]  # linear layer -> format name or "dense"


@dataclass(frozen=True)
class LayerShape:
    name: str
    out_features: int
    in_features: int

    @property
    def numel(self) -> int:
        return self.out_features * self.in_features


class PlanCost:
    """Bits of a plan: the stored bits of each layer's weights in its format."""

    def __init__(self, layers: Iterable[LayerShape], dense_bits: int = 16):
        self.layers = {layer.name: layer for layer in layers}
        self.dense_bits = dense_bits
        self.total_weights = sum(layer.numel for layer in self.layers.values())
        self._bits: dict[tuple[str, str], float] = {}

    def layer_bits(self, name: str, fmt: str) -> float:
        """Bits per weight of one layer in `fmt`."""
        if (name, fmt) not in self._bits:
            layer = self.layers[name]
            self._bits[name, fmt] = float(self.dense_bits) if fmt == DENSE else get_format(
                fmt).bits_per_weight(layer.out_features, layer.in_features)
        return self._bits[name, fmt]

    def total_bits(self, plan: Mapping[str, str]) -> float:
        return sum(self.layer_bits(n, f) * self.layers[n].numel for n, f in plan.items())

    def bits(self, plan: Mapping[str, str]) -> float:
        """Average bits per weight over the plan's layers."""
        return self.total_bits(plan) / self.total_weights

    def bytes(self, plan: Mapping[str, str]) -> int:
        return round(self.total_bits(plan) / 8)


class CandidateWeights:
    """Float32 weights of each layer in each format (as the format's linear method holds
    them), made on first use and kept: each is measured many times."""

    def __init__(self, quantize: Callable[[str, str], torch.Tensor]):
        self.quantize = quantize  # (layer, format) -> float32 [out, in]
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def get(self, layer: str, fmt: str) -> torch.Tensor:
        key = (layer, fmt)
        if key not in self._cache:
            self._cache[key] = self.quantize(layer, fmt)
        return self._cache[key]

    def of_plan(self, plan: Mapping[str, str]) -> dict[str, torch.Tensor]:
        """Replacement weights for KLProbe.measure: every layer not kept dense."""
        return {name: self.get(name, fmt) for name, fmt in plan.items() if fmt != DENSE}


@dataclass
class Sensitivity:
    """Mean KL on calibration text with one layer alone in one format (dense: 0)."""

    kl: dict[str, dict[str, float]] = field(default_factory=dict)

    def of(self, layer: str, fmt: str) -> float:
        return 0.0 if fmt == DENSE else self.kl[layer][fmt]

    def ranked(self, fmt: str) -> list[str]:
        """Layers, most sensitive to `fmt` first."""
        return sorted(self.kl, key=lambda name: -self.kl[name][fmt])


def measure_sensitivity(probe: KLProbe, weights: CandidateWeights, layers: Iterable[str],
                        formats: Iterable[str],
                        on_measured: Callable[[str, str, Fidelity | None], None] | None = None,
                        known: Mapping[str, Mapping[str, float]] | None = None,
                        ) -> Sensitivity:
    """Each layer quantized alone in each format, the rest dense; end-to-end mean KL.
    known: earlier measurements (same text, rounding and reference) to reuse."""
    table = Sensitivity()
    for layer in layers:
        for fmt in formats:
            if fmt == DENSE:
                continue
            if known and fmt in known.get(layer, {}):
                table.kl.setdefault(layer, {})[fmt] = known[layer][fmt]
                if on_measured is not None:
                    on_measured(layer, fmt, None)
                continue
            fid = probe.measure({layer: weights.get(layer, fmt)})
            table.kl.setdefault(layer, {})[fmt] = fid.mean_kl
            if on_measured is not None:
                on_measured(layer, fmt, fid)
    return table


@dataclass(frozen=True)
class Scored:
    """A plan with its measured calibration fidelity."""

    name: str
    plan: Plan
    bits: float
    fidelity: Fidelity


class Selector:
    """Proposes plans from sensitivities and judges them end to end on `probe`."""

    def __init__(self, probe: KLProbe, weights: CandidateWeights, cost: PlanCost,
                 sensitivity: Sensitivity, formats: list[str],
                 on_evaluated: Callable[[Scored], None] | None = None):
        self.probe, self.weights, self.cost, self.sens = probe, weights, cost, sensitivity
        layer = next(iter(cost.layers))  # formats in increasing bits (the same for all layers)
        self.formats = sorted(formats, key=lambda f: cost.layer_bits(layer, f))
        self.on_evaluated = on_evaluated
        self.evaluations = 0
        self._memo: dict[tuple, Fidelity] = {}

    # -- measuring ----------------------------------------------------------------------------

    def score(self, name: str, plan: Mapping[str, str]) -> Scored:
        key = tuple(sorted(plan.items()))
        if key not in self._memo:
            self._memo[key] = self.probe.measure(self.weights.of_plan(plan))
            self.evaluations += 1
        scored = Scored(name, dict(plan), self.cost.bits(plan), self._memo[key])
        if self.on_evaluated is not None:
            self.on_evaluated(scored)
        return scored

    # -- reference plans ----------------------------------------------------------------------

    def uniform(self, fmt: str) -> Plan:
        return dict.fromkeys(self.cost.layers, fmt)

    def best_uniform(self, budget: float) -> Plan | None:
        """The uniform plan with the most bits that fits (dense excluded)."""
        fitting = [f for f in self.formats if f != DENSE
                   and self.cost.bits(self.uniform(f)) <= budget + 1e-9]
        return self.uniform(fitting[-1]) if fitting else None

    def keep_sensitive_dense(self, budget: float, base: str | None = None) -> Plan:
        """`base` (the cheapest format) everywhere, then the layers most sensitive to it kept
        dense, in order, while the budget allows."""
        base = base or self.formats[0]
        plan = self.uniform(base)
        for layer in self.sens.ranked(base):
            trial = dict(plan, **{layer: DENSE})
            if self.cost.bits(trial) <= budget + 1e-9:
                plan = trial
        return plan

    def additive_greedy(self, budget: float) -> Plan:
        """Upgrades in order of predicted KL drop per added bit, while they fit."""
        plan = self.uniform(self.formats[0])
        for layer, fmt in self.upgrade_path():
            trial = dict(plan, **{layer: fmt})
            if self.cost.bits(trial) <= budget + 1e-9:
                plan = trial
        return plan

    def upgrade_path(self) -> list[tuple[str, str]]:
        """From the cheapest plan, the sequence of single-layer upgrades with the best
        predicted KL drop per bit, up to every layer at its best format (a greedy hull)."""
        current = dict.fromkeys(self.cost.layers, self.formats[0])
        heap = [item for layer in current for item in self._upgrades(layer, current[layer])]
        heapq.heapify(heap)
        path = []
        while heap:
            _, layer, old, new = heapq.heappop(heap)
            if current[layer] != old:
                continue  # stale: the layer moved since this entry was made
            current[layer] = new
            path.append((layer, new))
            for item in self._upgrades(layer, new):
                heapq.heappush(heap, item)
        return path

    def _upgrades(self, layer: str, old: str) -> list[tuple[float, str, str, str]]:
        """Heap entries (-gain per bit, layer, old, new) for every higher format (formats
        that cost no more bits on this layer's shape come first when they help)."""
        out = []
        for new in self._above(old):
            bits = (self.cost.layer_bits(layer, new) - self.cost.layer_bits(layer, old)) \
                * self.cost.layers[layer].numel
            gain = self.sens.of(layer, old) - self.sens.of(layer, new)
            if bits > 0:
                out.append((-gain / bits, layer, old, new))
            elif gain > 0:
                out.append((-math.inf, layer, old, new))
        return out

    # -- search -------------------------------------------------------------------------------

    def search(self, budget: float, max_evals: int = 40, moves_per_round: int = 4) -> Scored:
        """Best plan found within `budget` bits per weight (see the module docstring)."""
        starts = [("additive greedy", self.additive_greedy(budget)),
                  ("keep most sensitive dense", self.keep_sensitive_dense(budget))]
        uniform = self.best_uniform(budget)
        if uniform is not None:
            starts.append(("uniform", uniform))
        best = min((self.score(name, plan) for name, plan in starts),
                   key=lambda s: s.fidelity.mean_kl)
        while self.evaluations < max_evals:
            moves = [m for m in self._swap_moves(best.plan, budget)
                     if tuple(sorted(m.items())) not in self._memo][:moves_per_round]
            if not moves:
                break
            challenger = min((self.score("search", plan) for plan in moves),
                             key=lambda s: s.fidelity.mean_kl)
            if challenger.fidelity.mean_kl < best.fidelity.mean_kl:
                best = challenger  # else: these moves are memoized; next round tries others
        return Scored("mixed (searched)", best.plan, best.bits, best.fidelity)

    def _swap_moves(self, plan: Plan, budget: float, width: int = 24) -> list[Plan]:
        """Plans one upgrade away, paid for by as many downgrades as the budget needs (the
        cheapest predicted loss per freed bit first), best predicted first. Predictions are
        additive in sensitivities; measurement decides."""
        ups = sorted(((self.sens.of(n, f) - self.sens.of(n, g), n, g)
                      for n, f in plan.items() for g in self._above(f)), reverse=True)[:width]
        downs = sorted(self._downgrades(plan))
        moves = []
        for gain, up, new in ups:
            trial, loss = dict(plan, **{up: new}), 0.0
            for _, cost, down, lower in downs:
                if self.cost.bits(trial) <= budget + 1e-9:
                    break
                if down != up and trial[down] == plan[down]:
                    trial[down], loss = lower, loss + cost
            if self.cost.bits(trial) <= budget + 1e-9:
                moves.append((loss - gain, trial))
        moves.sort(key=lambda m: m[0])
        return [plan for _, plan in moves]

    def _downgrades(self, plan: Plan) -> list[tuple[float, float, str, str]]:
        """(predicted KL rise per freed bit, KL rise, layer, lower format) of each downgrade."""
        out = []
        for name, fmt in plan.items():
            for lower in self._below(fmt):
                freed = (self.cost.layer_bits(name, fmt) - self.cost.layer_bits(name, lower)) \
                    * self.cost.layers[name].numel
                rise = self.sens.of(name, lower) - self.sens.of(name, fmt)
                if freed > 0:
                    out.append((rise / freed, rise, name, lower))
        return out

    def _above(self, fmt: str) -> list[str]:
        return self.formats[self.formats.index(fmt) + 1:]

    def _below(self, fmt: str) -> list[str]:
        return self.formats[:self.formats.index(fmt)]

    # -- a KL ceiling instead of a bits budget ------------------------------------------------

    def plan_for_kl(self, ceiling: float, max_evals: int = 40) -> Scored:
        """Fewest bits found whose measured mean KL stays <= ceiling: a binary search along
        the greedy upgrade path, then measured downgrades that keep it under the ceiling."""
        path = self.upgrade_path()
        plans = [self.uniform(self.formats[0])]
        for layer, fmt in path:
            plans.append(dict(plans[-1], **{layer: fmt}))
        lo, hi = 0, len(plans) - 1
        best = self.score("top of path", plans[hi])
        if best.fidelity.mean_kl > ceiling:
            return Scored("closest to the KL ceiling", best.plan, best.bits, best.fidelity)
        while lo < hi:
            mid = (lo + hi) // 2
            scored = self.score("path", plans[mid])
            if scored.fidelity.mean_kl <= ceiling:
                hi, best = mid, scored
            else:
                lo = mid + 1
        return self._shed_bits(best, ceiling, max_evals)

    def _shed_bits(self, best: Scored, ceiling: float, max_evals: int) -> Scored:
        while self.evaluations < max_evals:
            downs = sorted((self.sens.of(n, g) - self.sens.of(n, f), n, g)
                           for n, f in best.plan.items() for g in self._below(f)[-1:])
            trials = [dict(best.plan, **{n: g}) for _, n, g in downs]
            trials = [t for t in trials if tuple(sorted(t.items())) not in self._memo][:4]
            if not trials:
                break
            fits = [s for s in (self.score("shed", t) for t in trials)
                    if s.fidelity.mean_kl <= ceiling]
            if fits:
                best = min(fits, key=lambda s: s.bits)
        return Scored("mixed (KL ceiling)", best.plan, best.bits, best.fidelity)
