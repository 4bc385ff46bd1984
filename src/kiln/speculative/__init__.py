"""Speculative decoding: proposers (n-gram, draft model, EAGLE-style head), the speculator that
drafts for the running requests after each step (its k by `adaptive`, its sources by
`routing`), and training speculators on a deployment's own kind of traffic (`training/`).

Proposers plug into `proposer.register_proposer`; the composition root calls
`register_builtin_proposers` once before it builds a speculator. Verification of drafts is
part of sampling a step (`kiln.runner.verify`).
"""


def register_builtin_proposers() -> None:
    """Register the n-gram, draft-model and head proposers (importing a proposer's module
    registers it; a second call does nothing)."""
    import kiln.speculative.draft
    import kiln.speculative.head.proposer
    import kiln.speculative.ngram  # noqa: F401
