"""Jump-forward drafts: the tokens of text a grammar forces, proposed without a pass per token.

The forced string is tokenized on its own, the way the tokenizer writes it. The tokens are only
*proposals*: the decoder verifies each against the model's own pick at that position (see
``runtime/decoder.py``), so a tokenization the model would not have chosen costs nothing but the
rejected tail, and the output never differs from token-by-token decoding.
"""

from __future__ import annotations

MAX_DRAFT_TOKENS = 32  # longer forced strings are proposed in several passes


def draft_tokens(tokenizer, forced: str, budget: int) -> list[int]:
    """Tokens of ``forced`` (at most ``budget`` and ``MAX_DRAFT_TOKENS``), or [] when nothing is forced."""
    if not forced or budget <= 0:
        return []
    tokens = tokenizer.encode(forced, add_special_tokens=False)
    return tokens[: min(budget, MAX_DRAFT_TOKENS)]
