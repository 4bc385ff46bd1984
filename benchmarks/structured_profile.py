"""The Python work of structured output per decode step, counted: cProfile over constrained
decode steps at one batch size on the default model, reporting each kiln.structured function's
calls per step (and, on a quiet machine, its time per step).

  python benchmarks/structured_profile.py [--batch 64] [--tokens 48] [--threads N]
      [--guard stop|off] [--top 30]

Call counts do not depend on the machine's load, so they are the figure to compare between
two trees on a shared machine; the times are only meaningful on a quiet one. The requests are
benchmarks/structured.py's (the order schema, greedy, ignore_eos), except that the repetition
guard runs (`--guard stop`, the default): with it the JSON limits follow every token.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from structured import ORDER, chat_prompts
from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.engine.core import EngineRequest
from kiln.sampling_params import RepetitionGuardParams, StructuredOutputsParams

WATCHED = ("kiln/structured/", "runner/sampler.py", "runner/grammar_argmax.py")


def run_batch(llm: LLM, prompts: list[list[int]], tokens: int, guard: str) -> int:
    """Decode the prompts to the end under the order schema; the number of steps."""
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True,
                            structured_outputs=StructuredOutputsParams(json=ORDER),
                            repetition_guard=RepetitionGuardParams(mode=guard))
    for i, ids in enumerate(prompts):
        llm.engine.add_request(EngineRequest(request_id=f"p{time.monotonic_ns()}-{i}",
                                             prompt_token_ids=ids, params=params))
    steps = 0
    while llm.engine.has_unfinished():
        llm.engine.step()
        steps += 1
    return steps


def watched_rows(stats: pstats.Stats, steps: int, top: int) -> list[tuple]:
    rows = []
    for (path, line, name), (_, calls, tottime, cumtime, _) in stats.stats.items():
        if any(w in path for w in WATCHED):
            short = path.split("kiln/")[-1]
            rows.append((calls / steps, tottime / steps * 1e3, cumtime / steps * 1e3,
                         f"{short}:{line}({name})"))
    return sorted(rows, key=lambda r: -r[2])[:top]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--guard", choices=["stop", "off"], default="stop")
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args()
    llm = LLM(num_threads=args.threads, max_num_seqs=args.batch)
    prompts = chat_prompts(llm, args.batch)
    run_batch(llm, prompts, 4, args.guard)  # warm-up: the grammar compiled and cached
    profiler = cProfile.Profile()
    profiler.enable()
    steps = run_batch(llm, prompts, args.tokens, args.guard)
    profiler.disable()
    stats = pstats.Stats(profiler)
    print(f"batch {args.batch}, {steps} steps, guard {args.guard}; per step:")
    print(f"{'calls':>9} {'own ms':>8} {'cum ms':>8}  function")
    for calls, own, cum, where in watched_rows(stats, steps, args.top):
        print(f"{calls:9.1f} {own:8.3f} {cum:8.3f}  {where}")


if __name__ == "__main__":
    main()
