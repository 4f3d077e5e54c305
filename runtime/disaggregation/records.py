"""The control records of the KV link: the layout both pools must share, and the checked
parsing of what the peer writes to the store (every size bounded before anything is allocated)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import torch


def prompt_digest(input_ids: list[int]) -> str:
    """A short digest of a prompt's token ids (both sides must have tokenized it alike)."""
    return hashlib.blake2b(torch.tensor(input_ids, dtype=torch.int64).numpy().tobytes(), digest_size=12).hexdigest()


@dataclass(frozen=True)
class KVLayout:
    """What must match between the two pools for their slots to be interchangeable."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    kv_format: str
    page_size: int
    token_bytes: int
    vocab_size: int
    state_bytes: int = 0  # hybrid models: the linear-attention states of one request (after the KV's last position)
    state_format: str = ""  # their dtypes and shapes, which must match too

    def differences(self, other: dict[str, Any]) -> list[str]:
        """``name: ours vs theirs`` for every field that differs."""
        return [f"{k}: {v} here vs {other.get(k)} there" for k, v in vars(self).items() if other.get(k) != v]


class BadRecord(ValueError):
    """A signed control record that does not make sense (wrong types, sizes out of bounds)."""


def _int(rec: dict[str, Any], name: str, low: int = 0, high: int | None = None) -> int:
    value = rec.get(name)
    if type(value) is not int or value < low or (high is not None and value > high):
        bound = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
        raise BadRecord(f"field {name!r} must be {bound}, got {value!r}")
    return value


@dataclass(frozen=True)
class Sent:
    """A prefill-side record ``seq/k``: the KV of ``[start, end)`` of room's prompt follows (and a
    hybrid model's states after position ``end``, ``state_bytes``), or an error."""

    room: int
    start: int = 0
    end: int = 0
    token_bytes: int = 0
    error: str | None = None
    state_bytes: int = 0

    @classmethod
    def parse(cls, rec: dict[str, Any], layout: KVLayout, max_tokens: int) -> Sent:
        """The record, every size bounded before anything is allocated (BadRecord otherwise)."""
        room = _int(rec, "room")
        if rec.get("error") is not None:
            if not isinstance(rec["error"], str):
                raise BadRecord(f"field 'error' must be a string, got {type(rec['error']).__name__}")
            return cls(room, error=rec["error"][:2000])
        start = _int(rec, "start")
        end = _int(rec, "end", start, start + max_tokens)
        token_bytes = _int(rec, "token_bytes", layout.token_bytes, layout.token_bytes) if end > start else 0
        state_bytes = _int(rec, "state_bytes", layout.state_bytes, layout.state_bytes) if end > start and layout.state_bytes else 0
        return cls(room, start, end, token_bytes, state_bytes=state_bytes)


def parse_have(rec: dict[str, Any]) -> dict[str, Any]:
    """A decode-side record ``room/R/have``, its fields checked (BadRecord otherwise)."""
    n = _int(rec, "n")
    start = _int(rec, "start", 0, n)
    end = _int(rec, "end", start, n)
    if not isinstance(rec.get("digest"), str) or not isinstance(rec.get("skip", False), bool):
        raise BadRecord("fields 'digest' (a string) and 'skip' (a boolean) are malformed")
    return {"start": start, "end": end, "n": n, "digest": rec["digest"], "skip": rec.get("skip", False)}

