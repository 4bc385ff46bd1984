"""Which drafts a tree should hold: tree shapes and ordering rules replayed on recorded trees.

  python benchmarks/experiments/tree_selection.py [--prompts 32] [--domains prose code]
      [--out benchmarks/results/tree_selection.json]

The default model decodes the speculative benchmark's held-out prompts greedily (EOS
ignored, 48 tokens) with its domain's head, lookup joined and k = 3 forced, drafting the
widest trees kiln allows (beam 8 wide, up to 31 drafts). At every verify step this records
the head's whole beam (every node it expanded, with its path log-likelihood), lookup's
continuations and the length of the suffix they matched, and the three tokens the target
then emitted. Greedy verification accepts exactly the path of drafts that equals those
tokens, so any smaller tree can be scored offline on the same steps: the drafts it would
have had accepted there. Shapes replayed:

- kiln's rule (`HeadProposer._tree_nodes`, `Speculator._merge`): a beam W wide over the
  three draft steps (replayed from the recorded 8-wide beam: a W-wide beam's nodes are among
  an 8-wide one's), its 3 W likeliest nodes, lookup's first continuation in front and its
  other continuations behind, the first N kept;
- by value: every node of the W-wide beam ranked by its path probability, lookup's first
  continuation in front and its others ranked as if each token were right 8% of the time at
  depth 1 and 30% deeper (the rates measured here), the N likeliest kept;
- by probability (`SpeculativeConfig.tree_min_prob`): the W-wide beam's nodes whose path
  probability reaches a floor P, at most N, lookup's first continuation in front and its
  others left out; so the number of drafts differs from step to step, and each row reports
  the mean drafts per tree beside what it accepted;
- the head's calibration: how often a node was right where its parent was, by the head's own
  probability for it (a calibrated head's path probabilities are the right ranking).

The recorded steps are those of the 8 x 31 run, so a replayed shape is scored at the
positions that run verified at, not those it would have verified at itself: the figures
rank shapes, and `benchmarks/speculative.py` measures them. Deterministic: no timing.
"""

from __future__ import annotations

import argparse
import collections
import json
import math

from transformers import AutoTokenizer  # noqa: F401  (import before engines start threads)

from kiln import LLM, SamplingParams
from kiln.bench.result import cpu_summary
from kiln.config_speculative import SpeculativeConfig
from kiln.runner.verify import children_of
from kiln.speculative.head.proposer import _best_nodes, tree_node_count
from kiln.speculative.proposer import Draft, DraftTrie
from kiln.speculative.resolve import speculator_path
from kiln.speculative.training.data import code_prompts, prose_prompts, prose_source

K, WIDEST, LARGEST = 3, 8, 31
SHAPES = [(3, 9), (3, 12), (4, 12), (6, 12), (8, 12), (4, 15), (6, 16), (8, 16), (8, 20),
          (8, 24), (6, 31), (8, 31)]
FLOORS = ([(w, p, 12) for w in (3, 4) for p in (0.05, 0.04, 0.03, 0.02)]
          + [(w, p, 20) for w in (4, 5, 6, 8) for p in (0.03, 0.02, 0.015, 0.012, 0.01)]
          + [(8, 0.015, 31), (8, 0.01, 31)])
OTHER_LOOKUP = (0.08, 0.3)  # lookup's other continuations: right at depth 1, then per depth


def record(domain: str, n_prompts: int, threads: int, contexts: bool = False) -> list[dict]:
    """Per verify step: the head's beam nodes (log-likelihood, depth, token, parent) or None
    where lookup drafted alone, lookup's (tokens, parents, match length), the target's next
    K tokens (and with `contexts` the sequence's tokens before them)."""
    llm = LLM(max_model_len=1024, kv_cache_memory=96 << 20, max_num_seqs=1,
              num_threads=threads, speculator=str(speculator_path(f"{domain}-head")),
              speculative_config=SpeculativeConfig(
                  ngram_first=True, tree_width=WIDEST, tree_size=LARGEST, tree_min_prob=0.0,
                  adaptive=False,
                  num_speculative_tokens=K))
    spec = llm.engine.speculator
    seen: dict = {"head": None, "lookup": None}
    steps: list[dict] = []
    tree_nodes, lookup, store = spec.proposer._tree_nodes, spec._lookup, spec._store

    def record_nodes(*args):
        seen["head"] = tree_nodes(*args)[0]  # one sequence decodes
        return [seen["head"]]

    def record_lookup(request, width):
        draft, n = lookup(request, width)
        seen["lookup"] = (draft.token_ids, draft.parents, n)
        return draft, n

    def record_store(wanted, draft, source):
        steps.append({"pos": wanted.request.num_tokens, "head": seen["head"],
                      "lookup": seen["lookup"]})
        seen["head"] = seen["lookup"] = None
        return store(wanted, draft, source)

    spec.proposer._tree_nodes, spec._lookup, spec._store = (record_nodes, record_lookup,
                                                            record_store)
    make = code_prompts if domain == "code" else prose_prompts
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    for prompt in make(llm.get_tokenizer(), n_prompts, 96):
        first = len(steps)
        out = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0]
        text = prompt + out.outputs[0].token_ids
        for step in steps[first:]:
            step["true"] = text[step["pos"]:step["pos"] + K]
            if contexts:
                step["context"] = text[:step["pos"]]
    stats = spec.stats
    print(f"{domain}: {len(steps)} steps, {stats.num_accepted_tokens / stats.num_verify_steps:.3f}"
          f" accepted per verify step at {WIDEST} x {LARGEST}")
    return steps


def accepted(draft: Draft, true: list[int]) -> int:
    """Drafts greedy verification accepts: the depth of the path that spells `true`."""
    children = children_of(draft.parents or list(range(-1, len(draft.token_ids) - 1)))
    node, depth = -1, 0
    for token in true:
        node = next((c for c in children.get(node, ()) if draft.token_ids[c] == token), None)
        if node is None:
            break
        depth += 1
    return depth


def score(trees: list[Draft], steps: list[dict]) -> tuple[float, float]:
    """(drafts accepted, drafts verified) per step, mean over the steps."""
    n = len(steps)
    return (round(sum(accepted(t, s["true"]) for t, s in zip(trees, steps, strict=True)) / n, 3),
            round(sum(len(t.token_ids) for t in trees) / n, 2))


def continuations(tokens: list[int], parents: list[int] | None) -> list[list[int]]:
    """A lookup tree's continuations (root to leaf), in the order they were added."""
    if parents is None:
        return [tokens]
    has_child = set(parents)
    out = []
    for leaf in (i for i in range(len(tokens)) if i not in has_child):
        path, node = [], leaf
        while node >= 0:
            path.append(tokens[node])
            node = parents[node]
        out.append(path[::-1])
    return out


def beam(nodes: list[tuple], width: int) -> list[int]:
    """The nodes a beam `width` wide expands, replayed from a wider beam's nodes."""
    children = collections.defaultdict(list)
    for i, (_, _, _, parent) in enumerate(nodes):
        children[parent].append(i)  # best first, as topk gave them
    beams = children[-1][:width]
    kept = list(beams)
    for _ in range(K - 1):
        expanded = [c for b in beams for c in children.get(b, [])[:width]]
        kept += expanded
        beams = sorted(expanded, key=lambda c: -nodes[c][0])[:width]
    return kept


def lookup_draft(step: dict, width: int, size: int) -> Draft | None:
    if not step["lookup"] or not step["lookup"][0]:
        return None
    trie = DraftTrie(size)
    for path in continuations(*step["lookup"][:2])[:width]:
        trie.add(path[:K])
    return trie.draft()


def kiln_rule(step: dict, width: int, size: int, floor: float | None = None) -> Draft:
    """kiln's tree (`HeadProposer._tree`, `Speculator._merge`) replayed: a fixed tree (the
    3 W likeliest of the W-wide beam's nodes), or with `floor` a tree by probability (its
    nodes of path probability >= floor, lookup's other continuations left out)."""
    lookup = lookup_draft(step, width, size)
    if step["head"] is None:
        return lookup or Draft()
    nodes = step["head"]
    kept = beam(nodes, width)
    position = {n: i for i, n in enumerate(kept)}
    beam_nodes = [(lp, d, t, position.get(p, -1)) for lp, d, t, p in (nodes[n] for n in kept)]
    head = _best_nodes(beam_nodes, tree_node_count(beam_nodes, K * width, floor, size))
    if lookup is None:
        return head.limit(K, size)
    trie = DraftTrie(size)
    trie.add_draft(lookup.main_chain())
    trie.add_draft(head)
    if floor is None:
        trie.add_draft(lookup)
    return trie.draft()


def by_value(step: dict, width: int, size: int) -> Draft:
    value: dict[tuple, float] = {}
    if step["head"] is not None:
        nodes, path = step["head"], {-1: ()}
        for n in sorted(beam(step["head"], width), key=lambda n: nodes[n][1]):
            lp, _, token, parent = nodes[n]
            if parent in path:
                path[n] = path[parent] + (token,)
                value[path[n]] = max(value.get(path[n], 0.0), math.exp(lp))
    if step["lookup"] and step["lookup"][0]:
        for i, cont in enumerate(continuations(*step["lookup"][:2])[:width]):
            v = 1.0
            for d in range(1, min(K, len(cont)) + 1):
                v *= 1.0 if i == 0 else OTHER_LOOKUP[d > 1]
                value[tuple(cont[:d])] = max(value.get(tuple(cont[:d]), 0.0), v)
    order = sorted(value, key=lambda p: (-value[p], len(p)))[:size]
    kept = set(order)
    index, tokens, parents = {(): -1}, [], []
    for p in order:
        if all(p[:j] in kept for j in range(1, len(p))):
            index[p] = len(tokens)
            tokens.append(p[-1])
            parents.append(index[p[:-1]])
    return Draft(tokens, None, parents) if tokens else Draft()


def calibration(steps: list[dict]) -> dict[str, list]:
    """Per draft depth: [head probability bin, nodes whose parent was right, share right]."""
    table = collections.defaultdict(lambda: [0, 0])
    for step in steps:
        nodes, right = step["head"], {-1: True}
        for i, (lp, d, token, parent) in enumerate(nodes or ()):
            right[i] = right[parent] and d <= len(step["true"]) and token == step["true"][d - 1]
            if right[parent]:
                p = math.exp(lp - (nodes[parent][0] if parent >= 0 else 0.0))
                cell = table[(d, min(int(p * 5), 4))]
                cell[0] += 1
                cell[1] += right[i]
    return {f"depth {d}": [[f"{b / 5:.1f}-{(b + 1) / 5:.1f}", *table[(d, b)],
                            round(table[(d, b)][1] / max(1, table[(d, b)][0]), 3)]
                           for b in range(5)] for d in range(1, K + 1)}


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for domain, rows in result["domains"].items():
        best: dict[int, dict] = {}  # kiln's rule: the best beam width per tree size
        for row in rows["shapes"]:
            if row["kiln"] >= best.get(row["size"], {"kiln": -1.0})["kiln"]:
                best[row["size"]] = row
        kiln = sorted(best.values(), key=lambda r: r["kiln drafts"])
        ax.plot([r["kiln drafts"] for r in kiln], [r["kiln"] for r in kiln], "-o",
                label=f"{domain}, kiln's rule (fixed size)")
        groups = collections.defaultdict(list)  # by probability: one line per beam and size
        for r in rows.get("by_probability", []):
            groups[(r["width"], r["size"])].append((r["drafts"], r["accepted"]))
        for (width, size), pts in sorted(groups.items()):
            if len(pts) > 1:
                xs, ys = zip(*sorted(pts), strict=True)
                ax.plot(xs, ys, "--s", ms=3, lw=1,
                        label=f"{domain}, by probability, {width} wide, up to {size}")
    ax.axhline(2.0, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("drafts verified per step (mean)")
    ax.set_ylabel("drafts accepted per verify step (of 3)")
    ax.set_title("Tree size and ordering, replayed on recorded 8 x 31 trees")
    ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--domains", nargs="+", default=["prose", "code"],
                        choices=["prose", "code"])
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--out", default="tree-selection.json")
    args = parser.parse_args()
    result = {"args": vars(args), "cpu": cpu_summary(), "prose": prose_source(), "domains": {}}
    for domain in args.domains:
        steps = record(domain, args.prompts, args.threads)
        shapes = []
        for width, size in SHAPES:
            row = {"width": width, "size": size}
            row["kiln"], row["kiln drafts"] = score([kiln_rule(s, width, size) for s in steps],
                                                    steps)
            row["by value"] = score([by_value(s, width, size) for s in steps], steps)[0]
            shapes.append(row)
            print(f"  {domain} {width} x {size}: kiln {row['kiln']:.3f} "
                  f"({row['kiln drafts']:.1f} drafts), by value {row['by value']:.3f}")
        floors = []
        for width, floor, size in FLOORS:
            got, drafts = score([kiln_rule(s, width, size, floor) for s in steps], steps)
            row = {"width": width, "min_prob": floor, "size": size, "accepted": got,
                   "drafts": drafts}
            floors.append(row)
            print(f"  {domain} {width} wide, p >= {floor}, up to {size}: {row['accepted']:.3f} "
                  f"accepted, {row['drafts']:.1f} drafts")
        result["domains"][domain] = {"steps": len(steps), "shapes": shapes,
                                     "by_probability": floors,
                                     "calibration": calibration(steps)}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    plot(result, args.out.rsplit(".", 1)[0] + ".png")
    print(json.dumps({d: r["calibration"] for d, r in result["domains"].items()}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
