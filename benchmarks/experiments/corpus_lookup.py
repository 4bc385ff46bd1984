"""Lookup in a corpus of the target's own text (suffix decoding), replayed on recorded trees.

  python benchmarks/experiments/corpus_lookup.py [--domain prose] [--windows 4096] [--prompts 32]
      [--out benchmarks/results/corpus_lookup_prose.json]

kiln's lookup matches a sequence's last tokens against its own prompt and output. Suffix
decoding (vLLM's `suffix` method) also matches them against text the deployment produced
before: a corpus of earlier outputs, proposing what most often followed the longest match.
Would that add to a trained head on text that does not repeat itself within a request?

The target continues `--windows` openings of the domain's training texts greedily for
`--answer-tokens` (self-distillation, as the heads' training data is made: the corpus is the
target's own text on the domain, none of it from the benchmark's held-out pages), and a
suffix index is built over it (openings and continuations). Then `tree_selection.record`
decodes the speculative benchmark's held-out prompts with the domain's head, lookup joined
and the widest trees, and at every verify step the corpus's likeliest continuation of the
longest suffix it holds (up to 8 tokens, at least `--min-match`) is added to kiln's tree
(3 wide, up to 12 drafts, `tree_selection.kiln_rule`) in three places, and the drafts the
target would have accepted are counted: deterministic, no timing.
"""

from __future__ import annotations

import argparse
import collections
import json

import numpy as np
from early_finetune import continue_openings
from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)
from tree_selection import K, accepted, kiln_rule, lookup_draft, record

from kiln.bench.result import cpu_summary
from kiln.speculative.proposer import Draft, DraftTrie
from kiln.speculative.training import data

SEP = 0xFFFF  # between texts (token ids of the default model are below 2 ** 16)
KEY = 8  # longest suffix looked up: the sort key is a text's next 8 tokens


class CorpusIndex:
    """A suffix array over token sequences, sorted by each position's next KEY tokens (two
    64-bit keys of four 16-bit tokens): the positions that follow a suffix are a binary
    search away."""

    def __init__(self, sequences: list[list[int]]):
        parts = []
        for tokens in sequences:
            parts += [np.asarray(tokens, dtype=np.int64), np.array([SEP])]
        self.tokens = corpus = np.concatenate(parts)
        padded = np.concatenate([corpus, np.full(KEY, SEP)])
        hi, lo = np.zeros(len(corpus), np.uint64), np.zeros(len(corpus), np.uint64)
        for j in range(4):
            hi = (hi << np.uint64(16)) | padded[j:j + len(corpus)].astype(np.uint64)
            lo = (lo << np.uint64(16)) | padded[4 + j:4 + j + len(corpus)].astype(np.uint64)
        self.order = np.lexsort((lo, hi))
        self.hi, self.lo = hi[self.order], lo[self.order]

    @staticmethod
    def _key(tokens: list[int], fill: int) -> np.uint64:
        value = 0
        for j in range(4):
            value = (value << 16) | (tokens[j] if j < len(tokens) else fill)
        return np.uint64(value)

    def _where(self, suffix: list[int]) -> np.ndarray:
        a = np.searchsorted(self.hi, self._key(suffix[:4], 0), "left")
        b = np.searchsorted(self.hi, self._key(suffix[:4], 0xFFFF), "right")
        if len(suffix) > 4 and a < b:
            lo = self.lo[a:b]
            a, b = (a + np.searchsorted(lo, self._key(suffix[4:], 0), "left"),
                    a + np.searchsorted(lo, self._key(suffix[4:], 0xFFFF), "right"))
        return self.order[a:b]

    def match(self, context: list[int], k: int, min_match: int) -> tuple[list[int], int]:
        """The commonest k tokens to follow the longest suffix of `context` the corpus holds
        (at least `min_match` tokens long), and that suffix's length (0: none)."""
        for n in range(min(KEY, len(context)), min_match - 1, -1):
            ends = self._where(list(context[-n:]))[:256] + n
            counts = collections.Counter()
            for end in ends:
                cont = self.tokens[end:end + k]
                cont = cont[:np.argmax(cont == SEP)] if (cont == SEP).any() else cont
                if len(cont):
                    counts[tuple(int(t) for t in cont)] += 1
            if counts:
                return list(counts.most_common(1)[0][0]), n
        return [], 0


def head_draft(step: dict, width: int) -> Draft:
    """The head's part of kiln's tree alone (its K * width likeliest beam nodes)."""
    if step["head"] is None:
        return Draft()
    no_lookup = dict(step, lookup=None)
    return kiln_rule(no_lookup, width, 31)


def with_corpus(step: dict, corpus: list[int], place: str, width: int = 3,
                size: int = 12) -> Draft:
    """kiln's tree with the corpus's chain added: first, after lookup's first continuation,
    or after the head's nodes (a full tree drops what comes last)."""
    if not corpus:
        return kiln_rule(step, width, size)
    lookup = lookup_draft(step, width, size)
    parts = {"first": ["corpus", "lookup", "head", "rest"],
             "after lookup": ["lookup", "corpus", "head", "rest"],
             "after head": ["lookup", "head", "corpus", "rest"]}[place]
    drafts = {"corpus": Draft(corpus), "head": head_draft(step, width),
              "lookup": lookup.main_chain() if lookup else Draft(),
              "rest": lookup or Draft()}
    tree = DraftTrie(size)
    for part in parts:
        if drafts[part].token_ids:
            tree.add_draft(drafts[part])
    return tree.draft()


def plot(result: dict, path: str) -> None:
    """Drafts accepted per verify step: kiln's tree, and with the corpus's chain added."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names, values = zip(*result["accepted"].items(), strict=True)
    fig, ax = plt.subplots(figsize=(6.5, 3.8))
    ax.bar(range(len(names)), values, color=["grey"] + ["tab:blue"] * (len(names) - 1))
    ax.set_xticks(range(len(names)), names, fontsize=8)
    ax.set_ylim(0, 3)
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    for i, v in enumerate(values):
        ax.text(i, v + 0.04, f"{v:.3f}", ha="center", fontsize=8)
    ax.set_ylabel("drafts accepted per verify step (of 3)")
    ax.set_title(f"{result['args']['domain']}: a corpus of the target's text "
                 f"({result['corpus_tokens']:,} tokens) added to a 3 x 12 tree", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--domain", default="prose", choices=["prose", "code"])
    parser.add_argument("--windows", type=int, default=4096)
    parser.add_argument("--answer-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--min-match", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="corpus-lookup.json")
    args = parser.parse_args()

    sequences, _ = continue_openings(args.domain, args.windows, 96, args.answer_tokens,
                                     args.seed, args.threads)
    index = CorpusIndex(sequences)
    steps = record(args.domain, args.prompts, args.threads, contexts=True)
    for step in steps:
        step["corpus"] = index.match(step["context"], K, args.min_match)

    by_length = collections.defaultdict(lambda: [0, 0, 0])  # n -> steps, corpus, tree
    for step in steps:
        chain, n = step["corpus"]
        if n:
            cell = by_length[n]
            cell[0] += 1
            cell[1] += accepted(Draft(chain), step["true"])
            cell[2] += accepted(kiln_rule(step, 3, 12), step["true"])
    result = {"args": vars(args), "cpu": cpu_summary(), "prose": data.prose_source(),
              "corpus_tokens": int(len(index.tokens)), "steps": len(steps),
              "matched": round(sum(bool(s["corpus"][1]) for s in steps) / len(steps), 3),
              "accepted": {"kiln 3 x 12": round(sum(accepted(kiln_rule(s, 3, 12), s["true"])
                                                    for s in steps) / len(steps), 3)},
              "by_match_length": {n: {"steps": c[0], "corpus chain": round(c[1] / c[0], 2),
                                      "kiln tree": round(c[2] / c[0], 2)}
                                  for n, c in sorted(by_length.items())}}
    for place in ("first", "after lookup", "after head"):
        result["accepted"][f"corpus {place}"] = round(sum(
            accepted(with_corpus(s, s["corpus"][0], place), s["true"]) for s in steps)
            / len(steps), 3)
    print(json.dumps({k: result[k] for k in ("matched", "accepted", "by_match_length")},
                     indent=1))
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out.rsplit(".", 1)[0] + ".png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
