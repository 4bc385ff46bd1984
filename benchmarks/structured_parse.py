"""Issue 51's benchmark: the share of constrained responses that parse and validate.

A generator makes >= 50 (Pydantic model, prompt) pairs from everyday topics, each with a mix of
numbers, nested objects, lists, enums, optional fields and long strings; every pair runs with
its schema as `structured_outputs` (offline `LLM`, the default model) at temperature 0 and at
0.7 with three seeds. Prints per setting: validated / total, finish reasons, mean tokens per
response.

    python benchmarks/structured_parse.py [--pairs 56] [--max-tokens 256] [--json out.json]
    VLLM_CPU_KVCACHE_SPACE=1 /path/to/vllm-venv/bin/python benchmarks/structured_parse.py \
        --engine vllm --model ~/.cache/kiln/models/SmolLM2-135M-Instruct  # the same pairs
"""

from __future__ import annotations

import argparse
import enum
import json
import time
from collections import Counter

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


def validates(model: type[BaseModel], text: str) -> bool:
    try:
        model.model_validate_json(text)
        return True
    except ValidationError:
        return False


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
    good = [validates(m, r.text) for (m, _), r in zip(pairs, results, strict=True)]
    ok = sum(good)
    for (m, _), r, g in zip(pairs, results, good, strict=True):
        if not g and SHOW_FAILURES:
            print(f"FAILED {m.__name__} {r.finish_reason}: {r.text[:400]!r}", flush=True)
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
    ap.add_argument("--show-failures", action="store_true", help="print what did not validate")
    args = ap.parse_args()
    global SHOW_FAILURES, ENGINE
    SHOW_FAILURES, ENGINE = args.show_failures, args.engine
    if ENGINE == "vllm":  # the same default model's directory, vLLM's defaults otherwise
        from vllm import LLM as VLLM
        llm = VLLM(args.model, dtype="bfloat16", max_model_len=2048, seed=0)
    else:
        from kiln import LLM
        llm = LLM(args.model)
    pairs = make_pairs(args.pairs)
    rows = [run(llm, pairs, 0.0, None, args.max_tokens)]
    if not args.greedy_only:
        rows += [run(llm, pairs, 0.7, seed, args.max_tokens) for seed in (1, 2, 3)]
    for r in rows:
        print(json.dumps(r), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
