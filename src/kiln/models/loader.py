"""Load an HF checkpoint directory (config.json + safetensors, sharded or not) into a kiln model.

Weights stream tensor by tensor from the safetensors files into the model's own parameters:
checkpoint modules listed in the model's `packed_modules` land in one shard of a fused linear
layer (q/k/v -> qkv_proj, gate/up -> gate_up_proj). Every expected tensor must be present;
anything wrong with the checkpoint raises `CheckpointError` naming the file and the problem.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

import kiln.models.layers.cpu_bf16  # noqa: F401  (registers dense-bf16-fp32)
import kiln.models.layers.onednn  # noqa: F401  (registers dense-onednn)
import kiln.models.layers.vnni  # noqa: F401  (registers dense-vnni)
from kiln.models.arena import gather_weights, trim_heap
from kiln.models.layers.experts import FusedExperts
from kiln.models.layers.linear import Linear, LinearMethod, get_linear_method
from kiln.models.layers.moe_router import Router
from kiln.models.registry import resolve_architecture

_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


class CheckpointError(ValueError):
    """The model directory or its files are missing, unreadable or inconsistent."""


@dataclass(frozen=True)
class LoadedModel:
    model: nn.Module
    hf_config: dict
    path: Path


def read_hf_config(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"model path {str(path)!r} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"model path {str(path)!r} is not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.is_file():
        raise CheckpointError(f"{str(path)!r} holds no config.json; is it an HF model directory?")
    try:
        return json.loads(cfg_file.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{cfg_file} is not valid JSON: {exc}") from exc


def weight_files(path: Path) -> list[Path]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{str(path)!r} holds no *.safetensors weight files")
    return files


def load_model(path: str | Path, dtype: torch.dtype, backend,
               quantization: str | None = None, linear_backend: str = "auto",
               ops=None, tp=None, stage=None, stack_experts: bool = True) -> LoadedModel:
    """`tp` (a kiln.models.layers.parallel.TensorParallel): load only this rank's part;
    `stage` (a kiln.models.layers.pipeline.PipelineStage): only this stage's layers.
    `stack_experts`: let MoE layers run their experts through the fused kernel
    (FusedExperts.stack_weights); off for tools that hook or swap single expert linears
    (kiln.quant's calibration and per-layer KL), which only the per-expert path calls."""
    path = Path(path)
    hf_config = read_hf_config(path)
    cls, arch = resolve_architecture(hf_config)
    method_for = _method_chooser(hf_config, quantization, dense_method(dtype, linear_backend))
    sharded = {} if tp is None else {"tp": tp}
    if stage is not None:
        sharded["stage"] = stage
    model = cls(arch, dtype=dtype, backend=backend, method_for=method_for, ops=ops, **sharded)
    _load_weights(model, path)
    if arch.tie_word_embeddings and hasattr(model, "lm_head"):  # (of a pipeline: the last stage)
        model.lm_head.method.load_shard(model.lm_head, 0, "weight",
                                        model.model.embed_tokens.weight)
    for module in model.modules():
        if isinstance(module, Linear):
            module.method.finalize(module)
    for module in model.modules():  # after the experts' linears are packed
        if stack_experts and isinstance(module, FusedExperts):
            module.stack_weights()
        elif isinstance(module, Router):
            module.pack()
    gather_weights(model)  # the packed weights, in module order, on huge pages
    trim_heap()  # the copies loading freed, back to the OS
    return LoadedModel(model.eval(), hf_config, path)


def dense_method(dtype: torch.dtype, linear_backend: str = "auto") -> str:
    """The dense weight format: kiln's VNNI-packed bf16 on AVX512-BF16 CPUs without AMX
    (docs/decisions/0013), oneDNN-prepacked bf16 where that runs, else bf16 weights with fp32
    arithmetic in kiln's kernel (CPUs without bf16 instructions), else plain torch."""
    from kiln.kernels.bf16_mm import bf16_gemm_available, onednn_available
    from kiln.kernels.bf16_vnni import vnni_available
    from kiln.kernels.isa import cpu_isa

    if linear_backend == "torch":
        return "dense"
    if linear_backend == "bf16-fp32":
        if not bf16_gemm_available(dtype):
            raise ValueError(f"linear_backend bf16-fp32 needs bf16 weights and kiln's CPU "
                             f"kernels; dtype is {dtype}")
        return "dense-bf16-fp32"
    vnni = dtype == torch.bfloat16 and vnni_available()
    if linear_backend == "vnni":
        if not vnni:
            raise ValueError(f"linear_backend vnni needs bf16 weights and a CPU with "
                             f"AVX512-BF16 (kiln's kernels); dtype is {dtype}, CPU "
                             f"{cpu_isa().describe()}")
        return "dense-vnni"
    if linear_backend == "auto" and vnni and cpu_isa().level != "amx":
        return "dense-vnni"
    if onednn_available(dtype):
        return "dense-onednn"
    if linear_backend == "onednn":
        raise ValueError(f"linear_backend onednn needs bf16 weights and oneDNN; dtype is {dtype}")
    if bf16_gemm_available(dtype):
        return "dense-bf16-fp32"
    return "dense"


def _method_chooser(hf_config: dict, quantization: str | None, dense: str = "dense"):
    """Which weight format each linear layer uses: a checkpoint's own per-layer formats
    (kiln quantized checkpoints), else `quantization` for all but the LM head, else dense."""
    layer_formats: dict[str, str] = (hf_config.get("quantization_config") or {}).get(
        "kiln_layer_formats", {})

    def method_for(prefix: str) -> LinearMethod:
        name = layer_formats.get(prefix)
        if name is None and quantization and prefix != "lm_head":
            name = quantization
        if name in (None, "dense") and prefix == "lm_head":
            return get_linear_method(_lm_head_dense(dense))
        return get_linear_method(dense if name in (None, "dense") else name)

    return method_for


def _lm_head_dense(dense: str) -> str:
    """The LM head's dense format: its logits come from `apply_fp32` (fp32 sums written as
    fp32). Kiln's VNNI kernel writes them itself; oneDNN's bf16 linear cannot, so where the
    rest is oneDNN-packed the head keeps plain bf16 weights for kiln's bf16_gemm_f32 (or
    torch's widened matmul without kernels). Where the rest is VNNI-packed, so is the head,
    whatever its vocabulary size (`dense-vnni-head`). A tied head holds its own copy either
    way."""
    if dense == "dense-vnni":
        return "dense-vnni-head"
    if dense != "dense-onednn":
        return dense
    from kiln.kernels.bf16_mm import bf16_gemm_available

    return "dense-bf16-fp32" if bf16_gemm_available(torch.bfloat16) else "dense"


def _load_weights(model: nn.Module, path: Path) -> None:
    expected = _expected_tensors(model)
    loaded: set[str] = set()
    # a model's checkpoint parts it does not run (GLM-4.5's multi-token-prediction layers)
    unused = getattr(model, "unused_checkpoint_prefixes", ())
    # a pipeline stage's model holds only its layers' tensors
    holds = getattr(model, "holds_tensor", lambda name: True)
    for file in weight_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    if (name.endswith(_IGNORED_SUFFIXES) or name.startswith(unused)
                            or not holds(name)):
                        continue
                    loaded.add(_load_one(model, name, f.get_tensor(name)))
        except (OSError, RuntimeError, ValueError, SafetensorError) as exc:
            if isinstance(exc, CheckpointError):
                raise
            raise CheckpointError(f"cannot read {file.name}: the file is corrupt or truncated "
                                  f"({exc})") from exc
    missing = sorted(expected - loaded)
    if missing:
        raise CheckpointError(f"checkpoint {str(path)!r} lacks {len(missing)} tensors, "
                              f"e.g. {', '.join(missing[:3])}")


def _expected_tensors(model: nn.Module) -> set[str]:
    """Keys that must come from the checkpoint: one per linear shard weight, plus plain params."""
    expected = set()
    tied = model.arch.tie_word_embeddings
    inverse = {(fused, shard): hf for hf, (fused, shard) in model.packed_modules.items()}
    for name, module in model.named_modules():
        if isinstance(module, Linear):
            if tied and name == "lm_head":
                continue
            base, _, leaf = name.rpartition(".")
            for shard in range(len(module.out_shards)):
                hf_leaf = inverse.get((leaf, shard), leaf)
                expected.add(f"{base}.{hf_leaf}" if base else hf_leaf)
        elif not list(module.children()):
            for pname, _ in module.named_parameters(recurse=False):
                expected.add(f"{name}.{pname}")
    return expected


def _load_one(model: nn.Module, name: str, tensor: torch.Tensor) -> str:
    """Copy one checkpoint tensor into the model; returns the module key it satisfied."""
    module_path, _, suffix = name.rpartition(".")
    base, _, leaf = module_path.rpartition(".")
    if leaf in model.packed_modules:
        fused, shard = model.packed_modules[leaf]
        target_path = f"{base}.{fused}"
    else:
        target_path, shard = module_path, 0
    if module_path == "lm_head" and model.arch.tie_word_embeddings:
        return "lm_head"  # tied embeddings: the checkpoint may still carry a copy
    try:
        module = model.get_submodule(target_path)
    except AttributeError as exc:
        raise CheckpointError(f"checkpoint tensor {name!r} matches no model parameter") from exc
    if isinstance(module, Linear):
        module.method.load_shard(module, shard, suffix, tensor)
        return module_path
    keep_part = getattr(module, "load_checkpoint_tensor", None)
    if keep_part is not None:  # a module keeping its rank's part (tensor parallelism)
        keep_part(suffix, tensor)
        return f"{module_path}.{suffix}"
    param = getattr(module, suffix, None)
    if not isinstance(param, torch.Tensor) or param.shape != tensor.shape:
        raise CheckpointError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, "
                              f"model expects {None if param is None else tuple(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
    return f"{module_path}.{suffix}"
