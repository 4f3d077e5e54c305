"""Validation of the cache-control arguments of a request: explanation, labels, retention hints."""

from __future__ import annotations

from typing import Any

MAX_CACHE_TTL = 86400.0  # seconds; a retention hint is soft, a day is plenty
MAX_LABEL_CHARS = 256


def check_cache_options(return_cache_info: Any, program: Any, prompt_cache_key: Any, cache_ttl: Any, retention: Any, explain_enabled: bool) -> list[tuple[int, float]]:
    """Validate the cache-explanation and cache-control arguments (ValueError naming the argument);
    returns a copy of ``retention`` to extend."""
    if not isinstance(return_cache_info, bool):
        raise ValueError("return_cache_info must be a boolean")
    if return_cache_info and not explain_enabled:
        raise ValueError("return_cache_info: cache explanations are off on this engine (disable_cache_explain)")
    for name, value in (("program", program), ("prompt_cache_key", prompt_cache_key)):
        if value is not None and (not isinstance(value, str) or not value or len(value) > MAX_LABEL_CHARS):
            raise ValueError(f"{name} must be a non-empty string of at most {MAX_LABEL_CHARS} characters")
    if cache_ttl is not None and not _valid_ttl(cache_ttl):
        raise ValueError(f"cache_ttl must be a number of seconds in (0, {MAX_CACHE_TTL:g}], got {cache_ttl!r}")
    hints = []
    for item in retention or []:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], int) and item[0] > 0 and _valid_ttl(item[1])):
            raise ValueError(f"retention entries must be (prefix tokens > 0, ttl in (0, {MAX_CACHE_TTL:g}] s), got {item!r}")
        hints.append((item[0], float(item[1])))
    return hints


def _valid_ttl(ttl: Any) -> bool:
    return isinstance(ttl, (int, float)) and not isinstance(ttl, bool) and 0 < ttl <= MAX_CACHE_TTL
