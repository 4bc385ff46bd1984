"""isa.py: the CPU's model and instruction sets from /proc/cpuinfo, and the tuning table."""

from __future__ import annotations

import pytest

from kiln.kernels import isa
from kiln.kernels.isa import CpuIsa, KernelTuning, cpu_isa, kernel_tuning, parse_cpuinfo

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
cpu family\t: 25
model\t\t: 17
model name\t: AMD EPYC 9R14
flags\t\t: fpu sse2 avx2 fma avx512f avx512bw avx512_bf16 avx512_vnni

processor\t: 1
vendor_id\t: SomethingElse
"""
SAPPHIRE_RAPIDS = """vendor_id\t: GenuineIntel
cpu family\t: 6
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8488C
flags\t\t: avx2 avx512f avx512_vnni avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8
"""
ZEN5 = ZEN4.replace("cpu family\t: 25", "cpu family\t: 26").replace("model\t\t: 17", "model\t\t: 2")
AVX2_ONLY = "vendor_id\t: AuthenticAMD\ncpu family\t: 23\nmodel\t\t: 49\nflags\t\t: avx2 fma\n"


def test_reads_the_first_processor_and_orders_extensions_best_first():
    zen4 = parse_cpuinfo(ZEN4)
    assert zen4 == CpuIsa("AMD EPYC 9R14", "AuthenticAMD", 25, 17,
                          ("avx512-bf16", "avx512-vnni", "avx512f", "avx2"))
    assert zen4.level == "avx512-bf16"
    spr = parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert spr.extensions[:2] == ("amx-bf16", "amx-int8") and spr.level == "amx"
    assert parse_cpuinfo(AVX2_ONLY).level == "avx2"
    assert parse_cpuinfo("").level == "generic"
    assert "family 25, model 17" in zen4.describe()


def test_this_machine_is_read_once():
    assert cpu_isa() is cpu_isa()
    assert cpu_isa().level in ("amx", "avx512-bf16", "avx512", "avx2", "generic")


def test_tuning_prefers_the_exact_model_then_the_level(monkeypatch):
    zen4, spr = parse_cpuinfo(ZEN4), parse_cpuinfo(SAPPHIRE_RAPIDS)
    assert kernel_tuning(zen4) == isa.DEFAULT_TUNING
    by_model, by_level = KernelTuning(bf16_gemm_max_tokens=16), KernelTuning(int8_gemv_max_tokens=4)
    monkeypatch.setattr(isa, "TUNINGS", {("AuthenticAMD", 25, 17): by_model, "amx": by_level})
    assert kernel_tuning(zen4) is by_model and kernel_tuning(spr) is by_level
    assert kernel_tuning(parse_cpuinfo(AVX2_ONLY)) == isa.DEFAULT_TUNING


def test_zen5_streams_the_one_token_gemv_and_the_environment_overrides_it():
    zen5 = parse_cpuinfo(ZEN5)
    assert (zen5.family, zen5.model) == (26, 2)
    assert kernel_tuning(zen5).vnni_stream_ahead == 4096  # by family: any Zen 5 model
    assert kernel_tuning(parse_cpuinfo(ZEN4)).vnni_stream_ahead == 0  # not measured there
    assert kernel_tuning(parse_cpuinfo(SAPPHIRE_RAPIDS)).vnni_stream_ahead == 0
    tuning = kernel_tuning(zen5)
    assert isa.stream_ahead_for(tuning) == 4096
    assert isa.stream_ahead_for(tuning, " 0 ") == 0 and isa.stream_ahead_for(tuning, "8192") == 8192
    for bad in ("-1", "4k", "", "2000000"):
        with pytest.raises(ValueError, match="KILN_VNNI_STREAM_AHEAD must be a byte count"):
            isa.stream_ahead_for(tuning, bad)


def test_the_cli_names_a_bad_kernel_variable_in_one_line_before_starting(monkeypatch, capsys):
    from kiln.cli import main

    monkeypatch.setenv("KILN_VNNI_STREAM_AHEAD", "4k")
    assert main(["models", "list"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "KILN_VNNI_STREAM_AHEAD must be a byte count" in err
    assert "'4k'" in err and "Traceback" not in err
    monkeypatch.setenv("KILN_VNNI_STREAM_AHEAD", "0")
    isa.check_environment()  # a usable value passes


def test_the_loaded_kernels_take_this_machines_distance(monkeypatch):
    import torch

    from kiln.kernels.bf16_vnni import vnni_available
    from kiln.kernels.cpu import load

    if not load() or not vnni_available():
        pytest.skip("no AVX512-BF16 kernels in this environment")
    monkeypatch.setenv("KILN_VNNI_STREAM_AHEAD", "2048")
    before = torch.ops.kiln.set_vnni_stream_ahead(0)
    try:
        assert isa.vnni_stream_ahead() == 2048
        assert torch.ops.kiln.set_vnni_stream_ahead(before) == 2048
        monkeypatch.delenv("KILN_VNNI_STREAM_AHEAD")
        assert isa.vnni_stream_ahead() == kernel_tuning().vnni_stream_ahead
    finally:
        torch.ops.kiln.set_vnni_stream_ahead(before)


def test_the_platform_carries_it():
    from kiln.config import ModelConfig
    from kiln.platform import Platform

    platform = Platform.detect(ModelConfig(model="unused", kernels="torch"))
    assert platform.cpu is cpu_isa() and cpu_isa().model_name in platform.describe()


def test_int8_widening_threshold_from_the_tuning_or_the_environment(monkeypatch, capsys):
    tuning = KernelTuning()
    assert tuning.int8_wide_min_tokens == 16 and isa.int8_wide_min_tokens_for(tuning) == 16
    assert isa.int8_wide_min_tokens_for(tuning, " 0 ") == 0
    assert isa.int8_wide_min_tokens_for(tuning, "64") == 64
    for bad in ("-1", "16.5", "", "many"):
        with pytest.raises(ValueError, match="KILN_INT8_WIDE_MIN_TOKENS must be a token count"):
            isa.int8_wide_min_tokens_for(tuning, bad)
    from kiln.cli import main

    monkeypatch.setenv("KILN_INT8_WIDE_MIN_TOKENS", "many")
    assert main(["models", "list"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "KILN_INT8_WIDE_MIN_TOKENS must be a token count" in err


def test_the_loaded_kernels_take_this_machines_widening_threshold():
    import torch

    from kiln.kernels.cpu import load
    from kiln.kernels.int8_vnni import int8_vnni_available

    if not load() or not int8_vnni_available() or not torch.ops.kiln.bf16_vnni_available():
        pytest.skip("no AVX512-VNNI with AVX512-BF16 kernels in this environment")
    loaded = torch.ops.kiln.set_int8_wide_min_tokens(0)
    torch.ops.kiln.set_int8_wide_min_tokens(loaded)
    assert loaded == isa.int8_wide_min_tokens()
