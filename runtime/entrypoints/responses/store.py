"""Stored responses: what ``previous_response_id`` continues from and ``GET /v1/responses/{id}``
returns, bounded in count and bytes, least recently used evicted first, per tenant.

An entry is keyed by (tenant, id), the tenant being the request's ``cache_salt`` (None: the
shared tenant of requests without one). Another tenant's id is simply absent: it can be neither
read, continued from nor deleted, and the answer (404) is the same as for an id never issued.
Each entry holds the response body and every input item that led to it (the items of the
responses it continues, their outputs, then its own input), so a continuation needs one lookup and
no walk up a chain, an evicted ancestor never breaks a descendant, and ``input_items`` lists them. Everything lives in this process's memory: nothing
is written to disk, and a restart forgets it all.
"""

from __future__ import annotations

import json
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

MAX_COUNT_ENV = "RADIXLM_RESPONSES_MAX_STORED"
MAX_BYTES_ENV = "RADIXLM_RESPONSES_MAX_STORED_BYTES"
DEFAULT_MAX_COUNT = 1024
DEFAULT_MAX_BYTES = 64 << 20


@dataclass(frozen=True)
class StoredResponse:
    """One stored response: its body (as ``GET`` returns it) and the input items it answered."""

    body: dict[str, Any]
    items: list[dict[str, Any]]  # Responses items, oldest first, each with an id; instructions excluded
    size: int  # bytes counted against the store's bound

    def conversation_items(self) -> list[dict[str, Any]]:
        """What a continuation starts from: the input items, then this response's output."""
        return [*self.items, *self.body.get("output", [])]


def entry_size(body: dict[str, Any], items: list[dict[str, Any]]) -> int:
    """The bytes an entry is charged: its body and input items as compact JSON."""
    return len(json.dumps(body, separators=(",", ":")).encode()) + len(json.dumps(items, separators=(",", ":")).encode())


class ResponseStore:
    """Responses kept in memory, at most ``max_count`` of them and ``max_bytes`` in all (LRU)."""

    def __init__(self, max_count: int = DEFAULT_MAX_COUNT, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        if max_count < 0 or max_bytes < 0:
            raise ValueError(f"the response store's bounds must be >= 0, got {max_count} responses and {max_bytes} bytes")
        self.max_count, self.max_bytes = max_count, max_bytes
        self._entries: OrderedDict[tuple[str | None, str], StoredResponse] = OrderedDict()
        self.bytes = 0
        self.evicted = 0

    @classmethod
    def from_env(cls, environ: dict[str, str] | None = None) -> ResponseStore:
        """A store bounded by ``$RADIXLM_RESPONSES_MAX_STORED`` and ``..._BYTES`` (else the defaults)."""
        env = os.environ if environ is None else environ
        bounds = []
        for name, default in ((MAX_COUNT_ENV, DEFAULT_MAX_COUNT), (MAX_BYTES_ENV, DEFAULT_MAX_BYTES)):
            raw = env.get(name)
            try:
                bounds.append(default if raw is None else int(raw))
            except ValueError:
                raise ValueError(f"${name} must be an integer, got {raw!r}") from None
        return cls(*bounds)

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, tenant: str | None, rid: str) -> StoredResponse | None:
        """The tenant's response ``rid`` (now the most recently used), or None."""
        entry = self._entries.get((tenant, rid))
        if entry is not None:
            self._entries.move_to_end((tenant, rid))
        return entry

    def put(self, tenant: str | None, rid: str, body: dict[str, Any], items: list[dict[str, Any]]) -> bool:
        """Keep a response, evicting the least recently used to fit; False when it alone is too large."""
        size = entry_size(body, items)
        if size > self.max_bytes or self.max_count == 0:
            return False
        self.delete(tenant, rid)
        while self._entries and (len(self._entries) >= self.max_count or self.bytes + size > self.max_bytes):
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size
            self.evicted += 1
        self._entries[(tenant, rid)] = StoredResponse(body, items, size)
        self.bytes += size
        return True

    def delete(self, tenant: str | None, rid: str) -> bool:
        """Forget the tenant's response ``rid``; False when it holds none by that id."""
        entry = self._entries.pop((tenant, rid), None)
        if entry is None:
            return False
        self.bytes -= entry.size
        return True
