"""Tiny random-weight Hugging Face checkpoints, made on the fly for tests and demos.

`make_tiny_checkpoint(path, family)` writes config.json, model.safetensors, a small byte-level
BPE tokenizer (trained here on a built-in text) and a ChatML chat template. Every family kiln
supports can be made, so parity tests compare kiln against transformers on the same weights.
"""

from __future__ import annotations

import json
from pathlib import Path

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

_CORPUS = """\
The quick brown fox jumps over the lazy dog. Paris is the capital of France.
def add(a, b):\n    return a + b\n\nclass Point:\n    def __init__(self, x, y):\n        self.x = x
{"name": "kiln", "version": 1, "tags": ["fast", "small"], "ok": true, "n": null}
Large language models predict the next token. Inference servers batch requests together.
0123456789 +-*/=<>()[]{}:;,.!?'"\\|@#$%^&_~` the and of to in is for on with as by at from
"""

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def make_tokenizer(vocab_size: int = 512):
    """A byte-level BPE tokenizer (transformers fast tokenizer) with ChatML special tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([_CORPUS] * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
        unk_token="<|endoftext|>", pad_token="<|im_end|>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_config(family: str = "llama", vocab_size: int = 512, **overrides) -> dict:
    """An HF config dict for a tiny model of `family` (GQA, head_dim != hidden/heads for qwen3)."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose from {FAMILIES}")
    base = {
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": vocab_size,
        "max_position_embeddings": 1024, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "tie_word_embeddings": family in ("llama", "qwen3"), "hidden_act": "silu",
        "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2,
    }
    arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
            "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    base.update({"architectures": [arch], "model_type": family})
    if family == "qwen3":
        base["head_dim"] = 32  # != hidden / heads = 16
    if family == "mistral":
        base["sliding_window"] = None
    base.update(overrides)
    return base


def make_tiny_checkpoint(path: str | Path, family: str = "llama", seed: int = 0,
                         dtype: str = "float32", **overrides) -> Path:
    """Write a random-weight checkpoint of `family` to `path` and return the path."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer()
    cfg_dict = tiny_config(family, vocab_size=len(tokenizer), **overrides)
    config = AutoConfig.for_model(cfg_dict.pop("model_type"), **cfg_dict)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    _spread_weights(model, seed)
    model.save_pretrained(str(path), safe_serialization=True)
    tokenizer.save_pretrained(str(path))
    _ensure_chat_template(path)
    return path


def _spread_weights(model, seed: int) -> None:
    """Random init with a larger scale than HF's 0.02 so logits are peaked, not near-uniform
    (near-ties would make greedy parity a coin toss between two equal logits)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * (1.0 / p.shape[-1] ** 0.5))
            elif "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen))


def _ensure_chat_template(path: Path) -> None:
    cfg_path = path / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    if "chat_template" not in cfg and not (path / "chat_template.jinja").exists():
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg, indent=2))
