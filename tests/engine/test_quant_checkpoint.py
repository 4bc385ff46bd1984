"""Quantized checkpoints on a tiny model: written, reloaded to identical logits, served, and
judged by KL; the `kiln quantize` command line end to end."""

from __future__ import annotations

import json

import pytest
import torch

from kiln.models.layers.linear import Linear
from kiln.models.loader import load_model
from kiln.quant.calibration import Split, TextSpec
from kiln.quant.checkpoint import write_checkpoint
from kiln.quant.evaluate import KLProbe
from kiln.quant.pipeline import Reference, uniform_plan
from kiln.runner.attention import get_attention_backend
from kiln.runner.scoring import TeacherForcer

WINDOWS = TextSpec(windows=2, window_tokens=48)


def load(path, **kwargs):
    return load_model(path, torch.float32, get_attention_backend("torch"), **kwargs).model


def logits(model, windows: torch.Tensor) -> torch.Tensor:
    forcer = TeacherForcer(model, windows)
    return torch.cat([model.compute_logits(forcer.forward(s)) for s in forcer.steps])


@pytest.fixture(scope="module")
def ref(llama_path) -> Reference:
    return Reference(llama_path)


@pytest.fixture(scope="module")
def windows(ref) -> torch.Tensor:
    return ref.windows(WINDOWS, Split.HELDOUT)


@pytest.mark.parametrize("fmt", ["int8", "fp8", "int4-g32-asym", "int4-g64-sym", "nvfp4",
                                 "mxfp4"])
def test_saved_checkpoint_reloads_to_identical_logits(llama_path, ref, windows, tmp_path, fmt):
    """Stored tensors load back bit for bit: the same logits as quantizing on load."""
    out = write_checkpoint(llama_path, tmp_path / fmt, uniform_plan(ref.shapes(), fmt), fmt)
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["quant_method"] == "kiln" and set(config["kiln_layer_formats"].values()) == {fmt}
    assert (out / "tokenizer.json").is_file()
    on_load = load(llama_path, quantization=fmt)
    assert torch.equal(logits(load(out), windows), logits(on_load, windows))


def test_mixed_plan_with_dense_layers_round_trips(llama_path, ref, windows, tmp_path):
    plan = uniform_plan(ref.shapes(), "int4-g32-sym")
    plan["model.layers.0.self_attn.qkv_proj"] = "dense"
    plan["model.layers.1.mlp.down_proj"] = "nvfp4"
    out = write_checkpoint(llama_path, tmp_path / "mixed", plan, "mixed")
    model = load(out)
    layers = {n: m for n, m in model.named_modules() if isinstance(m, Linear)}
    assert not hasattr(layers["model.layers.0.self_attn.qkv_proj"].method, "fmt")
    assert layers["model.layers.1.mlp.down_proj"].method.fmt.name == "nvfp4"
    twice = write_checkpoint(llama_path, tmp_path / "again", plan, "mixed")
    assert torch.equal(logits(model, windows), logits(load(twice), windows))


def test_gptq_checkpoint_holds_the_gptq_weights(llama_path, ref, tmp_path):
    calib = ref.windows(WINDOWS, Split.CALIBRATION)
    weights, quantizer = ref.quantizers("gptq", calib)
    plan = uniform_plan(ref.shapes(), "int4-g32-sym")
    model = load(write_checkpoint(llama_path, tmp_path / "gptq", plan, "int4", quantizer))
    for name, module in model.named_modules():
        if name in plan:
            assert torch.equal(module.method.dequantize_weight(module), weights.get(name, plan[name]))


def test_int8_kl_on_a_tiny_model_is_small(llama_path, ref, windows, tmp_path):
    out = write_checkpoint(llama_path, tmp_path / "int8", uniform_plan(ref.shapes(), "int8"),
                           "int8")
    fid = KLProbe(ref.model, windows, reuse_blocks=False).measure_model(load(out))
    assert fid.mean_kl < 1e-3 and fid.top1_agreement > 0.95
    assert fid.ppl == pytest.approx(fid.ref_ppl, rel=0.02)


def test_probe_replaying_unchanged_blocks_matches_a_full_forward(ref, windows):
    name = "model.layers.1.mlp.down_proj"
    weight = ref.linears[name].weight.detach() * 1.01
    replayed = KLProbe(ref.model, windows).measure({name: weight})
    full = KLProbe(ref.model, windows, reuse_blocks=False).measure({name: weight})
    assert replayed.mean_kl == pytest.approx(full.mean_kl, rel=1e-5) and replayed.mean_kl > 0


def test_quantized_checkpoint_serves(llama_path, ref, tmp_path):
    from kiln import LLM, SamplingParams

    out = write_checkpoint(llama_path, tmp_path / "serve", uniform_plan(ref.shapes(), "int4"),
                           "int4")
    llm = LLM(str(out), kv_cache_memory=8 << 20, num_threads=1)  # bf16: int4 kernel path
    text = llm.generate("def add(a, b):", SamplingParams(max_tokens=6, temperature=0))
    assert len(text[0].outputs[0].token_ids) == 6


def test_cli_quantize_then_eval(llama_path, tmp_path):
    from kiln.cli import main

    out, report = tmp_path / "q", tmp_path / "report"
    small = ["--windows", "1", "--window-tokens", "32"]
    assert main(["quantize", "--model", llama_path, "--scheme", "int4", "--out", str(out),
                 "--calib-windows", "1", *small]) == 0
    assert (out / "model.safetensors").is_file() and (out / "quantization_report.json").is_file()
    assert main(["quantize", "eval", "--model", str(out), "--ref", llama_path,
                 "--out", str(report), "--sensitivity-windows", "1", *small]) == 0
    result = json.loads((report / "quantization_report.json").read_text())
    assert result["fidelity"]["mean_kl"] > 0 and len(result["sensitivity"]) == 8
    assert (report / "sensitivity.png").is_file()


def test_cli_mixed_respects_its_budget(llama_path, tmp_path):
    from kiln.cli import main

    out = tmp_path / "mixed"
    assert main(["quantize", "--model", llama_path, "--scheme", "mixed", "--out", str(out),
                 "--bits-budget", "6", "--method", "rtn", "--max-evals", "6",
                 "--calib-windows", "1", "--sensitivity-windows", "1", "--windows", "1",
                 "--window-tokens", "32"]) == 0
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert config["bits_per_weight"] <= 6 and len(config["kiln_layer_formats"]) == 8
    report = json.loads((out / "quantization_report.json").read_text())
    assert {r["name"] for r in report["held_out"]} >= {"mixed (searched)",
                                                       "keep most sensitive dense"}
    assert (out / "sensitivity.png").is_file() and (out / "tradeoff.png").is_file()


def test_cli_rejects_a_budget_for_uniform_schemes(llama_path, tmp_path, capsys):
    from kiln.cli import main

    assert main(["quantize", "--model", llama_path, "--scheme", "int8", "--out",
                 str(tmp_path / "x"), "--bits-budget", "5"]) == 2
    assert "mixed only" in capsys.readouterr().err
