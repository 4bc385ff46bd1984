"""Layer selection on a scripted 'model': budgets are respected, measurement decides, and the
search finds combinations whose errors cancel."""

import pytest

from kiln.quant.evaluate import Fidelity
from kiln.quant.select import LayerShape, PlanCost, Selector, Sensitivity

FORMATS = ["int4-g128-sym", "int8", "dense"]
LOW, MID, DENSE = FORMATS
# six layers; in_features 256 -> int4-g128-sym = 4 + 16/128 = 4.125 bits, int8 = 8 + 32/256
LAYERS = [LayerShape(f"model.layers.{i}.mlp.down_proj", out, 256)
          for i, out in enumerate([64, 64, 128, 128, 256, 32])]
INT4_KL = {layer.name: kl for layer, kl in zip(LAYERS, [0.08, 0.01, 0.05, 0.02, 0.03, 0.2],
                                               strict=True)}


class PlanAsWeights:
    """Stands in for CandidateWeights: 'weights' of a plan are the plan itself."""

    def of_plan(self, plan):
        return {n: f for n, f in plan.items() if f != DENSE}


class ScriptedProbe:
    """End-to-end KL = additive sensitivities, times a factor for chosen combinations."""

    def __init__(self, interactions=()):
        self.interactions = interactions  # (set of (layer, fmt), factor)
        self.calls = 0

    def measure(self, replaced) -> Fidelity:
        self.calls += 1
        kl = sum(INT4_KL[n] if f == LOW else INT4_KL[n] / 100 for n, f in replaced.items())
        for combo, factor in self.interactions:
            if combo <= set(replaced.items()):
                kl *= factor
        return Fidelity(kl, kl, 1.0, 1.0, 1.0, 10)


def sensitivity() -> Sensitivity:
    return Sensitivity({n: {LOW: kl, MID: kl / 100} for n, kl in INT4_KL.items()})


def selector(probe=None) -> Selector:
    return Selector(probe or ScriptedProbe(), PlanAsWeights(), PlanCost(LAYERS, dense_bits=16),
                    sensitivity(), list(reversed(FORMATS)))


def test_plan_bits_count_scales_exactly():
    cost = PlanCost(LAYERS, dense_bits=16)
    assert cost.layer_bits(LAYERS[0].name, MID) == 8 + 32 / 256
    assert cost.layer_bits(LAYERS[0].name, LOW) == 4 + 16 / 128
    plan = {layer.name: LOW for layer in LAYERS}
    plan[LAYERS[4].name] = DENSE  # 256 of 672 rows
    expected = (4.125 * (672 - 256) + 16 * 256) / 672
    assert cost.bits(plan) == pytest.approx(expected)
    assert cost.bytes(plan) == round(expected * 672 * 256 / 8)


def test_formats_are_ordered_by_bits():
    assert selector().formats == FORMATS


@pytest.mark.parametrize("budget", [4.125, 4.6, 5.0, 6.0, 9.0, 16.0])
def test_every_plan_respects_the_budget(budget):
    sel = selector()
    cost = sel.cost
    plans = [sel.additive_greedy(budget), sel.keep_sensitive_dense(budget),
             sel.search(budget, max_evals=15).plan]
    if sel.best_uniform(budget) is not None:
        plans.append(sel.best_uniform(budget))
    assert all(cost.bits(p) <= budget + 1e-9 for p in plans)
    assert all(set(p) == set(cost.layers) for p in plans)


def test_keep_most_sensitive_dense_goes_in_sensitivity_order():
    sel = selector()
    # budget for exactly the most sensitive (layer 5, 32 rows) and the next (layer 0, 64 rows)
    cost = sel.cost
    total = cost.total_weights
    budget = (4.125 * total + (16 - 4.125) * (32 + 64) * 256) / total
    plan = sel.keep_sensitive_dense(budget)
    dense = {n for n, f in plan.items() if f == DENSE}
    assert dense == {LAYERS[5].name, LAYERS[0].name}


def test_search_is_never_worse_than_its_starting_points():
    sel = selector()
    best = sel.search(5.0, max_evals=20)
    for plan in (sel.additive_greedy(5.0), sel.keep_sensitive_dense(5.0),
                 sel.best_uniform(5.0) or {}):
        if plan:
            assert best.fidelity.mean_kl <= sel.probe.measure(
                PlanAsWeights().of_plan(plan)).mean_kl
    assert sel.evaluations <= 20 + 4


def test_search_finds_cancelling_errors_that_sensitivities_cannot_see():
    """Layers 2 and 3 quantized together cancel (KL x0.1): the additive ranking upgrades them,
    but measuring a swap that leaves both at int4 finds the much better plan."""
    cancel = ({(LAYERS[2].name, LOW), (LAYERS[3].name, LOW)}, 0.1)
    sel = selector(ScriptedProbe([cancel]))
    budget = 5.6
    greedy = sel.additive_greedy(budget)
    assert greedy[LAYERS[2].name] != LOW or greedy[LAYERS[3].name] != LOW
    best = sel.search(budget, max_evals=40)
    assert best.plan[LAYERS[2].name] == LOW and best.plan[LAYERS[3].name] == LOW
    assert best.fidelity.mean_kl < 0.5 * sel.score("greedy", greedy).fidelity.mean_kl


def test_kl_ceiling_gives_a_cheap_plan_under_it():
    sel = selector()
    result = sel.plan_for_kl(0.1, max_evals=30)
    assert result.fidelity.mean_kl <= 0.1
    assert result.bits < sel.cost.bits(sel.uniform(MID))  # cheaper than int8 everywhere
    assert sel.cost.bits(result.plan) == result.bits


def test_upgrade_path_ends_with_every_layer_at_the_top_format():
    sel = selector()
    plan = sel.uniform(LOW)
    for layer, fmt in sel.upgrade_path():
        plan[layer] = fmt
    assert set(plan.values()) == {DENSE}


def test_sensitivity_reuses_known_measurements():
    from kiln.quant.select import measure_sensitivity

    probe = ScriptedProbe()

    class Weights:
        def get(self, layer, fmt):
            return fmt

    names = [layer.name for layer in LAYERS]
    known = {names[0]: {LOW: 0.5, MID: 0.005}}
    table = measure_sensitivity(probe, Weights(), names, FORMATS, known=known)
    assert probe.calls == 2 * (len(names) - 1)
    assert table.of(names[0], LOW) == 0.5 and table.of(names[1], LOW) == INT4_KL[names[1]]


def test_a_budget_can_name_a_format():
    from kiln.quant.pipeline import bits_budget

    cost = PlanCost(LAYERS, dense_bits=16)
    assert bits_budget("5.25", cost) == 5.25
    assert bits_budget("int8", cost) == cost.bits(dict.fromkeys(cost.layers, "int8"))
    assert bits_budget(None, cost) == cost.bits(dict.fromkeys(cost.layers, "nvfp4"))
    with pytest.raises(ValueError, match="unknown scheme"):
        bits_budget("int3", cost)
