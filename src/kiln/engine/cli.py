"""`kiln generate`: one generation with the offline engine (a demo and a smoke test)."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate text offline (no server)")
    p.add_argument("--model", default=None, help="HF model dir (default: the bundled model)")
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--raw", action="store_true", help="send the prompt without the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", default=None, help="quantize weights on load (e.g. int8)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln import LLM, SamplingParams

    llm = LLM(args.model, dtype=args.dtype, quantization=args.quantization)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    start = time.perf_counter()
    if args.raw:
        out = llm.generate([args.prompt], params, use_tqdm=False)[0]
    else:
        out = llm.chat([{"role": "user", "content": args.prompt}], params, use_tqdm=False)[0]
    elapsed = time.perf_counter() - start
    completion = out.outputs[0]
    print(completion.text)
    print(f"-- {len(completion.token_ids)} tokens in {elapsed:.2f} s "
          f"({len(completion.token_ids) / elapsed:.1f} tok/s), finish: {completion.finish_reason}")
    return 0
