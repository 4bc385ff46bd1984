"""How often a shipped head agrees with the target on pages it never saw, and whether the
engine keeps that acceptance.

  python benchmarks/experiments/head_agreement.py [--domain prose] [--prompts 16] [--out results.json]

`kiln train-speculator` reports agreement on held-out *sequences*: a tenth of its training
windows, drawn from the same pages as the rest. This measures the head on the benchmark's
prompts instead (`benchmarks/speculative.py`: held-out pages, never trained on) and, for
comparison, on fresh windows of training pages: each prompt is continued greedily by the
target, the target's features are recorded over it, and the head runs in fp32 through the
training code's unrolled chain (`kiln.speculative.training.train.unroll`), so the figures are the model's,
not the engine's. Reported over the continuation and per `--bucket` positions of it,
per draft step j = 1..k: agreement with the target's greedy token
at the continuation's positions; drafts accepted per verify step if every position verified
(the chain's mean); and walked as the engine verifies (the next verify step after the
accepted drafts plus the bonus token, so hard stretches get more verify steps than easy
ones). Then the engine itself (bf16, the head's int8 weights, k drafts forced) continues the
same prompts: its accepted drafts per verify step should match the walk. It does so twice:
the head alone in chains (what the walk measures), then with a head's defaults (lookup's
drafts joined, trees at batch 1: `SpeculativeConfig.resolved`).
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.bench.result import cpu_summary
from kiln.config import CacheConfig, ModelConfig, ParallelConfig
from kiln.config_speculative import SpeculativeConfig
from kiln.models.layers.rotary import RotaryEmbedding
from kiln.runner.model_runner import ModelRunner
from kiln.speculative.head.model import lm_head_rows, load_head
from kiln.speculative.resolve import speculator_path
from kiln.speculative.training import data
from kiln.speculative.training.train import unroll


def agreement(runner, head, sequences: list[list[int]], prompt_tokens: int, steps: int,
              bucket: int) -> dict:
    """The head's agreement with the target over the continuations (positions >= the
    prompt's end), per draft step, and drafts accepted per verify step (all positions, and
    walked as the engine verifies); the same per `bucket` positions of the continuation
    (greedy continuations repeat themselves more the longer they run)."""
    chunks = torch.tensor(sequences)
    rec = data.record_target(runner, chunks, head.c.feature_layers)
    c = head.c
    rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta,
                             c.rope_scaling, torch.float32)
    embed = runner.model.model.embed_tokens.weight.detach().float()
    lm_rows = lm_head_rows(runner.model, head.draft_vocab).detach().float()
    b, size = chunks.shape
    n = size - steps
    hits = []
    with torch.no_grad():
        for j, (_, logits) in enumerate(unroll(head, rec.features, rec.tokens, steps, embed,
                                               lm_rows, rotary.cos, rotary.sin), start=1):
            guess = head.draft_vocab[logits.argmax(-1)].view(b, n)
            hits.append(guess == rec.labels[:, j:j + n])
    hits = torch.stack(hits, -1)  # [b, n, steps]: draft j at position p right
    chain = hits.int().cumprod(-1).sum(-1)  # drafts accepted verifying at p
    walked = []  # (position, drafts accepted) of each verify step
    for row in range(b):
        p = prompt_tokens - 1
        while p < n:
            walked.append((p, int(chain[row, p])))
            p += walked[-1][1] + 1

    def summary(start: int, end: int) -> dict:
        here = [a for p, a in walked if start <= p < end]
        return {"agreement": [round(float(hits[:, start:end, j].float().mean()), 3)
                              for j in range(steps)],
                "accepted_all_positions": round(float(chain[:, start:end].float().mean()), 3),
                "accepted_walked": round(sum(here) / len(here), 3) if here else None}

    first = prompt_tokens - 1  # verifying there drafts the continuation's second token on
    out = summary(first, n)
    out["by_position"] = {f"{s - first}-{min(s + bucket, n) - first - 1}": summary(s, s + bucket)
                          for s in range(first, n, bucket)}
    return out


def engine_acceptance(llm: LLM, prompts: list[list[int]], max_tokens: int) -> float:
    stats = llm.engine.speculator.stats
    accepted, steps = stats.num_accepted_tokens, stats.num_verify_steps
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for p in prompts:  # one at a time: batch 1, as the batch-1 benchmark
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)
    return round((stats.num_accepted_tokens - accepted) / (stats.num_verify_steps - steps), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", choices=["code", "prose"], default="prose")
    parser.add_argument("--head", help="speculator (default: the domain's preset)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("-k", type=int, default=3, help="draft steps")
    parser.add_argument("--bucket", type=int, default=48,
                        help="also report per this many continuation positions")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="head-agreement.json")
    args = parser.parse_args()
    path = speculator_path(args.head or f"{args.domain}-head")
    llm = LLM(max_model_len=1024, num_threads=args.threads)
    tok = llm.get_tokenizer()
    make = data.code_prompts if args.domain == "code" else data.prose_prompts
    sets = {"held-out pages": make(tok, args.prompts, args.prompt_tokens),
            "training pages": data.continuation_prompts(
                data.tokenize_documents(tok, data.domain_corpus(args.domain, "train")),
                args.prompts, args.prompt_tokens, seed=7)}
    model_path = str(llm.engine.model_path)
    runner = ModelRunner(ModelConfig(model=model_path), model_path, CacheConfig(),
                         ParallelConfig(args.threads), frozenset())
    head = load_head(path, torch.float32)
    result = {"args": vars(args), "cpu": cpu_summary(), "prose": data.prose_source(),
              "head": str(path), "sets": {}}
    for name, prompts in sets.items():
        sequences = data.generate_answers(llm, prompts, args.max_tokens, ignore_eos=True,
                                          show_progress=False)
        result["sets"][name] = agreement(runner, head, sequences, args.prompt_tokens, args.k,
                                             args.bucket)
    del runner
    # the head alone in chains, as the walk above verifies; then with its own defaults
    # (lookup joined, draft trees at batch 1: SpeculativeConfig.resolved), still k forced
    shapes = {"engine_accepted": SpeculativeConfig(adaptive=False, ngram_first=False,
                                                   tree_width=1, num_speculative_tokens=args.k),
              "engine_accepted_defaults": SpeculativeConfig(adaptive=False,
                                                            num_speculative_tokens=args.k)}
    for key, config in shapes.items():
        spec = LLM(max_model_len=1024, num_threads=args.threads, speculator=str(path),
                   speculative_config=config)
        for name, prompts in sets.items():
            result["sets"][name][key] = engine_acceptance(spec, prompts, args.max_tokens)
        del spec
    for name, r in result["sets"].items():
        print(f"{name}: engine {r['engine_accepted']} accepted per verify step (k = {args.k} "
              f"forced; {r['engine_accepted_defaults']} with the head's defaults: lookup "
              f"joined, trees)")
        for label, part in (("all", r), *r["by_position"].items()):
            print(f"  continuation {label:8s} agreement per draft step {part['agreement']}, "
                  f"accepted per verify step {part['accepted_walked']} (walked), "
                  f"{part['accepted_all_positions']} (every position)")
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
