"""moe.cpp: a MoE layer's routed experts in one call (`moe_experts_vnni` on bf16 experts,
`moe_experts_int8_vnni` on int8 experts packed for AVX512-VNNI, `moe_experts_int8` on int8
rows) against the per-expert path of FusedExperts (the same linears one expert at a time,
then torch's combine) and against an fp64 reference; the stacked weights are views (held
once); the dispatch between the two paths; expert parallelism's owned pairs; and a tiny
Qwen3-MoE's greedy tokens with the kernel on and off.

Tolerances: the kernel rounds where the per-expert path rounds (gate/up, silu * up and down
to bf16 from the sums of the same register tiles: fp32 for bf16 and int8 rows, exact integers
for packed int8) and sums the k weighted expert outputs in fp32, in an order torch's bmm may
not share: against that path an output differs by at most one bf16 step (2^-8 relative) plus,
where the terms cancel, the fp32 reordering error ((k - 1) 2^-24 of the terms' magnitude per
order: `reorder_slack`), and almost all are equal; with one expert per token (one term) they
are equal. Against fp64 math
the bf16 roundings of the intermediates dominate (relative 2^-8 each, three in a row): 3e-2
of the output scale.
"""

from __future__ import annotations

import os
from unittest import mock

import pytest
import torch

from kiln.kernels.int8_vnni import pack_int8_vnni
from kiln.kernels.isa import int8_wide_min_tokens
from kiln.kernels.moe_experts import (
    ExpertFormat,
    fused_max_tokens,
    fused_moe_available,
    moe_experts,
)
from kiln.kernels.quant_mm import int8_vnni_max_tokens, int8_vnni_wanted, int8_wide_unbounded
from kiln.models.layers.expert_parallel import ExpertShard, place_experts
from kiln.models.layers.experts import FusedExperts
from kiln.models.layers.linear import get_linear_method
from kiln.models.layers.moe_router import Routing
from kiln.models.layers.ops import KernelOps, TorchOps
from kiln.models.layers.parallel import TensorParallel
from tests.kernels.common import needs_cpu_kernels

needs_fused = pytest.mark.skipif(not fused_moe_available(),
                                 reason="no AVX512-BF16 on this CPU (or kiln's kernels did not "
                                        "build): the per-expert path serves bf16 MoE layers")
needs_fused_int8 = pytest.mark.skipif(not fused_moe_available(ExpertFormat.INT8),
                                      reason="kiln's kernels did not build")
# int8 layers pack for int8_vnni_mm (and their experts stack packed) here
PACKED_INT8 = fused_moe_available(ExpertFormat.INT8_VNNI) and int8_vnni_wanted()
needs_fused_int8_vnni = pytest.mark.skipif(
    not PACKED_INT8, reason="no AVX512-VNNI on this CPU (or kiln's kernels did not build, or "
                            "KILN_INT8_VNNI=0): int8 experts stack as rows")
# make_experts' formats: a linear format name, or "int8-rows" (int8 with KILN_INT8_VNNI=0:
# the rows int8_gemv reads, not int8_vnni_mm's packing)
INT8_ROWS = "int8-rows"


class TwoRanks:
    """The rank/size a sharded module reads (no collective is made here)."""

    def __init__(self, rank: int):
        self.rank, self.world_size = rank, 2


def make_experts(hidden: int, width: int, num_experts: int, top_k: int, fmt: str = "dense-vnni",
                 shard: ExpertShard | None = None, seed: int = 0) -> FusedExperts:
    """Experts with random bf16 weights (quantized on load for int8), loaded and finalized as
    the loader does."""
    if fmt == INT8_ROWS:
        with mock.patch.dict(os.environ, {"KILN_INT8_VNNI": "0"}):  # read at finalize
            return make_experts(hidden, width, num_experts, top_k, "int8", shard, seed)
    import kiln.models.layers.vnni  # noqa: F401  (registers dense-vnni)
    import kiln.quant  # noqa: F401  (registers int8)

    ops = TorchOps() if fmt == "dense" else KernelOps()
    kwargs = {} if shard is None else {"shard": shard}
    experts = FusedExperts(hidden, width, num_experts, "mlp.experts",
                           lambda prefix: get_linear_method(fmt), torch.bfloat16, ops,
                           top_k=top_k, **kwargs)
    g = torch.Generator().manual_seed(seed)
    for e in range(num_experts):  # every rank draws every expert: copies agree
        gate_up = torch.randn(2 * width, hidden, generator=g) / hidden ** 0.5
        down = torch.randn(hidden, width, generator=g) / width ** 0.5
        if str(e) not in experts._modules:
            continue
        for shard_id, rows in enumerate(gate_up.to(torch.bfloat16).chunk(2)):
            lin = experts[e].gate_up_proj
            lin.method.load_shard(lin, shard_id, "weight", rows)
        experts[e].down_proj.method.load_shard(experts[e].down_proj, 0, "weight",
                                               down.to(torch.bfloat16))
        for lin in (experts[e].gate_up_proj, experts[e].down_proj):
            lin.method.finalize(lin)
    experts.stack_weights()
    return experts


def random_routing(tokens: int, num_experts: int, top_k: int, seed: int = 1) -> Routing:
    """k distinct experts per token; with tokens * k > E experts repeat across tokens."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.rand(tokens, num_experts, generator=g).topk(top_k, dim=-1).indices
    weights = torch.rand(tokens, top_k, generator=g) + 0.05
    return Routing(weights / weights.sum(dim=-1, keepdim=True), ids)


def per_expert(experts: FusedExperts, x: torch.Tensor, routing: Routing,
               owners: torch.Tensor | None = None) -> torch.Tensor:
    saved, experts.fused_max_tokens = experts.fused_max_tokens, 0
    try:
        return experts(x, routing, owners)
    finally:
        experts.fused_max_tokens = saved


def assert_within_one_bf16_step(got: torch.Tensor, want: torch.Tensor,
                                slack: torch.Tensor | None = None) -> None:
    """`slack`: what reordering the fp32 weighted sum may add where its terms cancel
    (`reorder_slack`), before the one bf16 step of the result."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    step = want.float().abs().clamp_min(1e-30) * 2.0 ** -7  # one bf16 step is <= 2^-7 |v|
    if slack is not None:
        step = step + slack
    assert ((got.float() - want.float()).abs() <= step).all()
    assert (got == want).float().mean() > 0.9


def reorder_slack(experts: FusedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    """How far two fp32 sums of the k weighted expert outputs in different orders may lie
    apart: each within (k - 1) 2^-24 sum_j w_j |d_j| of the exact sum. Tiny outputs whose
    terms cancel can thus differ by more than one bf16 step of their own."""
    k = routing.experts.shape[1]
    terms = torch.zeros(x.shape)
    for j in range(k):  # d_j through the per-expert path with weight 1 (exact)
        one = Routing(torch.ones(x.shape[0], 1), routing.experts[:, j:j + 1])
        terms += routing.weights[:, j:j + 1] * per_expert(experts, x, one).float().abs()
    return 2 * (k - 1) * 2.0 ** -24 * terms * 1.01


def fp64_reference(experts: FusedExperts, x: torch.Tensor, routing: Routing) -> torch.Tensor:
    from kiln.kernels.bf16_vnni import unpack_vnni

    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            mlp = experts[int(routing.experts[t, j])]
            gu_w = unpack_vnni(mlp.gate_up_proj.vnni_weight, mlp.gate_up_proj.out_features,
                               mlp.gate_up_proj.in_features).double()
            d_w = unpack_vnni(mlp.down_proj.vnni_weight, mlp.down_proj.out_features,
                              mlp.down_proj.in_features).double()
            gate, up = (x[t].double() @ gu_w.T).chunk(2)
            out[t] += routing.weights[t, j].double() * (
                (torch.nn.functional.silu(gate) * up) @ d_w.T)
    return out


@needs_cpu_kernels
@needs_fused
@pytest.mark.parametrize("tokens", [1, 2, 5, 17])
@pytest.mark.parametrize("hidden,width,num_experts,top_k",
                         [(64, 48, 8, 2), (320, 64, 16, 8)])
def test_kernel_matches_the_per_expert_path(tokens, hidden, width, num_experts, top_k):
    experts = make_experts(hidden, width, num_experts, top_k)
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    routing = random_routing(tokens, num_experts, top_k)
    got = moe_experts(x, routing.experts, routing.weights, experts.stacked)
    assert_within_one_bf16_step(got, per_expert(experts, x, routing),
                                reorder_slack(experts, x, routing))
    if tokens == 17:
        exact = fp64_reference(experts, x, routing)
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=3e-2 * exact.abs().max())


@needs_cpu_kernels
@needs_fused
@pytest.mark.parametrize("fmt", ["dense-vnni", "int8", INT8_ROWS])
def test_outputs_do_not_depend_on_threads_or_the_batch(fmt):
    """Each output is summed by one thread in a fixed order: the same bits on 1 or 3 threads,
    and a token's bits alone or in its batch (int8 packed: each row's digits and integer
    sums are its own, whatever tile it shares)."""
    experts = make_experts(320, 64, 16, 8, fmt=fmt)
    x = torch.randn(6, 320).to(torch.bfloat16)
    routing = random_routing(6, 16, 8)
    batch = moe_experts(x, routing.experts, routing.weights, experts.stacked)
    alone = torch.cat([moe_experts(x[t:t + 1], routing.experts[t:t + 1],
                                   routing.weights[t:t + 1], experts.stacked) for t in range(6)])
    assert torch.equal(batch, alone)
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            assert torch.equal(moe_experts(x, routing.experts, routing.weights,
                                           experts.stacked), batch)
    finally:
        torch.set_num_threads(threads)


@needs_cpu_kernels
@needs_fused
def test_stacked_weights_are_the_experts_own():
    experts = make_experts(64, 48, 8, 2)
    stacked = experts.stacked
    assert stacked.gate_up.shape == (8, 6, 32, 16, 2) and stacked.down.shape == (8, 4, 24, 16, 2)
    for slot, mlp in enumerate(experts):  # views into the stack: the weights are held once
        assert mlp.gate_up_proj.vnni_weight.data_ptr() == stacked.gate_up[slot].data_ptr()
        assert mlp.down_proj.vnni_weight.data_ptr() == stacked.down[slot].data_ptr()


@needs_cpu_kernels
@needs_fused_int8
def test_a_cast_or_move_drops_the_stack():
    """`.to()` copies each expert's tensors on their own (a GPU platform moves the model after
    loading): the stale host stack is dropped, not kept beside them."""
    experts = make_experts(64, 48, 8, 2, fmt="int8")
    experts.to("cpu")
    assert experts.stacked is not None  # nothing moved: the views stand
    experts.to(torch.float64)  # casts no int8 buffer, but the fp32 scales: copies
    assert experts.stacked is None and experts.fused_max_tokens == 0


@needs_cpu_kernels
@needs_fused
def test_forward_takes_the_kernel_up_to_the_crossover():
    experts = make_experts(64, 48, 8, 2)
    limit = fused_max_tokens(8, 2)
    assert experts.fused_max_tokens == limit == 31  # T * k < 8 E: under one 8-row tile each
    for tokens in (1, limit, limit + 1):
        x = torch.randn(tokens, 64).to(torch.bfloat16)
        routing = random_routing(tokens, 8, 2, seed=tokens)
        before = (experts.fused_steps, experts.per_expert_steps)
        got = experts(x, routing)
        fused = tokens <= limit
        assert (experts.fused_steps - before[0], experts.per_expert_steps - before[1]) == (
            (1, 0) if fused else (0, 1))
        assert_within_one_bf16_step(got, per_expert(experts, x, routing))


@needs_cpu_kernels
@needs_fused
def test_expert_parallel_ranks_run_their_owned_pairs():
    """Two ranks, each holding a subset of the experts (one with a redundant copy): each
    rank's kernel output over its owned pairs is the per-expert path's, and the two add up to
    one process's."""
    whole = make_experts(64, 48, 4, 2)
    x = torch.randn(9, 64).to(torch.bfloat16)
    routing = random_routing(9, 4, 2)
    placement = place_experts([5.0, 1, 1, 1], num_ranks=2, num_redundant=2)
    total = torch.zeros(9, 64)
    for rank in (0, 1):
        shard = ExpertShard(TensorParallel(TwoRanks(rank)), placement)
        experts = make_experts(64, 48, 4, 2, shard=shard)
        assert len(experts) == 3 and experts.stacked.gate_up.shape[0] == 3
        owners = experts.owners(routing.experts)
        got = experts(x, routing, owners)
        assert experts.fused_steps == 1
        assert_within_one_bf16_step(got, per_expert(experts, x, routing, owners))
        total += got.float()
    torch.testing.assert_close(total, per_expert(whole, x, routing).float(), rtol=2e-2,
                               atol=1e-2)


@needs_cpu_kernels
@needs_fused
def test_bad_expert_ids_fail_with_the_numbers():
    experts = make_experts(64, 48, 8, 2)
    x = torch.randn(2, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 9]])
    with pytest.raises(RuntimeError, match="expert id 9 of token 1 is outside the 8"):
        moe_experts(x, ids, torch.ones(2, 2), experts.stacked)
    with pytest.raises(RuntimeError, match="x has 32 features, gate_up packs 64"):
        moe_experts(x[:, :32], ids[:, :1], torch.ones(2, 1), experts.stacked)


@needs_cpu_kernels
@needs_fused_int8_vnni
@pytest.mark.parametrize("tokens", [1, 3, 17, 40])
@pytest.mark.parametrize("hidden,width,num_experts,top_k",
                         [(64, 48, 8, 2), (320, 64, 16, 8), (192, 40, 4, 3)])
def test_packed_int8_kernel_matches_the_per_expert_path(tokens, hidden, width, num_experts,
                                                        top_k):
    """Weight-only int8 experts on AVX512-VNNI stay packed (no rows): the kernel's rows are
    int8_vnni_mm's digits, which the per-expert path runs up to 15 rows an expert where bf16
    rows from 16 on widen the codes (fp32 sums, decision 0025), else up to
    int8_vnni_max_tokens() (40 tokens over 4 experts give more: other roundings there).
    (192, 40): an expert width of 40, so gate/up's 80 rows are a panel of 4 blocks and one
    of 1."""
    experts = make_experts(hidden, width, num_experts, top_k, fmt="int8")
    assert experts.stacked.format is ExpertFormat.INT8_VNNI
    assert experts.stacked.gate_up.dtype == torch.uint8
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    routing = random_routing(tokens, num_experts, top_k)
    got = moe_experts(x, routing.experts, routing.weights, experts.stacked)
    want = per_expert(experts, x, routing)
    rows = torch.bincount(routing.experts.flatten(), minlength=num_experts).max()
    digit_rows = int8_vnni_max_tokens()
    if int8_wide_unbounded():
        digit_rows = min(digit_rows, int8_wide_min_tokens() - 1)
    if rows <= digit_rows:
        assert_within_one_bf16_step(got, want, reorder_slack(experts, x, routing))
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                                   atol=2e-2 * want.float().abs().max().item())


@needs_cpu_kernels
@needs_fused_int8
@pytest.mark.parametrize("tokens", [1, 3, 17])
@pytest.mark.parametrize("hidden,width,num_experts,top_k", [(64, 48, 8, 2), (320, 64, 16, 8)])
def test_int8_rows_kernel_matches_the_per_expert_path(tokens, hidden, width, num_experts,
                                                      top_k):
    """Weight-only int8 experts as rows (CPUs without AVX512-VNNI, KILN_INT8_VNNI=0): up to
    8 rows an expert the per-expert path runs kiln's int8_gemv, the same row sums; beyond,
    torch's int8 kernel, whose sums may round apart."""
    experts = make_experts(hidden, width, num_experts, top_k, fmt=INT8_ROWS)
    assert experts.stacked.format is ExpertFormat.INT8
    assert experts.stacked.gate_up.dtype == torch.int8
    x = torch.randn(tokens, hidden).to(torch.bfloat16)
    routing = random_routing(tokens, num_experts, top_k)
    got = moe_experts(x, routing.experts, routing.weights, experts.stacked)
    want = per_expert(experts, x, routing)
    if tokens <= 8:
        assert_within_one_bf16_step(got, want)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2,
                                   atol=2e-2 * want.float().abs().max().item())


@needs_cpu_kernels
@needs_fused
@needs_fused_int8_vnni
@pytest.mark.parametrize("fmt", ["dense-vnni", "int8"])
@pytest.mark.parametrize("tokens", [1, 6, 21])
def test_one_expert_per_token_gives_the_per_expert_bits(fmt, tokens):
    """With top-1 routing the weighted sum has one term, so nothing is left to reorder: the
    kernel's bf16 outputs are the per-expert path's bit for bit (bf16: the same fp32 register
    tiles; int8: the same exact integer sums as int8_vnni_mm, scaled and rounded alike)."""
    experts = make_experts(256, 96, 4, 1, fmt=fmt)
    x = (torch.randn(tokens, 256) * torch.logspace(-2, 2, 256)).to(torch.bfloat16)
    routing = random_routing(tokens, 4, 1)
    got = moe_experts(x, routing.experts, routing.weights, experts.stacked)
    assert torch.equal(got, per_expert(experts, x, routing))


@needs_cpu_kernels
@needs_fused_int8_vnni
def test_packed_int8_stacked_weights_are_the_experts_own():
    """The packed experts are stacked as packed (held once, no unpacking); each expert's
    linear reads its slot and still gives its plain rows back for export."""
    experts = make_experts(64, 48, 8, 2, fmt="int8")
    stacked = experts.stacked
    assert stacked.gate_up.shape == (8, 6, 16, 16, 4) and stacked.down.shape == (8, 4, 12, 16, 4)
    assert stacked.down_scale.shape == (8, 64, 1)
    for slot, mlp in enumerate(experts):
        lin = mlp.gate_up_proj
        assert lin.int8_vnni_weight.data_ptr() == stacked.gate_up[slot].data_ptr()
        assert mlp.down_proj.int8_vnni_weight.data_ptr() == stacked.down[slot].data_ptr()
        assert mlp.down_proj.weight_scale.data_ptr() == stacked.down_scale[slot].data_ptr()
        assert lin.weight.numel() == 0  # no plain copy beside the packed one
        assert torch.equal(pack_int8_vnni(lin.method.stored(lin, "weight")),
                           stacked.gate_up[slot])


@needs_cpu_kernels
@needs_fused_int8_vnni
def test_packed_int8_shapes_fail_with_the_numbers():
    experts = make_experts(64, 48, 8, 2, fmt="int8")
    x = torch.randn(2, 64).to(torch.bfloat16)
    ids = torch.tensor([[0, 1], [2, 9]])
    with pytest.raises(RuntimeError, match="expert id 9 of token 1 is outside the 8"):
        moe_experts(x, ids, torch.ones(2, 2), experts.stacked)
    with pytest.raises(RuntimeError, match="x has 32 features, gate_up packs 64"):
        moe_experts(x[:, :32], ids[:, :1], torch.ones(2, 1), experts.stacked)


@needs_cpu_kernels
@needs_fused_int8
def test_int8_rows_stacked_weights_are_the_experts_own():
    experts = make_experts(64, 48, 8, 2, fmt=INT8_ROWS)
    stacked = experts.stacked
    assert stacked.gate_up.shape == (8, 96, 64) and stacked.down_scale.shape == (8, 64, 1)
    for slot, mlp in enumerate(experts):
        assert mlp.gate_up_proj.weight.data_ptr() == stacked.gate_up[slot].data_ptr()
        assert mlp.down_proj.weight_scale.data_ptr() == stacked.down_scale[slot].data_ptr()


def test_other_formats_keep_the_per_expert_path():
    """Runs on every CPU: experts the kernel cannot read (plain torch weights here; any
    weights where the CPU lacks AVX512-BF16) stack nothing and take the per-expert path."""
    experts = make_experts(64, 48, 8, 2, fmt="dense")
    assert experts.stacked is None and experts.fused_max_tokens == 0
    x = torch.randn(3, 64).to(torch.bfloat16)
    routing = random_routing(3, 8, 2)
    got = experts(x, routing)
    assert (experts.fused_steps, experts.per_expert_steps) == (0, 1)
    exact = fp64_reference_dense(experts, x, routing)
    torch.testing.assert_close(got.double(), exact, rtol=0, atol=3e-2 * exact.abs().max())


def fp64_reference_dense(experts: FusedExperts, x: torch.Tensor,
                         routing: Routing) -> torch.Tensor:
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(routing.experts.shape[1]):
            mlp = experts[int(routing.experts[t, j])]
            gate, up = (x[t].double() @ mlp.gate_up_proj.weight.double().T).chunk(2)
            out[t] += routing.weights[t, j].double() * (
                (torch.nn.functional.silu(gate) * up) @ mlp.down_proj.weight.double().T)
    return out


@needs_cpu_kernels
@needs_fused
@pytest.mark.parametrize("quantization", [None, "int8"])
def test_a_tiny_qwen3_moe_decodes_the_same_tokens_with_the_kernel_on_and_off(
        tmp_path, quantization):
    from kiln import LLM, SamplingParams
    from tests.parity.test_moe_parity import make_tiny_moe

    llm = LLM(make_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe"), dtype="bfloat16",
              max_model_len=256, kv_cache_memory=1 << 24, quantization=quantization)
    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    fmt = ExpertFormat.BF16_VNNI if not quantization else \
        ExpertFormat.INT8_VNNI if PACKED_INT8 else ExpertFormat.INT8
    assert blocks and all(b.stacked is not None and b.stacked.format is fmt for b in blocks)
    # int8 rows: at most 8 tokens a step, so no expert gets more than 8 rows, past which the
    # per-expert path leaves int8_gemv's sums for torch's int8 kernel (other roundings);
    # packed int8: int8_vnni_mm's sums up to 32 rows
    lengths = (2, 3, 3) if quantization and not PACKED_INT8 else (3, 9, 14)
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens() -> list[list[int]]:
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]

    fused = tokens()
    assert all(b.fused_steps > 0 and b.per_expert_steps == 0 for b in blocks)
    for b in blocks:
        b.fused_max_tokens = 0
    assert tokens() == fused
    assert all(b.per_expert_steps > 0 for b in blocks)


@needs_cpu_kernels
@needs_fused
@pytest.mark.parametrize("expert_parallel", [False, True])
def test_two_ranks_with_the_kernel_match_one_process(tmp_path, expert_parallel):
    """bf16 over 2 real rank processes: each rank's kernel runs its column share of every
    expert (TP) or its owned pairs of the experts it holds (EP); the greedy tokens are one
    process's."""
    from kiln import LLM, SamplingParams
    from tests.distributed.test_tensor_parallel import SETTINGS
    from tests.parity.test_moe_parity import make_tiny_moe

    path = make_tiny_moe(tmp_path / "qwen3_moe", "qwen3_moe")
    settings = dict(SETTINGS, dtype="bfloat16")
    prompts = [{"prompt_token_ids": list(range(7, 7 + n))} for n in (4, 19)]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    one = [o.outputs[0].token_ids for o in LLM(path, **settings).generate(
        prompts, params, use_tqdm=False)]
    two = LLM(path, **settings, tensor_parallel_size=2, dist_timeout_s=20,
              enable_expert_parallel=expert_parallel)
    try:
        got = [o.outputs[0].token_ids for o in two.generate(prompts, params, use_tqdm=False)]
        blocks = [m for m in two.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    finally:
        two.close()
    assert blocks and all(b.fused_steps > 0 for b in blocks)  # rank 0's layers
    assert got == one
