"""The steps behind `kiln quantize`: load the reference, make candidate weights, measure,
select, and compare schemes on held-out text. The CLI (kiln.quant.cli) adds progress and
printing; tests drive these directly on tiny checkpoints.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from kiln.models.layers.linear import Linear
from kiln.models.loader import load_model, read_hf_config
from kiln.quant.calibration import Split, TextSpec, token_windows
from kiln.quant.checkpoint import DENSE, Quantizer, round_to_nearest
from kiln.quant.evaluate import KLProbe, effective_weight, quantized_weight
from kiln.quant.formats import available_formats
from kiln.quant.gptq import GptqQuantizer, Scales
from kiln.quant.report import SchemeRow
from kiln.quant.select import CandidateWeights, LayerShape, Plan, PlanCost

# scheme name -> weight format ("mixed" is a search over several)
SCHEMES = {"int8": "int8", "fp8": "fp8", "int4": "int4-g128-sym", "nvfp4": "nvfp4",
           "mxfp4": "mxfp4"}
MIXED = "mixed"
DEFAULT_MIXED_FORMATS = ("int4-g128-sym", "mxfp4", "nvfp4", "int8", DENSE)
DEFAULT_BUDGET_FORMAT = "nvfp4"  # mixed, no budget given: the size of uniform NVFP4
METHODS = ("gptq", "rtn")  # how weights are rounded (see Reference.quantizers)
SCALES = tuple(s.value for s in Scales)  # how GPTQ chooses each group's grid (first: default)


def bits_budget(value: str | None, cost: PlanCost) -> float:
    """--bits-budget: a number of bits per weight, or a format name meaning the size of that
    format everywhere (scales included); default: uniform NVFP4's size."""
    value = value or DEFAULT_BUDGET_FORMAT
    try:
        return float(value)
    except ValueError:
        return cost.bits(dict.fromkeys(cost.layers, scheme_format(value)))


def scheme_format(scheme: str) -> str:
    """The format a uniform scheme stores every layer in (any registered format name works)."""
    if scheme in SCHEMES:
        return SCHEMES[scheme]
    if scheme in available_formats():
        return scheme
    raise ValueError(f"unknown scheme {scheme!r}; choose from {', '.join([*SCHEMES, MIXED])} "
                     f"or a format: {', '.join(available_formats())}")


class Reference:
    """A dense checkpoint loaded for measuring (fp32 by default: the loss measured is the
    weights', not bf16 arithmetic's), with its tokenizer and its linear layers."""

    def __init__(self, path: str | Path, dtype: torch.dtype = torch.float32):
        from transformers import AutoTokenizer

        from kiln.runner.attention import get_attention_backend

        self.path = Path(path)
        if read_hf_config(self.path).get("quantization_config"):
            raise ValueError(f"{self.path} is quantized; the reference must be dense")
        self.model = load_model(self.path, dtype, get_attention_backend("torch"),
                                stack_experts=False).model  # its expert linears get hooked
        self.tokenizer = AutoTokenizer.from_pretrained(str(self.path))
        self.linears = {n: m for n, m in self.model.named_modules() if isinstance(m, Linear)}

    def shapes(self) -> list[LayerShape]:
        """The layers a scheme quantizes: every linear layer but the LM head."""
        return [LayerShape(n, m.out_features, m.in_features)
                for n, m in self.linears.items() if n != "lm_head"]

    def windows(self, spec: TextSpec, split: Split, part: int = 0,
                parts: int = 1) -> torch.Tensor:
        return token_windows(self.tokenizer, spec, split, part, parts)

    def quantizers(self, method: str, calib: torch.Tensor | None = None, scales: str = "mse",
                   act_order: bool = True) -> tuple[CandidateWeights, Quantizer]:
        """How layers get rounded, for measuring (float weights) and for the checkpoint
        (stored tensors): "rtn" rounds to nearest on absmax grids, as loading a dense model
        quantized does; "gptq" rounds with error feedback weighted by the layers' inputs on
        `calib` windows, on grids chosen by `scales` (kiln.quant.gptq.Scales), the most
        active inputs first if `act_order`."""
        if method == "rtn":
            weights = CandidateWeights(lambda n, f: quantized_weight(self.linears[n], f))
            return weights, round_to_nearest
        if method != "gptq":
            raise ValueError(f"unknown rounding method {method!r}; choose from {METHODS}")
        if calib is None:
            raise ValueError("gptq needs calibration windows")
        layers = {n: self.linears[n] for n in (s.name for s in self.shapes())}
        gptq = GptqQuantizer(self.model, calib, layers, scales=Scales(scales),
                             act_order=act_order)
        return (CandidateWeights(gptq.weight),
                gptq.checkpoint_quantizer(type(self.model).packed_modules))

    def dense_bits(self) -> int:
        """Bits of a dense weight as served: the checkpoint's dtype (bf16 -> 16)."""
        config = read_hf_config(self.path)
        name = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        return torch.finfo(getattr(torch, name)).bits


def uniform_plan(shapes: list[LayerShape], fmt: str) -> Plan:
    return {s.name: fmt for s in shapes}


def checkpoint_plan(path: str | Path) -> Plan:
    """A kiln checkpoint's per-layer formats (empty for a dense checkpoint)."""
    config = read_hf_config(path).get("quantization_config") or {}
    return dict(config.get("kiln_layer_formats", {}))


def scheme_rows(probe: KLProbe, weights: CandidateWeights, cost: PlanCost,
                plans: Mapping[str, Plan],
                on_row: Callable[[SchemeRow], None] | None = None) -> list[SchemeRow]:
    """Each named plan measured end to end on `probe`'s text."""
    rows = []
    for name, plan in plans.items():
        row = SchemeRow(name, cost.bits(plan), cost.bytes(plan),
                        probe.measure(weights.of_plan(plan)))
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def layer_sensitivity_of_model(probe: KLProbe, model: torch.nn.Module,
                               on_layer: Callable[[str], None] | None = None,
                               ) -> dict[str, float]:
    """For each quantized linear layer of `model`: the reference's KL with that layer alone
    computing with `model`'s (dequantized) weight."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and hasattr(module.method, "dequantize_weight"):
            out[name] = probe.measure({name: effective_weight(module)}).mean_kl
            if on_layer is not None:
                on_layer(name)
    return out
