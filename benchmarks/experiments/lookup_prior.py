"""Does a prompt say how often lookup's drafts will be accepted on the request's output?

  python benchmarks/experiments/lookup_prior.py [--max-tokens 48] [--out results.json]

A request's own record in adaptive speculation starts from the estimate over all traffic
(`AdaptiveK.request_prior`), so a prose request arriving after code traffic starts from
code's acceptance. Its prompt is text it brings along: lookup replayed over the prompt (at
each position, the drafts lookup would have proposed from the tokens before it, against the
tokens that follow) would be a prior of its own, free of other traffic. This measures whether
it predicts what matters, lookup's acceptance on the output: the benchmark's prompts
(`benchmarks/speculative.py`'s, 16 per domain) are continued greedily by the default model,
and per request the replay over the prompt's positions is compared with the replay over its
output's (greedy decoding accepts exactly the drafts that match the output, so the latter is
lookup's acceptance per matched position with k drafts).
"""

from __future__ import annotations

import argparse
import json
import statistics

from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.bench.result import cpu_summary
from kiln.speculative.ngram import TokenIndex
from kiln.speculative.training.data import code_prompts, prose_prompts, prose_source


def replay(tokens: list[int], start: int, k: int, n_min: int, n_max: int) -> list[int]:
    """Per position t >= start with k tokens after it where lookup matches the suffix of
    tokens[:t]: how many of its k drafts tokens[t:t + k] bear out."""
    out, index = [], TokenIndex()
    for t in range(max(start, 1), len(tokens) - k + 1):
        draft, n = index.update(tokens[:t]).match(k, n_min, n_max)
        if n:
            good = 0
            while good < len(draft) and draft[good] == tokens[t + good]:
                good += 1
            out.append(good)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("-k", type=int, default=3, help="drafts per lookup")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="lookup-prior.json")
    args = parser.parse_args()
    llm = LLM(max_model_len=1024, kv_cache_memory=96 << 20, max_num_seqs=8,
              num_threads=args.threads)
    tok = llm.get_tokenizer()
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    result = {"args": vars(args), "cpu": cpu_summary(), "prose": prose_source(), "domains": {}}
    for domain, make in (("code", code_prompts), ("prose", prose_prompts)):
        prompts = make(tok, 16, args.prompt_tokens)
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params,
                               use_tqdm=False)
        rows = []
        for prompt, output in zip(prompts, outputs, strict=True):
            text = prompt + list(output.outputs[0].token_ids)
            before = replay(prompt, 1, args.k, 1, 4)
            after = replay(text, len(prompt), args.k, 1, 4)
            rows.append({"prompt": statistics.mean(before) if before else None,
                         "prompt_matched": len(before),
                         "output": statistics.mean(after) if after else None,
                         "output_matched": len(after)})
        both = [r for r in rows if r["prompt"] is not None and r["output"] is not None]
        summary = {"prompt_mean": statistics.mean(r["prompt"] for r in both),
                   "output_mean": statistics.mean(r["output"] for r in both),
                   "correlation": statistics.correlation([r["prompt"] for r in both],
                                                         [r["output"] for r in both])}
        result["domains"][domain] = {"requests": rows, **summary}
        print(f"{domain}: accepted drafts per matched position (of {args.k}): replayed over "
              f"the prompts {summary['prompt_mean']:.2f}, over the outputs "
              f"{summary['output_mean']:.2f}; correlation over requests "
              f"{summary['correlation']:.2f}")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
