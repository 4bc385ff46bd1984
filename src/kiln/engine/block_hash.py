"""Chained block hashes: the one definition of a KV block's identity.

A full block's hash covers its parent's hash, its token ids and extra keys (the tenant's cache
salt, folded into the first block only so that every later hash inherits it). Two requests
share a block exactly when their token prefixes (and salts) are identical up to that block's
end. The workers' prefix caches and the router (kiln.cluster.router) both hash with these
functions, so the router's view and the workers' caches agree bit for bit.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes  # 16 bytes of sha256


def hash_block_tokens(parent: BlockHash | None, token_ids: Sequence[int],
                      salt: str | None = None) -> BlockHash:
    """Hash of one full block, chained on its parent's hash (None for the first block)."""
    h = hashlib.sha256(parent or b"\0")
    if parent is None and salt:
        h.update(b"salt:" + salt.encode())
    h.update(np.asarray(token_ids, dtype=np.int64).tobytes())
    return h.digest()[:16]


def hash_prompt_blocks(token_ids: Sequence[int], block_size: int,
                       salt: str | None = None) -> list[BlockHash]:
    """Hashes of every full block of `token_ids` (what the router computes for a prompt)."""
    hashes: list[BlockHash] = []
    extend_block_hashes(hashes, token_ids, block_size, salt)
    return hashes


def extend_block_hashes(hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
                        salt: str | None = None) -> None:
    """Append hashes for full blocks of `token_ids` not yet covered by `hashes` (in place)."""
    for start in range(len(hashes) * block_size, len(token_ids) - block_size + 1, block_size):
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block_tokens(parent, token_ids[start:start + block_size], salt))
