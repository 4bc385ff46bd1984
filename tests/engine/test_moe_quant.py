"""`kiln quantize` on mixture-of-experts checkpoints (issue 49: quantized experts with KL
measured per format): a tiny GLM-4.5 and a tiny DeepSeek-V3 (MLA, layer 1 sparse) through
the command line in every uniform scheme, GPTQ-calibrated on the tokens routed to each
expert, judged by KL on held-out text; the int4 checkpoint as served (`kiln quantize eval`) measures
the same KL, and generates. A tiny Mixtral and Qwen3-MoE (every layer sparse) in int8 and
4-bit formats: every expert's tensors on disk are the format's, the router's stay dense, and
the checkpoint loads with each expert in that format and generates what quantizing on load
generates.

On these checkpoints (seed 0, 32 held-out tokens) the mean KL runs ~0.012 (int8) to ~0.08
(int4, mxfp4) nats; int8 is the closest in both."""

from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors import safe_open

from kiln import LLM, SamplingParams
from kiln.models.layers.linear import Linear, get_linear_method
from kiln.quant.pipeline import SCHEMES
from tests.parity.test_mla_parity import make_tiny_deepseek
from tests.parity.test_moe_parity import make_tiny_moe

SMALL = ["--calib-windows", "1", "--windows", "1", "--window-tokens", "32"]
DEEPSEEK_SPARSE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
                       n_group=4, topk_group=2, moe_intermediate_size=32, n_shared_experts=1,
                       routed_scaling_factor=2.5, norm_topk_prob=True)


def make(family: str, path) -> str:
    if family == "deepseek_v3":
        return make_tiny_deepseek(path, "yarn", **DEEPSEEK_SPARSE)
    return make_tiny_moe(path, family)


@pytest.mark.parametrize("family", ["glm4_moe", "deepseek_v3"])
def test_every_scheme_quantizes_the_experts_and_reports_kl(family, tmp_path):
    from kiln.cli import main

    path = make(family, tmp_path / family)
    kl: dict[str, float] = {}
    for scheme in SCHEMES:
        out = tmp_path / scheme
        assert main(["quantize", "--model", path, "--scheme", scheme, "--out", str(out),
                     *SMALL]) == 0
        formats = json.loads((out / "config.json").read_text())[
            "quantization_config"]["kiln_layer_formats"]
        experts = [name for name in formats if ".mlp.experts." in name]
        assert len(experts) == 8 * 2  # layer 1's 8 experts: gate_up and down each
        assert {formats[name] for name in experts} == {SCHEMES[scheme]}
        assert any(".mlp.shared_experts." in name for name in formats)
        assert not any(name.endswith(".mlp.gate") for name in formats)  # the router: dense
        assert not any("kv_b_proj" in name for name in formats)  # (MLA: read as matrices)
        row = json.loads((out / "quantization_report.json").read_text())["held_out"][0]
        kl[scheme] = row["fidelity"]["mean_kl"]
        assert 0 < kl[scheme] < 1 and math.isfinite(row["fidelity"]["ppl"])
    assert min(kl, key=kl.get) == "int8", kl  # 8 bits lose least
    # the written checkpoint, loaded as served, judged against the reference
    report = tmp_path / "eval"
    assert main(["quantize", "eval", "--model", str(tmp_path / "int4"), "--ref", path,
                 "--out", str(report), "--no-sensitivity", *SMALL[2:]]) == 0
    result = json.loads((report / "quantization_report.json").read_text())
    assert result["fidelity"]["mean_kl"] == pytest.approx(kl["int4"], rel=1e-3)
    llm = LLM(str(tmp_path / "int4"), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    out = llm.generate(["The quick brown fox"], SamplingParams(max_tokens=4, temperature=0,
                                                               ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 4


# format -> its stored tensors per HF module (docs/quantization.md, "On-disk layout")
STORED = {"int8": {"weight": torch.int8, "weight_scale": torch.float32},
          "int4-g128-sym": {"weight_packed": torch.uint8, "weight_scale": torch.float16},
          "mxfp4": {"weight_packed": torch.uint8, "weight_scale": torch.uint8},
          "nvfp4": {"weight_packed": torch.uint8, "weight_scale": torch.float8_e4m3fn,
                    "weight_global_scale": torch.float32}}
EXPERT_LEAVES = {"mixtral": ("w1", "w2", "w3"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}


def stored_tensors(path) -> dict[str, dict[str, torch.dtype]]:
    """HF module -> {tensor suffix: dtype} over the checkpoint's safetensors files."""
    modules: dict[str, dict[str, torch.dtype]] = {}
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                module, _, suffix = key.rpartition(".")
                if suffix.startswith("weight"):
                    modules.setdefault(module, {})[suffix] = f.get_tensor(key).dtype
    return modules


def greedy(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


PROMPTS = ["The quick brown fox", "def add(a, b):"]


@pytest.mark.parametrize("family, scheme", [("mixtral", "int8"), ("mixtral", "int4"),
                                            ("qwen3_moe", "int8"), ("qwen3_moe", "nvfp4"),
                                            ("qwen3_moe", "mxfp4")])
def test_every_expert_linear_is_written_and_served_in_the_scheme(family, scheme, tmp_path):
    from kiln.cli import main

    path = make_tiny_moe(tmp_path / family, family)
    out = tmp_path / scheme
    assert main(["quantize", "--model", path, "--scheme", scheme, "--out", str(out),
                 "--method", "rtn", "--no-eval"]) == 0
    fmt = SCHEMES[scheme]
    formats = json.loads((out / "config.json").read_text())[
        "quantization_config"]["kiln_layer_formats"]
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    experts = {f"model.layers.{i}.{block}.experts.{e}.{leaf}" for i in range(2) for e in range(8)
               for leaf in ("gate_up_proj", "down_proj")}
    assert {name: formats.get(name) for name in experts} == dict.fromkeys(experts, fmt)
    stored = stored_tensors(out)
    on_disk = [m for m in stored if ".experts." in m]
    assert sorted(on_disk) == sorted(f"model.layers.{i}.{block}.experts.{e}.{leaf}" for i in
                                     range(2) for e in range(8) for leaf in EXPERT_LEAVES[family])
    assert all(stored[m] == STORED[fmt] for m in on_disk), {m: stored[m] for m in on_disk[:1]}
    for i in range(2):  # the router: a dense float weight, never quantized
        assert stored[f"model.layers.{i}.{block}.gate"] == {"weight": torch.float32}

    llm = LLM(str(out), dtype="float32", kv_cache_memory=8 << 20, num_threads=1)
    served = {n: m for n, m in llm.engine.runner.model.named_modules() if isinstance(m, Linear)}
    method = type(get_linear_method(fmt))
    assert all(type(served[name].method) is method for name in experts)
    tokens = greedy(llm)
    on_load = LLM(path, dtype="float32", quantization=fmt, kv_cache_memory=8 << 20,
                  num_threads=1)
    assert tokens == greedy(on_load)  # round to nearest: the same weights as quantizing on load
    assert all(len(t) == 8 for t in tokens)
