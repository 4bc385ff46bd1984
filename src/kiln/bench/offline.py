"""`kiln bench offline`: one workload through kiln and through HF transformers in the same run.

Scenarios (the engine issue's table), each repeated `--runs` times, medians reported:
  decode      batch-1 decode tokens/s (128-token prompt, 128 new tokens, greedy, EOS ignored)
  throughput  64 requests x 128 prompt x 128 output tokens; HF runs request by request and in
              padded batches of 16 (timed on a subset, reported as tokens/s)
  prefix      a 1,024-token shared prefix then distinct questions: time to first token and
              throughput, prefix caching on vs off
  zero-hit    prefix caching on at a 0% hit rate vs off (the cost of hashing and bookkeeping)
Results print as a rich table, go to JSON (`--out`) and a PNG bar chart (`--plot`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

SCENARIOS = ("decode", "throughput", "prefix", "zero-hit")
BANDWIDTH_GBPS = 33.0  # what two threads read on this machine class (shared/peers/README.md)


@dataclass
class Row:
    scenario: str
    metric: str
    kiln: float
    peer: float | None
    peer_name: str
    unit: str
    higher_is_better: bool = True

    @property
    def ratio(self) -> float | None:
        if not self.peer:
            return None
        return self.kiln / self.peer if self.higher_is_better else self.peer / self.kiln


@dataclass
class OfflineReport:
    model: str
    dtype: str
    threads: int
    runs: int
    rows: list[Row] = field(default_factory=list)
    notes: dict[str, float] = field(default_factory=dict)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("offline", help="kiln vs HF transformers in-process (no HTTP)")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled model)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--scenario", action="append", choices=SCENARIOS,
                   help="repeatable; default: all")
    p.add_argument("--runs", type=int, default=3, help="repetitions per measurement (median)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers side")
    p.add_argument("--quantization", default=None, help="serve weights in this format")
    p.add_argument("--num-requests", type=int, default=64, help="requests in `throughput`")
    p.add_argument("--out", type=Path, default=None, help="write results as JSON")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG bar chart of ratios")
    p.set_defaults(func=run_cli)


def run_cli(args: argparse.Namespace) -> int:
    from kiln.engine.core import resolve_model_path

    model = resolve_model_path(args.model)
    report = run_offline(model, args.dtype, args.scenario or list(SCENARIOS), args.runs,
                         args.threads, not args.no_hf, args.quantization, args.num_requests)
    print_report(report)
    if args.out:
        args.out.write_text(json.dumps(asdict(report) | {"ratios": [r.ratio for r in report.rows]},
                                       indent=2))
    if args.plot:
        plot_report(report, args.plot)
    return 0


def median_of(runs: int, fn: Callable[[], float]) -> float:
    return statistics.median(fn() for _ in range(runs))


# -- the workloads ---------------------------------------------------------------------------

def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (n, length), generator=gen).tolist()


def run_offline(model: str, dtype: str, scenarios: list[str], runs: int, threads: int | None,
                with_hf: bool, quantization: str | None, num_requests: int) -> OfflineReport:
    import torch

    from kiln import LLM

    if threads:
        torch.set_num_threads(threads)
    report = OfflineReport(model, dtype, threads or torch.get_num_threads(), runs)
    llm = LLM(model, dtype=dtype, num_threads=threads, quantization=quantization,
              max_model_len=2048)
    hf = HFSide(model, dtype) if with_hf else None
    vocab = llm.engine.vocab_size
    for scenario in scenarios:
        SCENARIO_FNS[scenario](report, llm, hf, vocab, runs, num_requests)
    return report


def _kiln_tokens_per_s(llm, prompts, max_tokens: int, caching: bool | None = None) -> float:
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    if caching is not None:
        llm.engine.kv.set_prefix_caching(caching)
    llm.engine.kv.pool.reset_prefix_cache()
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    return sum(len(o.outputs[0].token_ids) for o in outs) / elapsed


def scenario_decode(report, llm, hf, vocab, runs, _n):
    prompt = random_prompts(1, 128, vocab, seed=1)
    _kiln_tokens_per_s(llm, prompt, 8)  # warm-up
    kiln = median_of(runs, lambda: _kiln_tokens_per_s(llm, prompt, 128))
    peer = median_of(runs, lambda: hf.tokens_per_s(prompt, 128)) if hf else None
    report.rows.append(Row("decode", "batch-1 decode", kiln, peer, "HF generate", "tok/s"))
    # bytes a decode step reads: every weight but the embedding table (one row per token)
    weights = decode_weight_bytes(llm.engine.runner.model)
    ceiling = BANDWIDTH_GBPS * 1e9 / weights
    report.notes.update({"weight_bytes": weights, "bandwidth_ceiling_tok_s": ceiling,
                         "decode_fraction_of_ceiling": kiln / ceiling})


def scenario_throughput(report, llm, hf, vocab, runs, n):
    prompts = random_prompts(n, 128, vocab, seed=2)
    kiln = median_of(runs, lambda: _kiln_tokens_per_s(llm, prompts, 128))
    seq = hf.tokens_per_s(prompts[:2], 128) if hf else None
    padded = hf.batched_tokens_per_s(prompts[:16], 128) if hf else None
    report.rows.append(Row("throughput", f"{n}x128/128", kiln, seq,
                           "HF generate, one request at a time", "tok/s"))
    report.rows.append(Row("throughput", f"{n}x128/128", kiln, padded,
                           "HF generate, padded batches of 16", "tok/s"))


def scenario_prefix(report, llm, _hf, vocab, runs, _n):
    from kiln import SamplingParams

    prefix = random_prompts(1, 1024, vocab, seed=3)[0]
    questions = random_prompts(16, 24, vocab, seed=4)
    prompts = [prefix + q for q in questions]

    def ttft(caching: bool) -> float:
        llm.engine.kv.set_prefix_caching(caching)
        llm.engine.kv.pool.reset_prefix_cache()
        llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(max_tokens=1),
                     use_tqdm=False)  # the prefix is now cached (when caching is on)
        times = []
        for p in prompts[1:6]:
            start = time.perf_counter()
            llm.generate([{"prompt_token_ids": p}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
            times.append(time.perf_counter() - start)
        return statistics.median(times) * 1000

    on, off = median_of(runs, lambda: ttft(True)), median_of(runs, lambda: ttft(False))
    report.rows.append(Row("prefix", "TTFT, 1,024-token shared prefix", on, off,
                           "kiln, prefix caching off", "ms", higher_is_better=False))
    tp_on = median_of(runs, lambda: _kiln_tokens_per_s(llm, prompts, 32, caching=True))
    tp_off = median_of(runs, lambda: _kiln_tokens_per_s(llm, prompts, 32, caching=False))
    llm.engine.kv.set_prefix_caching(True)
    report.rows.append(Row("prefix", "throughput, 16 x (1,024 shared + 24) / 32", tp_on, tp_off,
                           "kiln, prefix caching off", "tok/s"))


def scenario_zero_hit(report, llm, _hf, vocab, runs, n):
    prompts = random_prompts(n, 128, vocab, seed=5)
    pairs = [(_kiln_tokens_per_s(llm, prompts, 128, caching=True),
              _kiln_tokens_per_s(llm, prompts, 128, caching=False)) for _ in range(runs)]
    llm.engine.kv.set_prefix_caching(True)
    on = statistics.median(p[0] for p in pairs)
    off = statistics.median(p[1] for p in pairs)
    report.rows.append(Row("zero-hit", f"{n}x128/128, 0% hits", on, off,
                           "kiln, prefix caching off", "tok/s"))


SCENARIO_FNS = {"decode": scenario_decode, "throughput": scenario_throughput,
                "prefix": scenario_prefix, "zero-hit": scenario_zero_hit}


# -- HF transformers side --------------------------------------------------------------------

class HFSide:
    def __init__(self, model: str, dtype: str):
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model, dtype=getattr(torch, dtype))
        self.model.generation_config.eos_token_id = None  # ignore EOS, like kiln's ignore_eos
        self.tokens_per_s(random_prompts(1, 16, self.model.config.vocab_size, 0), 4)  # warm-up

    def tokens_per_s(self, prompts: list[list[int]], max_new: int) -> float:
        start = time.perf_counter()
        for p in prompts:
            self._generate(self.torch.tensor([p]), max_new)
        return len(prompts) * max_new / (time.perf_counter() - start)

    def batched_tokens_per_s(self, prompts: list[list[int]], max_new: int) -> float:
        batch = self.torch.tensor(prompts)  # equal lengths: padding-free batch
        start = time.perf_counter()
        self._generate(batch, max_new)
        return len(prompts) * max_new / (time.perf_counter() - start)

    def _generate(self, ids, max_new: int):
        with self.torch.inference_mode():
            return self.model.generate(ids, attention_mask=self.torch.ones_like(ids),
                                       max_new_tokens=max_new, do_sample=False, pad_token_id=0)


# -- output ----------------------------------------------------------------------------------

def print_report(report: OfflineReport) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"kiln bench offline: {Path(report.model).name}, {report.dtype}, "
                        f"{report.threads} threads, median of {report.runs}")
    for col in ("scenario", "metric", "kiln", "compared with", "peer", "ratio"):
        table.add_column(col)
    for r in report.rows:
        ratio = f"{r.ratio:.2f}x" if r.ratio else "-"
        peer = f"{r.peer:.1f} {r.unit}" if r.peer else "-"
        table.add_row(r.scenario, r.metric, f"{r.kiln:.1f} {r.unit}", r.peer_name, peer, ratio)
    console = Console()
    console.print(table)
    if "bandwidth_ceiling_tok_s" in report.notes:
        n = report.notes
        console.print(f"batch-1 decode = {n['decode_fraction_of_ceiling']:.0%} of the "
                      f"{n['bandwidth_ceiling_tok_s']:.0f} tok/s bandwidth ceiling "
                      f"({n['weight_bytes'] / 1e6:.0f} MB of weights at {BANDWIDTH_GBPS} GB/s)")


def plot_report(report: OfflineReport, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in report.rows if r.ratio]
    fig, ax = plt.subplots(figsize=(8, 0.5 + 0.5 * len(rows)))
    labels = [f"{r.metric}\nvs {r.peer_name}" for r in rows]
    ax.barh(labels, [r.ratio for r in rows], color="#c0392b")
    ax.axvline(1.0, color="black", linewidth=0.8)
    ax.set_xlabel("kiln advantage (x, higher is better)")
    ax.set_title(f"kiln bench offline ({report.dtype}, {report.threads} threads)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes of every weight a decode step reads: all but the embedding table (one row per
    token), counting oneDNN-packed linears by their packed copy."""
    total = 0
    for name, module in model.named_modules():
        if "embed_tokens" in name:
            continue
        tensors = list(module.parameters(recurse=False))
        packed = getattr(module, "packed_weight", None)
        if packed is not None:
            tensors.append(packed)
        total += sum(t.numel() * t.element_size() for t in tensors)
    return total
