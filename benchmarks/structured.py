"""Structured output on the default model: the per-token cost of grammar-constrained decoding,
and grammar compile time for a large tool set.

  python benchmarks/structured.py [--reps 5] [--tokens 48] [--batches 1 16] [--no-compile]
      [--out results.json]

TPOT: the same chat prompts decode unconstrained and under a JSON schema (an order with a
list of line items: strings, integers, enums, nested objects), at batch 1 and 16 (`--batches`).
Both run greedy with ignore_eos and the repetition guard off, so the constrained runs stop
only when the grammar ends. The figure is the median wall time of decode steps in which every
sequence of the batch was decoding (one token each): prefill steps and the tail where some
sequences already finished are excluded. The two configurations alternate within every
repetition (back to back, order flipped each time); the overhead is the median over
repetitions of the paired ratio, the TPOTs the medians: the machine is shared and noisy.
Because a difference of two noisy step times is itself noisy, the time spent in the structured
code of each constrained step (bitmask fill and application, grammar and guard advance) is
also measured directly (median over all constrained full-batch steps) and reported as a share
of the unconstrained TPOT.

Compile: 50 distinct tools (each with 6 parameters: strings, bounded integers, enums, arrays,
a nested object with anyOf) as the grammars kiln builds for tool_choice=required and auto:
the engine's compile (token masks precomputed) and the gateway's check (grammar only, lazy
masks), cold (a fresh compiler, median of --reps) and cached (the same spec again), plus the
time to fill the first token mask (a lazy grammar computes it then).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.config import StructuredConfig
from kiln.engine.core import EngineRequest
from kiln.sampling_params import RepetitionGuardParams, StructuredOutputsParams
from kiln.structured.compiler import GrammarCompiler
from kiln.structured.gateway import make_tool
from kiln.structured.grammar_spec import GrammarSpec
from kiln.structured.tools import FORMATS, call_grammar
from kiln.structured.vocab import tokenizer_info

ORDER = {"type": "object", "properties": {
    "customer": {"type": "string"},
    "priority": {"enum": ["low", "normal", "high"]},
    "items": {"type": "array", "items": {"type": "object", "properties": {
        "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1, "maximum": 999},
        "note": {"type": "string"}}, "required": ["sku", "qty"]}},
    "address": {"type": "object", "properties": {"city": {"type": "string"},
                                                 "zip": {"type": "string"}}}},
    "required": ["customer", "items"]}
QUESTIONS = ["Write an order for office supplies.", "List what a bakery orders each week.",
             "Order parts for a bicycle repair.", "An order for a school science lab.",
             "Groceries for a family of four.", "A hardware store restock order.",
             "Camping gear for a weekend trip.", "Supplies for a small cafe.",
             "An order of books for a library.", "Garden tools and seeds for spring.",
             "Computer parts for a new workstation.", "Art supplies for a painting class.",
             "Cleaning products for an office.", "Kitchen equipment for a restaurant.",
             "Sports equipment for a football team.", "Party supplies for a birthday."]


def chat_prompts(llm: LLM, n: int) -> list[list[int]]:
    """`n` distinct prompts: the questions, then again with a variant number (before, batch
    64 ran only the 16 questions: the batch-64 figure was batch 16's)."""
    questions = [QUESTIONS[i % len(QUESTIONS)] + (f" Variant {i // len(QUESTIONS)}."
                                                  if i >= len(QUESTIONS) else "")
                 for i in range(n)]
    return [llm.apply_chat_template([{"role": "user", "content": q}]) for q in questions]


def step_times(llm: LLM, prompts: list[list[int]], tokens: int, constrained: bool,
               timer: StructuredTimer | None = None) -> tuple[list[float], list[float]]:
    """Wall time of each decode step in which all sequences decoded one token, and of the
    structured work within it."""
    engine = llm.engine
    structured = StructuredOutputsParams(json=ORDER) if constrained else None
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=structured,
                            repetition_guard=RepetitionGuardParams(mode="off"))
    for i, ids in enumerate(prompts):
        engine.add_request(EngineRequest(request_id=f"b{time.monotonic_ns()}-{i}",
                                         prompt_token_ids=ids, params=params))
    times, structured = [], []
    while engine.has_unfinished():
        before = timer.seconds if timer else 0.0
        started = time.perf_counter()
        outs = engine.step()
        elapsed = time.perf_counter() - started
        decoding = [o for o in outs if len(o.new_token_ids) == 1 and o.finish_reason is None]
        if len(decoding) == len(prompts) and engine.scheduler.num_waiting == 0:
            times.append(elapsed)
            structured.append((timer.seconds if timer else 0.0) - before)
    return times, structured


class StructuredTimer:
    """Wall time spent in kiln.structured's per-step work (filling the batch bitmask,
    applying it to the logits or, greedy, finding the masked argmax without it
    (kiln.runner.grammar_argmax), advancing grammars and the guard), summed: the cost that
    constrained decoding adds to a step, measured directly rather than as a difference of
    two noisy step times."""

    def __init__(self):
        import kiln.runner.sampler as sampler
        import kiln.structured.bitmask as bitmask
        import kiln.structured.hooks as engine
        self.seconds = 0.0
        self._patches = [(bitmask.GrammarRows, "fill"), (sampler, "apply_token_bitmask"),
                         (sampler, "forbidden_argmax"), (sampler, "allowed_argmax"),
                         (engine.StructuredHooks, "check_token")]
        for owner, name in self._patches:
            setattr(owner, name, self._timed(getattr(owner, name)))

    def _timed(self, fn):
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - started
        return timed


def tpot(llm: LLM, batch: int, tokens: int, reps: int, timer: StructuredTimer) -> dict:
    prompts = chat_prompts(llm, batch)
    for constrained in (False, True):  # warm-up: grammar compiled and cached, kernels warm
        step_times(llm, prompts, 8, constrained, timer)
    runs = {"off": [], "json": []}
    added: list[float] = []
    for rep in range(reps):
        order = (False, True) if rep % 2 == 0 else (True, False)
        for constrained in order:
            times, structured = step_times(llm, prompts, tokens, constrained, timer)
            if constrained:
                added += structured
            runs["json" if constrained else "off"].append(statistics.median(times))
    off, on = statistics.median(runs["off"]), statistics.median(runs["json"])
    ratios = [b / a for a, b in zip(runs["off"], runs["json"], strict=True)]  # paired per rep
    work = statistics.median(added)
    return {"batch": batch, "tpot_ms_unconstrained": off * 1e3,
            "tpot_ms_constrained": on * 1e3,
            "overhead_pct": (statistics.median(ratios) - 1) * 100,
            "structured_ms_per_step": work * 1e3, "structured_pct_of_tpot": work / off * 100,
            "reps": reps, "steps": len(added)}


def fifty_tools() -> list:
    tools = []
    for i in range(50):
        params = {"type": "object", "properties": {
            "query": {"type": "string", "description": f"what tool {i} looks for"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 100},
            "mode": {"enum": ["fast", "exact", "auto"]},
            "flags": {"type": "array", "items": {"type": "boolean"}},
            "filter": {"type": "object", "properties": {
                "field": {"type": "string"},
                "value": {"anyOf": [{"type": "string"}, {"type": "number"}]}},
                "required": ["field"]},
            "lang": {"type": "string", "maxLength": 8}},
            "required": ["query"]}
        tools.append(make_tool(f"tool_{i:02d}", f"Tool number {i}", params))
    return tools


def _compile_once(info, spec: GrammarSpec, lazy: bool, vocab: int) -> tuple[float, float,
                                                                          float, object]:
    """(cold compile s, cached compile s, first mask s, compiled) with a fresh compiler."""
    import xgrammar as xgr
    compiler = GrammarCompiler(lambda: info, StructuredConfig(compile_timeout_s=600),
                               lazy_masks=lazy)
    started = time.perf_counter()
    compiled = compiler.compile(spec)
    cold = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile(spec)
    cached = time.perf_counter() - started
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    started = time.perf_counter()
    xgr.GrammarMatcher(compiled).fill_next_token_bitmask(bitmask)
    first_mask = time.perf_counter() - started
    compiler.shutdown()
    return cold, cached, first_mask, compiled


def compile_times(llm: LLM, reps: int) -> dict:
    """Engine compiles (masks precomputed) and gateway checks (lazy masks), interleaved."""
    info = tokenizer_info(llm.get_tokenizer(), llm.engine.vocab_size)
    tools = fifty_tools()
    out = {}
    for choice in ("required", "auto"):
        spec = GrammarSpec("structural_tag", call_grammar(tools, FORMATS["hermes"], choice))
        runs = {True: [], False: []}
        for _ in range(reps):
            for lazy in (False, True):
                runs[lazy].append(_compile_once(info, spec, lazy, llm.engine.vocab_size))
        for lazy, name in ((False, "engine"), (True, "gateway_check")):
            cold, cached, first, compiled = zip(*runs[lazy], strict=True)
            out[f"{choice}/{name}"] = {
                "cold_ms": statistics.median(cold) * 1e3,
                "cached_us": statistics.median(cached) * 1e6,
                "first_mask_ms": statistics.median(first) * 1e3,
                "grammar_kib": compiled[0].memory_size_bytes / 1024,
                "spec_kib": spec.size / 1024}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default=None)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--no-compile", action="store_true", help="skip the 50-tool compile")
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, max_num_seqs=max(args.batches))
    timer = StructuredTimer()
    results = {"tpot": [tpot(llm, b, args.tokens, args.reps, timer) for b in args.batches]}
    if not args.no_compile:
        results["compile_50_tools"] = compile_times(llm, args.reps)
    print(json.dumps(results, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
