"""kiln's greedy tokens against HF transformers on the same device (tests/gpu and
benchmarks/gpu_check.py).

In fp32 the tokens must be equal. In bf16 two correct implementations round differently (kiln
keeps the LM head's sums in fp32, HF rounds its logits to bf16; the attention kernels sum in
other orders), so a near tie may go either way and the sequences part there. The bf16 check is
teacher-forced instead: HF scores kiln's own sequence, and at every generated position kiln's
token must be HF's best or within `tolerance` of it (`Agreement.worst_gap`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Agreement:
    """How kiln's greedy tokens read to HF, over every generated position of every prompt."""

    positions: int  # generated tokens compared
    hf_best: int  # positions where kiln's token is HF's argmax
    worst_gap: float  # max over positions of HF's best logit minus the logit of kiln's token
    first_split: list[int | None]  # per prompt: first position where HF's greedy differs

    @property
    def exact(self) -> bool:
        return self.hf_best == self.positions

    def within(self, tolerance: float) -> bool:
        return self.worst_gap <= tolerance


def load_hf(path: str, dtype: torch.dtype, device: torch.device):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos: EOS may be chosen, no stop
    return model


@torch.inference_mode()
def hf_greedy(model, prompt_ids: list[int], max_new: int) -> list[int]:
    """HF generate's greedy continuation of one prompt (no padding)."""
    ids = torch.tensor([prompt_ids], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                         min_new_tokens=max_new, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@torch.inference_mode()
def agreement(model, prompts: list[list[int]], kiln_tokens: list[list[int]]) -> Agreement:
    """HF's logits over each prompt + kiln's tokens, read at kiln's generated positions."""
    positions = best = 0
    worst = 0.0
    splits: list[int | None] = []
    for prompt, tokens in zip(prompts, kiln_tokens, strict=True):
        ids = torch.tensor([prompt + tokens], device=model.device)
        logits = model(ids).logits[0, len(prompt) - 1:len(prompt) - 1 + len(tokens)].float()
        chosen = logits.gather(1, torch.tensor(tokens, device=logits.device)[:, None])[:, 0]
        gaps = logits.max(dim=1).values - chosen
        positions += len(tokens)
        best += int((gaps == 0).sum())
        worst = max(worst, float(gaps.max()) if len(tokens) else 0.0)
        hf = hf_greedy(model, prompt, len(tokens))
        splits.append(next((i for i, (a, b) in enumerate(zip(hf, tokens, strict=True))
                             if a != b), None))
    return Agreement(positions, best, worst, splits)
