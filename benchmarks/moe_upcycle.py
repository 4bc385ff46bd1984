"""A small mixture of experts that is not noise: SmolLM2-135M-Instruct sparsely upcycled into a
Mixtral checkpoint (Komatsuzaki et al. 2022, "Sparse Upcycling"), for measuring quantized
experts' KL per format (issue 49; docs/moe.md, "Experts").

Every layer's SwiGLU MLP becomes E experts (default 8, top 2), each a copy of it plus Gaussian
noise of `--noise` times the matrix's standard deviation (so the experts differ and none sits
on the source's 4-bit grid); the router is small random weights (std `--router-std`), so each
token goes to two near-arbitrary experts weighed ~1/2 each. Attention, norms, embeddings (tied
LM head) and tokenizer are SmolLM2's. Each expert ~= the dense MLP, so the model answers like
SmolLM2 and its next-token distributions are real ones. Written in bf16 with HF's Mixtral
names (`block_sparse_moe.gate`, `experts.{e}.w1/w3/w2`), then checked: kiln and transformers
both load it and give the same greedy tokens in fp32 on a few prompts.

  python benchmarks/moe_upcycle.py --out /tmp/smollm2-moe      # ~0.7 B parameters, 1.4 GB
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from kiln.models.default import default_model_path

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at a temperature of"]
MLP_TO_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}


def upcycle(src: Path, out: Path, experts: int, top_k: int, noise: float,
            router_std: float, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    cfg = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        layer, _, rest = name.partition(".mlp.")
        if not rest:
            tensors[name] = w
            continue
        proj = rest.removesuffix(".weight")
        w32, std = w.float(), w.float().std()
        for e in range(experts):  # expert e = the dense MLP + its own noise
            expert = w32 + noise * std * torch.randn(w32.shape, generator=gen)
            key = f"{layer}.block_sparse_moe.experts.{e}.{MLP_TO_EXPERT[proj]}.weight"
            tensors[key] = expert.to(w.dtype)
        if proj == "gate_proj":
            router = router_std * torch.randn(experts, cfg["hidden_size"], generator=gen)
            tensors[f"{layer}.block_sparse_moe.gate.weight"] = router.to(w.dtype)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg.update(architectures=["MixtralForCausalLM"], model_type="mixtral",
               num_local_experts=experts, num_experts_per_tok=top_k, sliding_window=None,
               router_aux_loss_coef=0.0, output_router_logits=False)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for f in src.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, out / f.name)


def kiln_greedy(path: Path, max_new: int) -> list[list[int]]:
    from kiln import LLM, SamplingParams

    llm = LLM(str(path), dtype="float32", kv_cache_memory=64 << 20)
    params = SamplingParams(max_tokens=max_new, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]


def hf_greedy(path: Path, max_new: int) -> list[list[int]]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # like ignore_eos
    rows = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok(prompt)["input_ids"]])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new,
                             do_sample=False, pad_token_id=tok.pad_token_id or 0)
        rows.append(out[0, ids.shape[1]:].tolist())
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--noise", type=float, default=0.05, help="expert noise, x the matrix std")
    p.add_argument("--router-std", type=float, default=0.02)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check-tokens", type=int, default=16, help="0: skip the parity check")
    args = p.parse_args(argv)
    upcycle(Path(default_model_path()), args.out, args.experts, args.top_k, args.noise,
            args.router_std, args.seed)
    if not args.check_tokens:
        return 0
    ours, theirs = kiln_greedy(args.out, args.check_tokens), hf_greedy(args.out, args.check_tokens)
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(args.out))
    for prompt, a, b in zip(PROMPTS, ours, theirs, strict=True):
        print(f"{'same' if a == b else 'DIFFERENT'}  {prompt!r} -> {tok.decode(a)!r}")
        if a != b:
            print(f"      HF: {tok.decode(b)!r}")
    return 0 if ours == theirs else 1


if __name__ == "__main__":
    raise SystemExit(main())
