"""The prefix cache's block hash: a block of token ids chained to the hash of the block before
it. One rule for both sides of the process border: the engine's block pool registers blocks
under it, and the Ray router (cluster/router.py) sends a prompt where its blocks already are."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

BlockHash = bytes


def block_hash(parent: BlockHash | None, tokens: Sequence[int]) -> BlockHash:
    """SHA-256 of the parent block's hash and this block's token ids: collision-resistant, so
    no crafted prompt can make a request read another's KV (Python's hash() could be forced)."""
    h = hashlib.sha256(parent or b"")
    h.update(np.asarray(tokens, dtype=np.int64).tobytes())
    return h.digest()
