"""Multi-head latent attention on CPU: a DeepSeek-V3-shaped model scaled to this machine beside
a grouped-query model of the same parameter count (issue 49).

The MLA model (transformers' DeepseekV3Config, random bf16 weights, every layer dense): hidden
1,024, 8 layers, 16 heads with DeepSeek-V3's own head shape (kv_lora_rank 512, rope 64, nope
128, v 128, q_lora_rank 384), MLP 3,072, YaRN rope. The GQA twin (Qwen3Config): the same
hidden, layers and vocabulary, 16 query heads of 128 with 4 KV heads; MLA's attention holds
~1.1 M more weights per layer (6.4 M against 5.2 M), so the twin's MLP is widened until the
two models' parameter counts agree to within one MLP column per layer (`equal_size`; both
counts are in the kv rows). Rows per model:

  kv        parameters; KV cache bytes per token (kiln's own spec) and, for MLA, what plain
            multi-head attention would cache for the same model
  batch1    one prompt of --prompt-len tokens, 128 greedy tokens: prefill ms, decode tok/s
  batch16   16 such prompts at once: output tok/s

MLA decodes in the absorbed form through the torch attention path (the C++ kernels take K and
V of one width); the GQA twin runs kiln's C++ kernels (and the fused stack where it applies).

usage: python benchmarks/mla.py [--dir /tmp/kiln-mla-bench] [--reps 3] [--threads 2]
       [--prompt-len 512] [--tiny] [--out benchmarks/results/mla.json]
       [--plot benchmarks/results/mla.png]
       python benchmarks/mla.py --footprint PATH/config.json [--dtype bfloat16]
       (--footprint: any DeepSeek-V3 config's KV bytes per token, MLA against plain attention)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KILN_BIND = {"OMP_PROC_BIND": "close", "OMP_PLACES": "cores"}  # as cpu_speed.py
NEW_TOKENS, BATCH = 128, 16


def hf_configs(tiny: bool, vocab: int) -> dict[str, dict]:
    """model name -> config (model_type included) of the MLA model and its GQA twin, the
    twin's MLP widened to the MLA model's parameter count."""
    hidden, layers, heads = (64, 2, 4) if tiny else (1024, 8, 16)
    common = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                  intermediate_size=3 * hidden, vocab_size=vocab, max_position_embeddings=4096,
                  tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=1, eos_token_id=2)
    mla_dims = (dict(kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
                     q_lora_rank=32) if tiny else
                dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128,
                     v_head_dim=128, q_lora_rank=384))
    configs = {
        "mla": dict(common, model_type="deepseek_v3", architectures=["DeepseekV3ForCausalLM"],
                    num_key_value_heads=heads, first_k_dense_replace=layers, **mla_dims,
                    rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 1.0,
                                  "mscale_all_dim": 1.0,
                                  "original_max_position_embeddings": 1024}),
        "gqa": dict(common, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                    num_key_value_heads=max(1, heads // 4),
                    head_dim=16 if tiny else 128),
    }
    return equal_size(configs)


def count_parameters(cfg: dict) -> int:
    """The parameter count of the model `cfg` describes (built on the meta device: no
    memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(cfg)
    config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def equal_size(configs: dict[str, dict]) -> dict[str, dict]:
    """The GQA twin's intermediate size moved by the difference in parameters over the
    3 x hidden x layers weights one MLP column costs (rounded: the counts then differ by less
    than one column per layer)."""
    mla, gqa = configs["mla"], configs["gqa"]
    column = 3 * gqa["hidden_size"] * gqa["num_hidden_layers"]
    extra = round((count_parameters(mla) - count_parameters(gqa)) / column)
    return dict(configs, gqa=dict(gqa, intermediate_size=gqa["intermediate_size"] + extra))


def make_checkpoints(root: Path, tiny: bool, prompt_len: int) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    for name, cfg in hf_configs(tiny, len(tokenizer)).items():
        path = root / name
        made_from = path / "bench_config.json"  # (a checkpoint of another shape is remade)
        if made_from.exists() and json.loads(made_from.read_text()) == cfg:
            continue
        path.mkdir(parents=True, exist_ok=True)
        made_from.write_text(json.dumps(cfg))
        cfg = dict(cfg)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        print(f"wrote {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params)")
        del model
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tokenizer), (BATCH, prompt_len), generator=gen)
    (root / "prompts.json").write_text(json.dumps(prompts.tolist()))


def checkpoint_parameters(path: str) -> int:
    """Numbers stored in the checkpoint's safetensors files (every parameter, once)."""
    from safetensors import safe_open

    total = 0
    for file in sorted(Path(path).glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                total += math.prod(f.get_slice(key).get_shape())
    return total


def kv_row(llm, path: str) -> dict:
    from kiln.models.deepseek_v3 import DeepseekV3Arch, kv_footprint

    spec = llm.engine.runner.kv_spec
    row = dict(model=Path(path).name, test="kv", params=checkpoint_parameters(path),
               holds=spec.holds.value,
               kv_bytes_per_token=spec.bytes_per_block // spec.block_size)
    arch = llm.engine.runner.model.arch
    if isinstance(arch, DeepseekV3Arch):
        row["plain_attention_bytes_per_token"] = kv_footprint(arch, spec.dtype)\
            .plain_bytes_per_token
    return row


def measure(path: str, prompts: list[list[int]], reps: int, threads: int) -> list[dict]:
    """kiln's rows for one model (run in a fresh process: see main)."""
    from kiln import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_model_len=4096, num_threads=threads,
              kv_cache_memory=1 << 30)

    def run(batch: list[list[int]], new: int) -> float:
        llm.engine.kv.pool.reset_prefix_cache()  # every run starts cold
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return time.perf_counter() - start

    run(prompts[:2], 4)  # warm-up
    name = Path(path).name
    base = dict(model=name, threads=threads, reps=reps, prompt_len=len(prompts[0]))
    total = statistics.median(run(prompts[:1], NEW_TOKENS) for _ in range(reps))
    prefill = statistics.median(run(prompts[:1], 1) for _ in range(reps))
    many = statistics.median(run(prompts, NEW_TOKENS) for _ in range(reps))
    return [kv_row(llm, path),
            dict(base, test="batch1", prefill_ms=round(prefill * 1e3, 1),
                 decode_ms_per_token=round((total - prefill) / (NEW_TOKENS - 1) * 1e3, 2),
                 decode_tok_s=round((NEW_TOKENS - 1) / (total - prefill), 1)),
            dict(base, test=f"batch{len(prompts)}",
                 out_tok_s=round(len(prompts) * NEW_TOKENS / many, 1))]


def run_measure(name: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--measure", name, "--dir", args.dir,
           "--reps", str(args.reps), "--threads", str(args.threads),
           "--prompt-len", str(args.prompt_len)] + (["--tiny"] if args.tiny else [])
    env = os.environ | KILN_BIND | {"PYTHONPATH": str(ROOT / "src")}
    print(f"running kiln {name} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        print(f"  failed: {proc.stderr.strip()[-800:]}")
    return rows


def print_footprint(config_path: str, dtype_name: str) -> None:
    import torch

    from kiln.models.deepseek_v3 import DeepseekV3Arch, kv_footprint

    cfg = json.loads(Path(config_path).read_text())
    f = kv_footprint(DeepseekV3Arch.from_hf(cfg, "DeepseekV3ForCausalLM"),
                     getattr(torch, dtype_name))
    print(json.dumps(dict(test="kv_footprint", config=config_path, dtype=dtype_name,
                          mla_bytes_per_token=f.mla_bytes_per_token,
                          plain_attention_bytes_per_token=f.plain_bytes_per_token,
                          ratio=round(f.ratio, 1))))


def summary(rows: list[dict]) -> dict | None:
    """MLA over GQA for each figure (None unless both models ran)."""
    by = {(r["model"], r["test"]): r for r in rows}
    batched = f"batch{BATCH}"
    keys = [("kv", "params"), ("kv", "kv_bytes_per_token"), ("batch1", "decode_tok_s"),
            (batched, "out_tok_s")]
    if not all((m, t) in by for m in ("mla", "gqa") for t, _ in keys):
        return None
    return dict(test="mla_over_gqa", **{
        field: round(by["mla", test][field] / by["gqa", test][field], 3) for test, field in keys})


def plot(rows: list[dict], path: Path) -> None:
    """Three panels, MLA beside GQA: KV bytes per token, batch-1 decode, batched output."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by = {(r["model"], r["test"]): r for r in rows if "model" in r}  # (not the ratios)
    panels = [("kv", "kv_bytes_per_token", "KV cache bytes / token"),
              ("batch1", "decode_tok_s", "batch-1 decode tok/s"),
              (f"batch{BATCH}", "out_tok_s", f"batch-{BATCH} output tok/s")]
    fig, axes = plt.subplots(1, len(panels), figsize=(12, 4))
    for ax, (test, field, title) in zip(axes, panels, strict=True):
        models = [m for m in ("mla", "gqa") if (m, test) in by]
        values = [by[m, test][field] for m in models]
        ax.bar(models, values, color=["tab:orange", "tab:blue"][:len(models)])
        for i, v in enumerate(values):
            ax.annotate(f"{v:,}", (i, v), ha="center", va="bottom")
        ax.set_title(title)
    params = {m: by[m, "kv"]["params"] for m in ("mla", "gqa") if (m, "kv") in by}
    fig.suptitle("MLA (DeepSeek-V3 heads) vs GQA, equal size: " + ", ".join(
        f"{m} {p / 1e6:.1f} M params" for m, p in params.items()))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"wrote {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/kiln-mla-bench", help="checkpoints (made if absent)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--tiny", action="store_true", help="a toy shape, to check the script")
    p.add_argument("--out", help="write every row as JSON here "
                   "(the recorded run: benchmarks/results/mla.json)")
    p.add_argument("--plot", type=Path, help="and a chart (benchmarks/results/mla.png)")
    p.add_argument("--footprint", metavar="CONFIG", help="only print this config's KV bytes")
    p.add_argument("--dtype", default="bfloat16", help="the cache dtype for --footprint")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one model, fresh process
    args = p.parse_args()
    if args.footprint:
        print_footprint(args.footprint, args.dtype)
        return
    root = Path(args.dir)
    if args.measure:
        prompts = json.loads((root / "prompts.json").read_text())
        for row in measure(str(root / args.measure), prompts, args.reps, args.threads):
            print(json.dumps(row))
        return
    root.mkdir(parents=True, exist_ok=True)
    make_checkpoints(root, args.tiny, args.prompt_len)
    rows = [row for name in ("mla", "gqa") for row in run_measure(name, args)]
    ratios = summary(rows)
    rows += [ratios] if ratios is not None else []
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()
