"""Jump-forward: append text the grammar forces without a forward pass per token.

When the grammar admits exactly one continuation string, the tail of the output is
re-tokenized together with that string (SGLang's compressed-FSM approach): the last few output
tokens plus the forced text are encoded as the model's tokenizer would, the common prefix with
the current tail is kept, and the rest replaces it. The matcher is rolled back and fed the new
tokens, so the output stays valid; if the grammar refuses the re-tokenized tokens the jump is
abandoned. The caller recomputes KV for the new tokens (one extend row instead of many steps).
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.constrained.base import Matcher

RETOKENIZE_TAIL = 4  # output tokens re-encoded together with the forced text


@dataclass
class Jump:
    """Replace the last ``drop`` output tokens with ``tokens``."""

    drop: int
    tokens: list[int]


def plan_jump(tokenizer, output_ids: list[int], forced: str, matcher: Matcher, budget: int) -> Jump | None:
    """Re-tokenize the output tail with ``forced`` and advance ``matcher`` to match, or None.

    ``budget`` caps how many tokens the output may grow by. On None the matcher is unchanged.
    """
    if not forced or budget <= 0:
        return None
    tail = output_ids[-RETOKENIZE_TAIL:]
    tail_text = tokenizer.decode(tail) if tail else ""
    while tail and "\ufffd" in tail_text:  # a split UTF-8 character: keep those tokens as they are
        tail = tail[1:]
        tail_text = tokenizer.decode(tail) if tail else ""
    retok = tokenizer.encode(tail_text + forced, add_special_tokens=False)
    common = 0
    while common < min(len(tail), len(retok)) and tail[common] == retok[common]:
        common += 1
    drop = len(tail) - common
    new = retok[common:]
    if drop and len(new) <= drop:  # nothing gained
        return None
    new = new[: budget + drop]
    if len(new) <= drop:
        return None
    matcher.rollback(drop)
    accepted = 0
    for t in new:
        if not matcher.accept(t):
            break
        accepted += 1
    if accepted < len(new):
        matcher.rollback(accepted)
        for t in output_ids[len(output_ids) - drop :]:
            matcher.accept(t)
        return None
    return Jump(drop, new)


def forced_prefix(tokenizer, forced: str, matcher: Matcher, budget: int) -> list[int]:
    """Tokens for text forced before anything is generated (accepted into ``matcher``), or []."""
    jump = plan_jump(tokenizer, [], forced, matcher, budget)
    return jump.tokens if jump else []
