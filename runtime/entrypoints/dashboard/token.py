"""The dashboard's browser cookie: a token derived from a per-process secret, never the key itself.

``GET /dashboard?key=K`` with a valid key sets a cookie holding ``LEVEL.EXPIRY.MAC`` where MAC is
an HMAC-SHA256 of ``dashboard:LEVEL:EXPIRY`` under a random secret made when the server starts.
The token opens the dashboard's routes only, at the level of the key it was issued for (``admin``
or ``user``), until it expires or the server restarts; stealing it never reveals the API key.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from dataclasses import dataclass, field

TOKEN_TTL_S = 12 * 3600
LEVELS = ("user", "admin")


@dataclass
class DashboardTokens:
    """Issues and checks dashboard tokens under one random secret."""

    ttl_s: int = TOKEN_TTL_S
    _secret: bytes = field(default_factory=lambda: os.urandom(32), repr=False)

    def _mac(self, level: str, expiry: int) -> str:
        return hmac.new(self._secret, f"dashboard:{level}:{expiry}".encode(), hashlib.sha256).hexdigest()

    def issue(self, level: str, now: float | None = None) -> str:
        """A token for ``level`` that expires ``ttl_s`` from now."""
        if level not in LEVELS:
            raise ValueError(f"level must be one of {LEVELS}, got {level!r}")
        expiry = int(time.time() if now is None else now) + self.ttl_s
        return f"{level}.{expiry}.{self._mac(level, expiry)}"

    def level(self, token: str, now: float | None = None) -> str | None:
        """The level ``token`` grants, or None when it is forged, malformed or expired."""
        parts = token.split(".")
        if len(parts) != 3 or parts[0] not in LEVELS or not parts[1].isdigit():
            return None
        level, expiry = parts[0], int(parts[1])
        if not hmac.compare_digest(parts[2].encode(), self._mac(level, expiry).encode()):
            return None
        if expiry < (time.time() if now is None else now):
            return None
        return level
