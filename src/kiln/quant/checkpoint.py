"""kiln quantized checkpoints: an HF model directory that `LLM(model=DIR)` loads as it is.

On-disk layout (docs/quantization.md has the full table):

  config.json        the source config plus
                       "quantization_config": {
                         "quant_method": "kiln", "format_version": 1, "scheme": "int4" | ...,
                         "kiln_layer_formats": {kiln linear module: format name | "dense"},
                         "formats": {format: {"bits_per_weight": b, "tensors": {...}}}, ...}
                     `kiln_layer_formats` names every linear layer, by kiln module path
                     (fused `qkv_proj` / `gate_up_proj`; see kiln.models.loader).
  *.safetensors      the source files, tensor by tensor, with each quantized HF module's
                     `<module>.weight` replaced by its format's stored tensors
                     `<module>.weight_packed`, `.weight_scale`, ... (compressed-tensors names;
                     `weight_min` is kiln's fp16 group minimum). q/k/v and gate/up stay separate
                     HF modules, each quantized on its own, exactly as the loader fills the
                     fused layer's shards. Everything else (embeddings, norms, dense layers,
                     biases) is copied unchanged.
  everything else    tokenizer files, generation config, chat template: copied.

The writer streams one source file at a time, so memory stays near the largest file.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from kiln.models.loader import read_hf_config, weight_files
from kiln.models.registry import resolve_architecture
from kiln.quant.formats import get_format

FORMAT_VERSION = 1
DENSE = "dense"
INDEX_FILE = "model.safetensors.index.json"

# (HF module path, format name, dense weight) -> the format's stored tensors
Quantizer = Callable[[str, str, torch.Tensor], dict[str, torch.Tensor]]


def round_to_nearest(_module: str, fmt: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The plain quantizer: the format's own rounding of the weight."""
    return get_format(fmt).quantize(weight)


def hf_module_formats(layer_formats: Mapping[str, str], packed_modules: Mapping) -> dict[str, str]:
    """kiln module formats -> HF module formats (a fused kiln layer names each of its parts).

    packed_modules: HF leaf -> (kiln fused leaf, shard), e.g. "q_proj" -> ("qkv_proj", 0).
    """
    parts: dict[str, list[str]] = {}
    for hf_leaf, (fused, _shard) in packed_modules.items():
        parts.setdefault(fused, []).append(hf_leaf)
    out = {}
    for module, fmt in layer_formats.items():
        base, _, leaf = module.rpartition(".")
        for hf_leaf in parts.get(leaf, [leaf]):
            out[f"{base}.{hf_leaf}" if base else hf_leaf] = fmt
    return out


def quantization_config(layer_formats: Mapping[str, str], scheme: str, **extra) -> dict:
    """The `quantization_config` block of a kiln checkpoint's config.json."""
    used = sorted({f for f in layer_formats.values() if f != DENSE})
    formats = {name: {"group_size": get_format(name).group_size,
                      "tensors": {t.name: str(t.dtype).removeprefix("torch.")
                                  for t in get_format(name).storage(16, 256)}}
               for name in used}
    return {"quant_method": "kiln", "format_version": FORMAT_VERSION, "scheme": scheme,
            "kiln_layer_formats": dict(sorted(layer_formats.items())), "formats": formats,
            **extra}


def write_checkpoint(src: str | Path, out: str | Path, layer_formats: Mapping[str, str],
                     scheme: str, quantizer: Quantizer = round_to_nearest,
                     on_tensor: Callable[[str], None] | None = None, **extra) -> Path:
    """Write `src` (a dense HF checkpoint) to `out` with each linear layer in its format.

    layer_formats: kiln linear module -> format name or "dense"; every layer of the model
    should be named (unnamed ones are served dense). on_tensor: called once per source tensor
    (progress). extra: more keys for `quantization_config` (e.g. how the plan was chosen).
    """
    src, out = Path(src), Path(out)
    hf_config = read_hf_config(src)
    if hf_config.get("quantization_config"):
        raise ValueError(f"{src} is already quantized; quantize a dense checkpoint")
    if out.resolve() == src.resolve():
        raise ValueError("--out must differ from the source model directory")
    cls, _arch = resolve_architecture(hf_config)
    by_module = {m: f for m, f in hf_module_formats(layer_formats, cls.packed_modules).items()
                 if f != DENSE}
    out.mkdir(parents=True, exist_ok=True)
    weight_map = {}
    for file in weight_files(src):
        tensors = _convert_file(file, by_module, quantizer, on_tensor)
        save_file(tensors, str(out / file.name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file.name))
    _copy_side_files(src, out, weight_map)
    config = dict(hf_config, quantization_config=quantization_config(layer_formats, scheme,
                                                                      **extra))
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def _convert_file(file: Path, by_module: Mapping[str, str], quantizer: Quantizer,
                  on_tensor: Callable[[str], None] | None) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(file), framework="pt") as f:
        for name in f.keys():
            module, _, suffix = name.rpartition(".")
            fmt = by_module.get(module)
            if fmt is not None and suffix == "weight":
                stored = quantizer(module, fmt, f.get_tensor(name))
                tensors.update({f"{module}.{key}": t.contiguous() for key, t in stored.items()})
            else:
                tensors[name] = f.get_tensor(name)
            if on_tensor is not None:
                on_tensor(name)
    return tensors


def _copy_side_files(src: Path, out: Path, weight_map: dict[str, str]) -> None:
    """Tokenizer, generation config, chat template...; a fresh index for sharded weights."""
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in (
                "config.json", INDEX_FILE):
            shutil.copy2(path, out / path.name)
    if (src / INDEX_FILE).is_file():
        index = {"metadata": {"format": "pt"}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
