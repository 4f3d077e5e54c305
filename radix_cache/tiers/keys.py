"""Names of KV blocks in the lower tiers: a hash chain over the tokens, rooted in what the KV means.

A tier stores a sequence's KV in blocks of ``B`` tokens at positions ``[iB, (i+1)B)``. Block
``i``'s key hashes block ``i - 1``'s key with its own tokens, and block 0's hashes the
*namespace* (the model's digest, the KV format, the page and block sizes) with its tokens::

    key_0 = H(namespace | tokens[0:B])      key_i = H(key_{i-1} | tokens[iB:(i+1)B])

so a key names a whole prefix, not just its last block: two sequences share block ``i``'s key
only if they agree on every token before it. The radix tree's token keys carry the cache salt
(and a LoRA adapter) in their first token, so keys of different salts never meet either.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

KEY_BYTES = 16


def namespace(model_digest: str, codec_label: str, page_size: int, block_tokens: int) -> bytes:
    """The root of every key chain: blocks of another model, format or geometry never match."""
    text = f"radixlm-kv|{model_digest}|{codec_label}|page={page_size}|block={block_tokens}"
    return hashlib.blake2b(text.encode(), digest_size=KEY_BYTES).digest()


def chain(root: bytes, tokens: Sequence[int], block_tokens: int, count: int) -> list[bytes]:
    """The keys of the first ``count`` whole blocks of ``tokens``."""
    keys, parent = [], root
    for i in range(min(count, len(tokens) // block_tokens)):
        block = tokens[i * block_tokens : (i + 1) * block_tokens]
        parent = hashlib.blake2b(parent + repr(tuple(block)).encode(), digest_size=KEY_BYTES).digest()
        keys.append(parent)
    return keys


def salt_key(tokens: Sequence[int]) -> int:
    """The cache salt (and adapter) a sequence's first token carries: 0 when it has none."""
    return int(tokens[0]) >> 32 if tokens else 0
