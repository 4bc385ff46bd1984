"""How many drafts each speculator would get accepted, position by position, on the same text.

  python benchmarks/experiments/spec_positions.py [--heads code-head prose-head] [--new-tokens 52]
      [--out benchmarks/results/spec_positions.json]

The default model continues the speculative benchmark's held-out prompts greedily (EOS
ignored); then, at every position p of each continuation, with the tokens up to p + 1 known
(the state after a verify step), this asks each speculator for 3 drafts and counts how many
leading drafts equal the target's next tokens: the accepted length a verify step there would
get. The head runs exactly as it was trained (unrolled, each draft step fed the true previous
token, which is what verification sees while drafts are right); the n-gram proposer is kiln's
own. It also reports "n-gram where it matches, else the head" (what `ngram_first` does) and
the best of the two per position: an upper bound for any choice between them; "the head
over a match where it expects more than t" (its own probabilities' p1 + p1 p2 + p1 p2 p3: a
rule the engine could apply if the head drafted at every step) and "lookup only from a
match of m tokens, else the head" (the cut ngram_first's routing by match length learns);
each also per
verify step (a walk through the continuation where a step accepting a drafts moves a + 1
positions on: positions inside accepted runs are never drafted from); and both
speculators' figures by the length of the n-gram match (0 = none). Unlike the
speed benchmark this measures nothing but the speculators, so it is deterministic.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from kiln import LLM, SamplingParams
from kiln.config import CacheConfig, ModelConfig, ParallelConfig
from kiln.engine.core import resolve_model_path
from kiln.runner.model_runner import ModelRunner
from kiln.speculative.head.model import lm_head_rows, load_head
from kiln.speculative.ngram import propose_ngram
from kiln.speculative.resolve import speculator_path
from kiln.speculative.training.data import TargetRecord, prose_source, record_target
from kiln.speculative.training.train import unroll

K = 3
CONFIDENT = (1.0, 1.5, 2.0, 2.5)


def continuations(domain: str, new_tokens: int, prompt_tokens: int) -> torch.Tensor:
    from kiln.speculative.training.data import code_prompts, prose_prompts

    llm = LLM(max_model_len=1024, num_threads=2)
    pick = code_prompts if domain == "code" else prose_prompts
    prompts = pick(llm.get_tokenizer(), 8, prompt_tokens)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                        SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True),
                        use_tqdm=False)
    return torch.tensor([p + o.outputs[0].token_ids for p, o in zip(prompts, outs, strict=True)])


@torch.no_grad()
def head_drafts(runner, head_dir, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[b, S - K, K]: the head's K drafts after each position (teacher-forced chain), and
    [b, S - K] the accepted length it expects there by its own probabilities
    (p1 + p1 p2 + p1 p2 p3 of its drafts)."""
    from kiln.models.layers.rotary import RotaryEmbedding

    head = load_head(head_dir, torch.float32)
    c = head.c
    record: TargetRecord = record_target(runner, tokens, c.feature_layers)
    embed = runner.model.model.embed_tokens.weight.float()
    rows = lm_head_rows(runner.model, head.draft_vocab).float()
    rotary = RotaryEmbedding(c.head_dim, c.max_position_embeddings, c.rope_theta,
                             c.rope_scaling, torch.float32)
    b, seq = tokens.shape
    drafts, expected, chain = [], torch.zeros(b, seq - K), torch.ones(b, seq - K)
    for _, logits in unroll(head, record.features, tokens, K, embed, rows, rotary.cos,
                            rotary.sin):
        prob, choice = logits.float().softmax(-1).max(-1)
        drafts.append(head.draft_vocab[choice].view(b, seq - K))
        chain = chain * prob.view(b, seq - K)
        expected += chain
    return torch.stack(drafts, dim=-1), expected


def accepted(drafts: list[int], truth: list[int]) -> int:
    n = 0
    while n < len(drafts) and n < len(truth) and drafts[n] == truth[n]:
        n += 1
    return n


def match_length(seq: list[int], n_max: int = 4) -> int:
    """The longest suffix (up to n_max tokens) with an earlier occurrence: 0 = no match."""
    tokens = np.asarray(seq)
    return next((n for n in range(n_max, 0, -1) if propose_ngram(tokens, K, n, n)), 0)


def per_step(accepted: np.ndarray, bounds: list[tuple[int, int]]) -> float:
    """Mean accepted drafts over the verify steps of a walk through each sequence's
    positions [start, end) where every step drafts."""
    steps = []
    for start, end in bounds:
        p = start
        while p < end:
            steps.append(accepted[p])
            p += int(accepted[p]) + 1
    return float(np.mean(steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--heads", nargs="+", default=["code-head", "prose-head"])
    parser.add_argument("--new-tokens", type=int, default=52)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--out", default="spec-positions.json")
    args = parser.parse_args()
    path = resolve_model_path(None)
    runner = ModelRunner(ModelConfig(model=path, dtype="auto"), path, CacheConfig(),
                         ParallelConfig(2), frozenset())
    rows = []
    for domain in ("code", "prose"):
        tokens = continuations(domain, args.new_tokens, args.prompt_tokens)
        for name in args.heads:
            heads, expect = head_drafts(runner, speculator_path(name), tokens)
            per, starts = [], []  # (head, ngram, matched, match length, head expects)
            for i, seq in enumerate(tokens.tolist()):
                starts.append(len(per))
                for p in range(args.prompt_tokens - 1, len(seq) - K - 1):
                    truth = seq[p + 2:p + 2 + K]
                    lookup = propose_ngram(np.asarray(seq[:p + 2]), K, 1, 4)
                    per.append((accepted(heads[i, p].tolist(), truth), accepted(lookup, truth),
                                bool(lookup), match_length(seq[:p + 2]),
                                float(expect[i, p])))
            r = np.array(per)
            choices = {"head_alone": r[:, 0], "ngram": r[:, 1],
                       "ngram_first": np.where(r[:, 2], r[:, 1], r[:, 0]),
                       "best_of_both": r[:, :2].max(1)}
            for m in (2, 3, 4):  # lookup only from a match of m tokens: what ngram_first's
                # routing by match length (adaptive) can reach with one fixed cut
                choices[f"ngram_from_length>={m}"] = np.where(r[:, 3] >= m, r[:, 1], r[:, 0])
            for t in CONFIDENT:  # the head over a match where it expects more than t
                choices[f"head_if_expects>{t}"] = np.where((r[:, 2] > 0) & (r[:, 4] <= t),
                                                           r[:, 1], r[:, 0])
            bounds = list(zip(starts, [*starts[1:], len(r)], strict=True))
            row = {"domain": domain, "head": name, "positions": len(r),
                   # accepted per verify step: walking each continuation as the engine
                   # does (a step at p accepting a drafts makes the next step p + a + 1)
                   "per_step": {k: round(per_step(v, bounds), 3) for k, v in choices.items()},
                   "head_alone": round(float(r[:, 0].mean()), 3),
                   "ngram": round(float(r[:, 1].mean()), 3),
                   "ngram_first": round(float(np.where(r[:, 2], r[:, 1], r[:, 0]).mean()), 3),
                   "best_of_both": round(float(r[:, :2].max(1).mean()), 3),
                   "ngram_matches": round(float(r[:, 2].mean()), 3),
                   # match length -> [positions, head alone, n-gram]: mean accepted there
                   "by_match_length": {int(n): [int((r[:, 3] == n).sum()),
                                                round(float(r[r[:, 3] == n, 0].mean()), 3),
                                                round(float(r[r[:, 3] == n, 1].mean()), 3)]
                                       for n in np.unique(r[:, 3])}}
            rows.append(row)
            print(row, flush=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "prose": prose_source(), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
