"""HF architecture name -> kiln model class (and how to read its shape from config.json)."""

from __future__ import annotations

from kiln.models.deepseek_v3 import DeepseekV3Arch, DeepseekV3ForCausalLM
from kiln.models.glm4_moe import Glm4MoeArch, Glm4MoeForCausalLM
from kiln.models.llama import LlamaArch, LlamaForCausalLM
from kiln.models.mixtral import MixtralArch, MixtralForCausalLM
from kiln.models.qwen_moe import QwenMoeArch, QwenMoeForCausalLM

# architecture -> (model class, arch parser)
_MODELS = {
    "LlamaForCausalLM": (LlamaForCausalLM, LlamaArch.from_hf),
    "MistralForCausalLM": (LlamaForCausalLM, LlamaArch.from_hf),
    "Qwen2ForCausalLM": (LlamaForCausalLM, LlamaArch.from_hf),
    "Qwen3ForCausalLM": (LlamaForCausalLM, LlamaArch.from_hf),
    "MixtralForCausalLM": (MixtralForCausalLM, MixtralArch.from_hf),
    "Qwen2MoeForCausalLM": (QwenMoeForCausalLM, QwenMoeArch.from_hf),
    "Qwen3MoeForCausalLM": (QwenMoeForCausalLM, QwenMoeArch.from_hf),
    "Glm4MoeForCausalLM": (Glm4MoeForCausalLM, Glm4MoeArch.from_hf),
    "DeepseekV3ForCausalLM": (DeepseekV3ForCausalLM, DeepseekV3Arch.from_hf),
}


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_architecture(hf_config: dict):
    """(model class, parsed arch) for an HF config, or a ValueError naming what is supported."""
    archs = hf_config.get("architectures") or []
    for name in archs:
        if name in _MODELS:
            cls, parse = _MODELS[name]
            return cls, parse(hf_config, name)
    raise ValueError(
        f"unsupported model architecture {archs or hf_config.get('model_type')!r}; "
        f"kiln supports: {', '.join(supported_architectures())}")
