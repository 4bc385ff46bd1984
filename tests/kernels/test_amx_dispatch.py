"""The M rule between kiln's AVX-512 kernels and oneDNN's GEMM (kiln.kernels.isa.gemm_dispatch),
both paths side by side on whatever CPU runs the tests (oneDNN runs without AMX too: AVX-512
kernels on AMD), and which oneDNN kernel really runs: AMX tiles where the CPU has them."""

from __future__ import annotations

import pytest
import torch

from kiln.kernels import bf16_mm, quant_mm
from kiln.kernels.isa import (
    GemmDispatch,
    GemmPath,
    KernelTuning,
    cpu_isa,
    dispatch_for,
    onednn_implementations,
    parse_cpuinfo,
)
from tests.kernels.common import needs_cpu_kernels
from tests.kernels.test_isa import SAPPHIRE_RAPIDS, ZEN4

ROWS = (1, 5, 15, 16, 33)  # GEMV sizes, either side of the default AMX row count, a tail


def test_amx_cpus_switch_to_onednn_at_the_tuned_row_count():
    spr, zen4 = parse_cpuinfo(SAPPHIRE_RAPIDS), parse_cpuinfo(ZEN4)
    rule = dispatch_for(spr, KernelTuning(amx_min_tokens=16))
    assert [rule.path(m) for m in (1, 15, 16, 512)] == [GemmPath.KILN, GemmPath.KILN,
                                                        GemmPath.ONEDNN, GemmPath.ONEDNN]
    assert dispatch_for(zen4, KernelTuning()) == GemmDispatch(None)  # no AMX: callers' limits
    assert GemmDispatch(None).path(4096) is GemmPath.KILN
    assert dispatch_for(spr, KernelTuning(), "4") == GemmDispatch(4)
    assert dispatch_for(spr, KernelTuning(), "off") == GemmDispatch(None)
    assert dispatch_for(zen4, KernelTuning(), "4") == GemmDispatch(None)  # AMX or nothing
    with pytest.raises(ValueError, match="KILN_AMX_MIN_TOKENS"):
        dispatch_for(spr, KernelTuning(), "0")


# -- bf16 weights, fp32 sums (the LM head) -----------------------------------------------------


def bf16_problem(m: int, k: int = 576, n: int = 1030) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(m)
    return torch.randn(m, k, generator=g).bfloat16(), torch.randn(n, k, generator=g).bfloat16()


def assert_fp32_sums(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
    """Within fp32 summation error of the exact (float64) product: never rounded to bf16."""
    assert y.dtype == torch.float32 and y.shape == (x.shape[0], w.shape[0])
    ref = x.double() @ w.double().t()
    magnitude = x.double().abs() @ w.double().abs().t()
    assert ((y.double() - ref).abs() <= 1e-5 * magnitude).all()


@needs_cpu_kernels
@pytest.mark.parametrize("m", ROWS)
def test_both_lm_head_paths_write_fp32_sums(m):
    x, w = bf16_problem(m)
    assert_fp32_sums(torch.ops.kiln.bf16_gemm_f32(x, w), x, w)  # kiln's AVX512-BF16 kernel
    assert_fp32_sums(bf16_mm.onednn_bf16_linear_fp32(x, w), x, w)  # oneDNN: AMX where present


def test_onednn_lm_head_widens_by_row_tiles_and_restores_the_precision(monkeypatch):
    monkeypatch.setattr(bf16_mm, "_WIDENED_TILE_ELEMENTS", 576 * 100)  # 1030 rows: 11 tiles
    x, w = bf16_problem(3)
    before = torch.backends.mkldnn.matmul.fp32_precision
    assert_fp32_sums(bf16_mm.onednn_bf16_linear_fp32(x, w), x, w)
    assert torch.backends.mkldnn.matmul.fp32_precision == before


@needs_cpu_kernels
def test_lm_head_takes_the_path_the_rule_names(monkeypatch):
    monkeypatch.setattr(bf16_mm, "gemm_dispatch", lambda: GemmDispatch(16))
    for m in (15, 16):
        x, w = bf16_problem(m)
        kiln, onednn = torch.ops.kiln.bf16_gemm_f32(x, w), bf16_mm.onednn_bf16_linear_fp32(x, w)
        assert torch.equal(bf16_mm.bf16_linear_fp32(x, w), kiln if m < 16 else onednn)


# -- int8 weights --------------------------------------------------------------------------------


def int8_problem(m: int, k: int = 576, n: int = 160):
    g = torch.Generator().manual_seed(m)
    w = torch.randint(-127, 128, (n, k), generator=g, dtype=torch.int8)
    return torch.randn(m, k, generator=g).bfloat16(), w, torch.logspace(-3, 0, n).reshape(n, 1)


def assert_bf16_close(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor,
                      scale: torch.Tensor) -> None:
    """Within bf16 rounding of the fp32 reference (dequantized W, bf16 scales/output)."""
    ref = x.float() @ (w.float() * scale).t()
    magnitude = x.float().abs() @ (w.float() * scale).abs().t()
    assert y.dtype == torch.bfloat16 and ((y.float() - ref).abs() <= 2 ** -7 * magnitude).all()


@pytest.mark.parametrize("m", ROWS)
def test_both_int8_weight_only_paths_match_the_fp32_reference(m):
    x, w, scale = int8_problem(m)
    assert_bf16_close(quant_mm.int8_weight_only_kernel_mm(x, w, scale), x, w, scale)
    assert_bf16_close(quant_mm.int8_dequantized_mm(x, w, scale), x, w, scale)


def test_int8_weight_only_takes_the_path_the_rule_names(monkeypatch):
    monkeypatch.setattr(quant_mm, "gemm_dispatch", lambda: GemmDispatch(16))
    for m in (15, 16):
        x, w, scale = int8_problem(m)
        expected = (quant_mm.int8_weight_only_kernel_mm if m < 16
                    else quant_mm.int8_dequantized_mm)(x, w, scale)
        assert torch.equal(quant_mm.int8_weight_only_mm(x, w, scale), expected)
    x, w, scale = int8_problem(quant_mm.INT8_WEIGHT_ONLY_MAX_TOKENS + 1)
    assert quant_mm.int8_weight_only_mm(x, w, scale) is None  # the caller's dequantized GEMM


@pytest.mark.parametrize("m", ROWS)
def test_w8a8_accumulation_is_exact(m):
    """`_int_mm` (oneDNN's int8 gemm: AMX-INT8 tiles where the CPU has them, VNNI elsewhere)
    sums int8 products into int32 exactly, at GEMV and GEMM sizes alike."""
    g = torch.Generator().manual_seed(m)
    xq = torch.randint(-127, 128, (m, 576), generator=g, dtype=torch.int8)
    w = torch.randint(-127, 128, (160, 576), generator=g, dtype=torch.int8)
    acc = quant_mm.int8_int8_mm(xq, w)
    assert acc.dtype == torch.int32 and torch.equal(acc.long(), xq.long() @ w.long().t())


# -- which oneDNN kernel runs ---------------------------------------------------------------------


def expected_bf16_kernel() -> str | None:
    """What the oneDNN kernel name of a bf16 GEMM of many rows should contain here ("amx":
    avx512_core_amx, or avx512_core_amx_fp16 on CPUs with AMX-FP16), or None where we cannot
    say."""
    extensions = cpu_isa().extensions
    if "amx-bf16" in extensions:
        return "avx512_core_amx"
    return "avx512_core_bf16" if "avx512-bf16" in extensions else None


needs_bf16_onednn = pytest.mark.skipif(
    expected_bf16_kernel() is None or not bf16_mm.onednn_available(torch.bfloat16),
    reason="no AVX512-BF16/AMX CPU with oneDNN bf16 here")


@needs_bf16_onednn
def test_prepacked_bf16_linear_runs_amx_where_present_and_never_repacks():
    """The dense-onednn layers' GEMM (prefill, batched decode) runs oneDNN's best bf16 kernel
    for this CPU from weights packed once at load, with no per-call weight reorder."""
    x, w = bf16_problem(64, k=576, n=1536)
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)  # as OneDNNLinearMethod packs

    def linear():
        return torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")

    linear()  # creates and caches the primitive
    ran = onednn_implementations(linear)
    assert len(ran) == 1 and ran[0].startswith("inner_product:"), ran  # no reorder beside it
    assert expected_bf16_kernel() in ran[0], ran


@needs_bf16_onednn
def test_onednn_lm_head_and_dequantized_int8_run_amx_where_present():
    x, w = bf16_problem(64)
    ran = onednn_implementations(lambda: bf16_mm.onednn_bf16_linear_fp32(x, w))
    if "amx-bf16" in cpu_isa().extensions:
        assert ran and all("avx512_core_amx" in r for r in ran), ran
    else:  # fp32 math mode "bf16" is an AMX feature: fp32 FMAs elsewhere
        assert ran and all(r.startswith("matmul:brg_matmul") for r in ran), ran
    x, wq, scale = int8_problem(64)
    ran = onednn_implementations(lambda: quant_mm.int8_dequantized_mm(x, wq, scale))
    assert ran and all(expected_bf16_kernel() in r for r in ran), ran


# -- in the engine ---------------------------------------------------------------------------------


@needs_cpu_kernels
def test_greedy_decode_is_the_same_with_the_lm_head_on_either_path(llama_path, monkeypatch):
    """A bf16 model's logits through oneDNN's LM head path (the rule forced to 1 row, as an AMX
    CPU would route batched decode) give the same greedy tokens as kiln's kernel."""
    from kiln import LLM, SamplingParams

    if not bf16_mm.onednn_available(torch.bfloat16):
        pytest.skip("no oneDNN bf16 linear in this torch")
    # oneDNN-packed linears: the head keeps plain bf16 weights for bf16_linear_fp32 (kiln's
    # VNNI-packed models pack the head too, whatever its vocabulary: no dispatch to test)
    llm = LLM(llama_path, dtype="bfloat16", kv_cache_memory=8 << 20, num_threads=2,
              enable_prefix_caching=False, linear_backend="onednn")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = [{"prompt_token_ids": [1, 5, 9, 14, 3, 7]}, {"prompt_token_ids": list(range(2, 30))}]

    def decode() -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    on_kiln = decode()
    calls, onednn = [], bf16_mm.onednn_bf16_linear_fp32

    def counted(x, weight):
        calls.append(x.shape[0])
        return onednn(x, weight)

    monkeypatch.setattr(bf16_mm, "onednn_bf16_linear_fp32", counted)
    monkeypatch.setattr(bf16_mm, "gemm_dispatch", lambda: GemmDispatch(1))
    assert decode() == on_kiln and calls
