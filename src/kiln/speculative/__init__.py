"""Speculative decoding: proposers (n-gram, draft model, EAGLE-style head), verification,
adaptive draft length, and training speculators on a deployment's own kind of traffic.

Modules import lazily: the runner imports `kiln.speculative.verify` alone, and a proposer module
loads only when its method is configured (see `kiln.speculative.proposer.build_proposer`).
"""
