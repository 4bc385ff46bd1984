"""Speculative decoding's settings (kiln.speculative): the proposer, its draft counts and tree
shapes, and the bounds the runner's kernels hold drafts to. A leaf, as kiln.config is (which
holds it in `EngineConfig`); split out of it by concern.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from kiln.config_fields import doc

MAX_TREE_WIDTH = 8
# drafts in one request's tree: with its root, a query of 32 tokens (decode-sized: the fused
# stack's matmuls and the short-query attention kernel, which draft trees stay in)
MAX_TREE_DRAFTS = 31
DEFAULT_TREE_DRAFTS = 15  # tree_size by default (lookup's and a draft model's)
# a head's draft trees by default: 3 continuations, up to 12 drafts, lookup's continuation
# joining them (ngram_first), where one sequence decodes (tree_max_batch): the fastest shape
# measured on code at batch 1 (see docs/decisions/0005); chains elsewhere, as SGLang's EAGLE
# picks a tree for its users
HEAD_TREE_WIDTH, HEAD_TREE_DRAFTS = 3, 12
# and those trees hold the head's nodes of path probability >= this (tree_min_prob): a step
# verifies few drafts where the head is sure and up to 12 where it is not. At batch 1, k = 3
# forced, 32 prompts, it ran 1.06x the fixed 3 x 12 on both code and prose with about the same
# drafts accepted (see docs/decisions/0006)
HEAD_TREE_MIN_PROB = 0.03


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a proposer guesses the next tokens, the target verifies them in one
    forward pass (losslessly: greedy output is unchanged, sampled output keeps its distribution).
    `LLM(speculator=...)` and `kiln serve --speculator` build one from a name or a directory."""

    # --speculator / --speculative-config name these two (kiln.speculative.resolve)
    method: str = field(default="ngram", metadata=doc(
        "registered proposer: ngram (prompt lookup), draft (model), head (EAGLE)", cli=False))
    model: str | None = field(default=None, metadata=doc(
        "draft: an HF checkpoint sharing the tokenizer; head: a head directory", cli=False))
    num_speculative_tokens: int = field(default=3, metadata=doc(
        "most draft tokens per sequence per step (k)", flag="--num-speculative-tokens"))
    adaptive: bool = field(default=True, metadata=doc(
        "choose per step how many drafts, and a tree or a chain, by measured cost and "
        "acceptance; --no-speculative-adaptive always drafts --num-speculative-tokens (trees "
        "wherever they are allowed)", flag="--speculative-adaptive"))
    max_batch_size: int | None = field(default=None, metadata=doc(
        "no drafts in steps where more sequences run", none_means="no cap",
        flag="--speculative-max-batch-size"))
    ngram_min: int = field(default=1, metadata=doc(
        "n-gram lookup: shortest suffix to look up in the prompt and output",
        flag="--speculative-ngram-min"))
    ngram_max: int = field(default=4, metadata=doc(
        "n-gram lookup: longest suffix to look up (longer matches win)",
        flag="--speculative-ngram-max"))
    draft_kv_cache_memory: int | None = field(default=None, metadata=doc(
        "a draft model's KV cache bytes", none_means="derived",
        flag="--speculative-draft-kv-cache-memory"))
    # draft/head: an n-gram match's drafts when there is one (None: on for a head, off for a
    # draft model)
    ngram_first: bool | None = field(default=None, metadata=doc(
        "with a draft model or head: take an n-gram (prompt lookup) match's drafts when the "
        "sequence has one (with a head: in the same tree), the model's otherwise",
        none_means="on for a head, off for a draft model", flag="--ngram-first"))
    speculator_int8: bool = field(default=True, metadata=doc(
        "a head's or draft model's weights int8 weight-only at decode sizes (cheaper draft "
        "steps; output is exact either way)", flag="--speculator-int8"))
    # head/draft with a draft vocabulary: greedy verify steps score the whole vocabulary only
    # on the rows the walk visits, the draft vocabulary guessing the others (lossless:
    # kiln.speculative.shortlist; see docs/decisions/0009)
    verify_shortlist: bool = field(default=True, metadata=doc(
        "a head or draft model with a draft vocabulary: greedy verify steps score the whole "
        "vocabulary only on the rows the walk visits (lossless)",
        flag="--speculative-verify-shortlist"))
    # draft trees: up to this many alternative continuations per request and step, verified
    # in one forward (n-gram: several earlier occurrences' continuations, merged by common
    # prefix; head: a beam search this wide, its k * width likeliest nodes; with
    # ngram_first, a match passed over for the head joins its tree); 1 = one chain of drafts.
    # With adaptive speculation each step still picks a tree or a chain, whichever has made
    # more tokens per unit of cost (spec/adaptive.py, TreeChoice). None: HEAD_TREE_WIDTH for
    # a head, 1 otherwise
    tree_width: int | None = field(default=None, metadata=doc(
        "draft trees: up to this many alternative continuations per sequence and step, "
        "verified in one forward (n-gram lookup, head; 1 = one chain)",
        none_means=f"{HEAD_TREE_WIDTH} for a head, 1 otherwise", flag="--speculative-tree-width"))
    # most drafts in one tree (SGLang's --speculative-num-draft-tokens): a tree's first this
    # many nodes (the head's likeliest; in a merged tree lookup's first continuation, the
    # head's, then lookup's others). None: HEAD_TREE_DRAFTS for a head, DEFAULT_TREE_DRAFTS
    # otherwise
    tree_size: int | None = field(default=None, metadata=doc(
        f"draft trees: at most this many drafts per tree (1-{MAX_TREE_DRAFTS})",
        none_means=f"{HEAD_TREE_DRAFTS} for a head, {DEFAULT_TREE_DRAFTS} otherwise",
        flag="--speculative-tree-size"))
    # a head's tree by probability (a dynamic tree size): the head's nodes whose path
    # probability is at least this, up to tree_size of them, rather than its `k * width`
    # likeliest (with ngram_first, lookup's first continuation still goes first and its others
    # stay out). The head's probabilities are calibrated, so a step where it is sure verifies
    # a few drafts and one where it is not verifies many: more accepted per draft verified
    # (see docs/decisions/0006). 0: a fixed size, the `k * width` likeliest;
    # None: HEAD_TREE_MIN_PROB for a head (lookup's and a draft model's trees have no floor)
    tree_min_prob: float | None = field(default=None, metadata=doc(
        "a head's draft trees by probability: its nodes whose path probability is at least "
        "this, up to --speculative-tree-size; 0 = a fixed size",
        none_means=f"{HEAD_TREE_MIN_PROB} for a head, 0 otherwise",
        flag="--speculative-tree-min-prob"))
    # trees only in steps where at most this many sequences decode (chains above): at small
    # batches a step's cost hardly grows with its query tokens, at larger ones a tree's
    # extra tokens cost more than they bring (see docs/decisions/0005)
    tree_max_batch: int = field(default=1, metadata=doc(
        "draft trees only while at most this many sequences decode (chains above)",
        flag="--speculative-tree-max-batch"))

    def __post_init__(self):
        if not self.method:
            raise ValueError("speculative method must be a proposer name (ngram, draft, head)")
        if self.method in ("draft", "head") and not self.model:
            raise ValueError(f"speculative method {self.method!r} needs a model directory")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], "
                             f"got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"need 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.tree_width is not None and not 1 <= self.tree_width <= MAX_TREE_WIDTH:
            raise ValueError(f"tree_width must be in [1, {MAX_TREE_WIDTH}], got "
                             f"{self.tree_width}")
        if self.tree_size is not None and not 1 <= self.tree_size <= MAX_TREE_DRAFTS:
            raise ValueError(f"tree_size must be in [1, {MAX_TREE_DRAFTS}], got "
                             f"{self.tree_size}")
        if self.tree_min_prob is not None and not 0 <= self.tree_min_prob < 1:
            raise ValueError(f"tree_min_prob must be in [0, 1), got {self.tree_min_prob}")
        if self.tree_max_batch < 1:
            raise ValueError(f"tree_max_batch must be >= 1, got {self.tree_max_batch}")
        if self.max_batch_size is not None and self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be >= 1, got {self.max_batch_size}")

    def resolved(self) -> SpeculativeConfig:
        """This config with its method's defaults in place of None (what the engine runs):
        a head drafts trees by probability with lookup joined, lookup and a draft model chains
        alone."""
        head = self.method == "head"
        return dataclasses.replace(
            self,
            ngram_first=head if self.ngram_first is None else self.ngram_first,
            tree_width=self.tree_width or (HEAD_TREE_WIDTH if head else 1),
            tree_size=self.tree_size or (HEAD_TREE_DRAFTS if head else DEFAULT_TREE_DRAFTS),
            tree_min_prob=(self.tree_min_prob if self.tree_min_prob is not None
                           else HEAD_TREE_MIN_PROB if head else 0.0))
