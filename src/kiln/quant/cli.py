"""`kiln quantize` (write a quantized checkpoint) and `kiln quantize eval` (measure one).

  kiln quantize --model M --scheme int8|fp8|int4|nvfp4|mxfp4|mixed|<format> --out DIR
                [--calib FILE] [--bits-budget B | --kl-budget X] [--formats F,F,...]
  kiln quantize eval --model DIR --ref REF [--text FILE] [--no-sensitivity]

Both measure on the built-in code + prose text (kiln.quant.calibration) unless given a file,
print rich tables, and write a JSON report and PNG charts (docs/quantization.md).
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from kiln.quant.calibration import Split, TextSpec
from kiln.quant.checkpoint import DENSE
from kiln.quant.pipeline import (
    DEFAULT_BUDGET_FORMAT,
    DEFAULT_MIXED_FORMATS,
    METHODS,
    MIXED,
    SCALES,
    SCHEMES,
)

REPORT_FILE = "quantization_report.json"


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "quantize", help="quantize a checkpoint (kiln quantize eval: measure one)",
        description="Write a quantized checkpoint that `kiln serve --model DIR` loads, and "
                    "measure it against the original (KL divergence on held-out text).")
    p.add_argument("--model", default=None, help="dense HF model dir (default: bundled model)")
    p.add_argument("--scheme", default=None,
                   help=f"{' | '.join([*SCHEMES, MIXED])}, or any format name "
                        f"(e.g. int4-g32-asym)")
    p.add_argument("--out", type=Path, default=None, help="directory to write")
    p.add_argument("--calib", type=Path, default=None,
                   help="calibration text file (default: built-in code + prose mix)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--bits-budget", default=None, metavar="B",
                        help="mixed: average bits per weight, or a format name for its size "
                             f"(default: {DEFAULT_BUDGET_FORMAT})")
    budget.add_argument("--kl-budget", type=float, default=None, metavar="X",
                        help="mixed: fewest bits whose calibration mean KL stays <= X")
    p.add_argument("--formats", default=",".join(DEFAULT_MIXED_FORMATS),
                   help="mixed: candidate formats per layer ('dense' keeps a layer as is)")
    p.add_argument("--method", choices=METHODS, default="gptq",
                   help="gptq: calibrated rounding (error feedback); rtn: round to nearest")
    p.add_argument("--scales", choices=SCALES, default=SCALES[0],
                   help="gptq: each group's grid searched for the least error weighted by the "
                        "inputs (mse), or spanning the group's min and max (absmax)")
    p.add_argument("--no-act-order", action="store_true",
                   help="gptq: round inputs in their order, not the most active first")
    p.add_argument("--max-evals", type=int, default=40,
                   help="mixed: end-to-end evaluations the search may spend")
    _add_text_args(p, windows=8, help_windows="held-out windows for the closing report")
    p.add_argument("--calib-windows", type=int, default=4,
                   help="calibration windows for GPTQ, and as many others for selection")
    p.add_argument("--sensitivity-windows", type=int, default=2,
                   help="mixed: windows (of the calibration ones) for per-layer sensitivity")
    p.add_argument("--sensitivity-from", type=Path, default=None, metavar="REPORT",
                   help="mixed: reuse the per-layer table of an earlier run's "
                        f"{REPORT_FILE} (same model, text and rounding options)")
    p.add_argument("--no-eval", action="store_true", help="skip the held-out report")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    p.set_defaults(func=run_quantize)
    sub = p.add_subparsers(dest="quantize_command", metavar="{eval}")
    e = sub.add_parser("eval", help="KL divergence of a quantized checkpoint vs its reference")
    e.add_argument("--model", required=True, help="quantized (or any) model dir to judge")
    e.add_argument("--ref", required=True, help="the dense reference model dir")
    _add_text_args(e, windows=8, help_windows="held-out windows")
    e.add_argument("--sensitivity-windows", type=int, default=2,
                   help="windows for the per-layer table (each quantized layer alone)")
    e.add_argument("--no-sensitivity", action="store_true", help="skip the per-layer table")
    e.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="compute dtype of both models (float32 isolates the weights' loss)")
    e.add_argument("--out", type=Path, default=None,
                   help="report directory (default: ./quant-eval-<model name>)")
    e.add_argument("--threads", type=int, default=None, help="torch threads (default: all)")
    e.set_defaults(func=run_eval)


def _add_text_args(p: argparse.ArgumentParser, windows: int, help_windows: str) -> None:
    p.add_argument("--text", type=Path, default=None,
                   help="held-out text file (default: built-in code + prose mix)")
    p.add_argument("--windows", type=int, default=windows, help=help_windows)
    p.add_argument("--window-tokens", type=int, default=512, help="tokens per window")


# -- kiln quantize ---------------------------------------------------------------------------

def run_quantize(args: argparse.Namespace) -> int:
    from kiln.cli import CliError
    from kiln.engine.core import resolve_model_path
    from kiln.quant.formats import get_format
    from kiln.quant.pipeline import Reference, scheme_format, uniform_plan
    from kiln.quant.select import PlanCost

    if args.scheme is None or args.out is None:
        raise CliError("kiln quantize needs --scheme and --out (or: kiln quantize eval ...)")
    if args.scheme != MIXED and (args.bits_budget is not None or args.kl_budget is not None):
        raise CliError("--bits-budget / --kl-budget apply to --scheme mixed only")
    for fmt in _formats(args) if args.scheme == MIXED else [scheme_format(args.scheme)]:
        if fmt != DENSE:
            get_format(fmt)  # an unknown name fails here, before any loading
    _set_threads(args.threads)
    console = _console()
    src = resolve_model_path(args.model)
    with console.status(f"loading {src}"):
        ref = Reference(src)
    cost = PlanCost(ref.shapes(), ref.dense_bits())
    # GPTQ rounds on one half of the calibration text; selection measures on the other, so
    # it judges the rounded weights on text they were not fitted to
    spec = TextSpec(args.calib_windows, args.window_tokens, args.calib)
    with console.status(f"{args.method}: reading calibration activations"):
        weights, quantizer = ref.quantizers(args.method,
                                            ref.windows(spec, Split.CALIBRATION, 0, 2),
                                            args.scales, not args.no_act_order)
    gptq = {"scales": args.scales, "act_order": not args.no_act_order}
    report: dict = {"model": str(src), "scheme": args.scheme, "method": args.method,
                    **(gptq if args.method == "gptq" else {})}
    if args.scheme == MIXED:
        select = ref.windows(spec, Split.CALIBRATION, 1, 2)
        plan, plans = _select_mixed(args, ref, select, cost, weights, console, report)
    else:
        plan = uniform_plan(ref.shapes(), scheme_format(args.scheme))
        plans = {args.scheme: plan}
    _write(src, args.out, plan, args.scheme, cost, quantizer, console, method=args.method,
           **(gptq if args.method == "gptq" else {}))
    if not args.no_eval:
        _held_out_report(args, ref, cost, weights, plans, console, report)
    from kiln.quant.report import write_json

    write_json(args.out / REPORT_FILE, report)
    console.print(f"wrote {args.out} (serve it: kiln serve --model {args.out})")
    return 0


def _select_mixed(args, ref, calib, cost, weights, console, report: dict):
    from kiln.quant.evaluate import KLProbe
    from kiln.quant.pipeline import bits_budget
    from kiln.quant.report import plot_sensitivity, sensitivity_table
    from kiln.quant.select import Selector, measure_sensitivity

    formats = _formats(args)
    names = [s.name for s in ref.shapes()]
    quantized = [f for f in formats if f != DENSE]
    with _progress(console, "sensitivity (each layer alone)", len(names) * len(quantized)) as tick:
        probe = KLProbe(ref.model, calib[:args.sensitivity_windows])
        known = (json.loads(args.sensitivity_from.read_text()).get("sensitivity")
                 if args.sensitivity_from else None)
        sens = measure_sensitivity(probe, weights, names, formats, lambda *_: tick(), known)
    del probe
    console.print(sensitivity_table(sens.kl, "most sensitive layers (calibration)", top=12))
    args.out.mkdir(parents=True, exist_ok=True)
    plot_sensitivity(sens.kl, args.out / "sensitivity.png", "per-layer sensitivity")
    probe = KLProbe(ref.model, calib)
    with _progress(console, "searching layer combinations", args.max_evals) as tick:
        selector = Selector(probe, weights, cost, sens, formats,
                            on_evaluated=lambda _s: tick(selector.evaluations))
        budget = bits_budget(args.bits_budget, cost)
        best = (selector.plan_for_kl(args.kl_budget, args.max_evals) if args.kl_budget
                is not None else selector.search(budget, args.max_evals))
    if args.kl_budget is not None:
        budget = best.bits
    plans = {"mixed (searched)": best.plan,
             "keep most sensitive dense": selector.keep_sensitive_dense(budget)}
    uniform = selector.best_uniform(budget)
    if uniform is not None:
        plans[f"uniform {next(iter(uniform.values()))}"] = uniform
    report.update(formats=formats, bits_budget=budget, kl_budget=args.kl_budget,
                  evaluations=selector.evaluations, calibration_fidelity=best.fidelity,
                  sensitivity=sens.kl, plans=plans)
    del probe
    return best.plan, plans


def _write(src, out: Path, plan, scheme: str, cost, quantizer, console, **extra) -> None:
    from safetensors import safe_open

    from kiln.models.loader import weight_files
    from kiln.quant.checkpoint import write_checkpoint
    from kiln.quant.report import plan_summary

    total = sum(len(safe_open(str(f), "pt").keys()) for f in weight_files(Path(src)))
    with _progress(console, f"writing {out}", total) as tick:
        write_checkpoint(src, out, plan, scheme, quantizer, on_tensor=lambda _n: tick(),
                         bits_per_weight=round(cost.bits(plan), 4),
                         layer_counts=plan_summary(plan), **extra)


def _held_out_report(args, ref, cost, weights, plans, console, report: dict) -> None:
    from kiln.quant.evaluate import KLProbe
    from kiln.quant.pipeline import scheme_rows
    from kiln.quant.report import fidelity_table, plot_tradeoff

    windows = ref.windows(TextSpec(args.windows, args.window_tokens, args.text), Split.HELDOUT)
    with _progress(console, "held-out fidelity", len(plans)) as tick:
        probe = KLProbe(ref.model, windows, reuse_blocks=False)
        rows = scheme_rows(probe, weights, cost, plans, lambda _r: tick())
    console.print(fidelity_table(rows, f"held-out text, {probe.tokens} positions"))
    report["held_out"] = rows
    if len(rows) > 1:
        plot_tradeoff(rows, args.out / "tradeoff.png", "schemes at the same budget (held-out)")


# -- kiln quantize eval ----------------------------------------------------------------------

def run_eval(args: argparse.Namespace) -> int:
    import torch

    from kiln.models.loader import load_model
    from kiln.quant.evaluate import KLProbe
    from kiln.quant.pipeline import Reference, checkpoint_plan
    from kiln.quant.report import (
        SchemeRow,
        fidelity_table,
        write_json,
    )
    from kiln.quant.select import PlanCost
    from kiln.runner.attention import get_attention_backend

    _set_threads(args.threads)
    console = _console()
    dtype = getattr(torch, args.dtype)
    out = args.out or Path(f"quant-eval-{Path(args.model).name}")
    out.mkdir(parents=True, exist_ok=True)
    with console.status("loading both models"):
        ref = Reference(args.ref, dtype)
        model = load_model(args.model, dtype, get_attention_backend("torch")).model
    windows = ref.windows(TextSpec(args.windows, args.window_tokens, args.text), Split.HELDOUT)
    start = time.perf_counter()
    with console.status(f"teacher forcing {windows.numel()} tokens through both"):
        probe = KLProbe(ref.model, windows, reuse_blocks=False)
        fidelity = probe.measure_model(model)
    plan = checkpoint_plan(args.model)
    cost = PlanCost(ref.shapes(), ref.dense_bits())
    known = plan and set(plan) >= set(cost.layers)
    row = SchemeRow(Path(args.model).name, cost.bits(plan) if known else float("nan"),
                    cost.bytes(plan) if known else 0, fidelity)
    console.print(fidelity_table([row], f"held-out text, {probe.tokens} positions "
                                        f"({time.perf_counter() - start:.0f} s)"))
    report = {"model": args.model, "ref": args.ref, "dtype": args.dtype, "fidelity": fidelity,
              "bits_per_weight": row.bits_per_weight}
    del probe
    if not args.no_sensitivity:
        report["sensitivity"] = _eval_sensitivity(args, ref, model, windows, console, out)
    write_json(out / REPORT_FILE, report)
    console.print(f"report: {out / REPORT_FILE}")
    return 0


def _eval_sensitivity(args, ref, model, windows, console, out: Path) -> dict[str, float]:
    from kiln.models.layers.linear import Linear
    from kiln.quant.evaluate import KLProbe
    from kiln.quant.pipeline import layer_sensitivity_of_model
    from kiln.quant.report import plot_sensitivity, sensitivity_table

    count = sum(1 for m in model.modules()
                if isinstance(m, Linear) and hasattr(m.method, "dequantize_weight"))
    with _progress(console, "per-layer sensitivity", count) as tick:
        probe = KLProbe(ref.model, windows[:args.sensitivity_windows])
        kl = layer_sensitivity_of_model(probe, model, lambda _n: tick())
    table = {name: {"as stored": value} for name, value in kl.items()}
    console.print(sensitivity_table(table, "most sensitive layers (each alone)", top=15))
    if kl:
        plot_sensitivity(table, out / "sensitivity.png",
                         f"{Path(args.model).name}: each layer alone vs {Path(args.ref).name}")
    return kl


# -- helpers ---------------------------------------------------------------------------------

def _formats(args) -> list[str]:
    return [f.strip() for f in args.formats.split(",") if f.strip()]


def _console():
    import sys

    from rich.console import Console

    return Console(width=None if sys.stdout.isatty() else 120)  # logs: full tables


def _set_threads(threads: int | None) -> None:
    import torch

    from kiln.config import default_num_threads

    torch.set_num_threads(threads or default_num_threads())


@contextmanager
def _progress(console, description: str, total: int) -> Iterator[Callable[..., None]]:
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TimeRemainingColumn())
    with Progress(*columns, console=console) as progress:
        task = progress.add_task(description, total=total)

        def tick(done: int | None = None) -> None:
            if done is None:
                progress.advance(task)
            else:
                progress.update(task, completed=min(done, total))

        yield tick
