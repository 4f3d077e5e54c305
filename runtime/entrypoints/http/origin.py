"""What a web browser may make the server do: the Host allow-list (against DNS rebinding), the
Origin check on state-changing requests and the JSON-only bodies (against cross-site requests).

A page on any site can make a browser send a "simple" request to ``http://127.0.0.1:PORT``
without a CORS preflight: a POST whose Content-Type is ``text/plain`` or a form type. Such a
request is refused here (415) before any body is parsed, so it never starts work. A page served
under a rebinding host name (``evil.example`` resolving to 127.0.0.1) sends that name in
``Host``: only IP literals, ``localhost`` and the names given by ``--allowed-hosts`` pass (an IP
literal cannot be rebound). A browser's cross-site POST carries ``Origin``: one that is neither
the server's own origin nor in ``--allowed-origins`` is refused (403), which covers body-less
POSTs such as ``/flush_cache`` too.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass, field

SAFE_METHODS = frozenset({"GET", "HEAD", "OPTIONS"})
_JSON_TYPES = ("application/json",)


def host_name(host_header: str) -> str:
    """The name part of a ``Host`` header value (``[::1]:80`` -> ``::1``, ``a.b:1`` -> ``a.b``)."""
    value = host_header.strip()
    if value.startswith("["):
        end = value.find("]")
        return value[1:end].lower() if end > 0 else value.lower()
    name, sep, port = value.rpartition(":")
    if sep and port.isdigit() and ":" not in name:
        return name.lower()
    return value.lower()


def _is_ip_literal(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def is_json_content_type(value: str | None) -> bool:
    """True for ``application/json`` and ``application/*+json`` (any parameters)."""
    if not value:
        return False
    media = value.split(";", 1)[0].strip().lower()
    return media in _JSON_TYPES or (media.startswith("application/") and media.endswith("+json"))


@dataclass(frozen=True)
class OriginPolicy:
    """The hosts and origins this server accepts; ``check_*`` return an error message or None."""

    allowed_hosts: frozenset[str] = frozenset()
    allowed_origins: frozenset[str] = frozenset()
    any_host: bool = False
    _normalized: frozenset[str] = field(default=frozenset(), repr=False)

    @classmethod
    def from_options(cls, allowed_hosts: Iterable[str] = (), allowed_origins: Iterable[str] = ()) -> OriginPolicy:
        """Validate ``--allowed-hosts`` / ``--allowed-origins`` (ValueError naming the option)."""
        hosts = [h.strip() for h in allowed_hosts]
        if any(not h or any(c.isspace() for c in h) for h in hosts):
            raise ValueError(f"--allowed-hosts takes host names without spaces, got {hosts!r}")
        origins = [o.strip().rstrip("/") for o in allowed_origins]
        for origin in origins:
            if origin != "*" and not (origin.startswith(("http://", "https://")) and "/" not in origin.split("://", 1)[1]):
                raise ValueError(f"--allowed-origins takes scheme://host[:port] values (or *), got {origin!r}")
        names = frozenset(host_name(h) for h in hosts if h != "*")
        return cls(frozenset(hosts), frozenset(o.lower() for o in origins), "*" in hosts, names)

    def check_host(self, host_header: str | None) -> str | None:
        """Why this ``Host`` is refused, or None (no header: not a browser, allowed)."""
        if host_header is None or self.any_host:
            return None
        name = host_name(host_header)
        if name == "localhost" or name.endswith(".localhost") or _is_ip_literal(name) or name in self._normalized:
            return None
        return f"Host {host_header!r} is not allowed: use an IP address or localhost, or start the server with --allowed-hosts {name}"

    def origin_allowed(self, origin: str, host_header: str | None, scheme: str) -> bool:
        """True when ``origin`` is the server's own (same scheme and Host) or listed."""
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.allowed_origins or origin in self.allowed_origins:
            return True
        return host_header is not None and origin == f"{scheme}://{host_header.strip().lower()}"

    def check_unsafe(self, method: str, content_type: str | None, origin: str | None, host_header: str | None, scheme: str, has_body: bool) -> tuple[int, str] | None:
        """(status, message) refusing a state-changing request a browser could forge, or None."""
        if method in SAFE_METHODS:
            return None
        if origin is not None and origin != "null" and not self.origin_allowed(origin, host_header, scheme):
            return 403, f"cross-site request from origin {origin!r} refused (start the server with --allowed-origins {origin} to allow it)"
        if origin == "null":
            return 403, "cross-site request from an opaque origin ('null') refused"
        if has_body and not is_json_content_type(content_type):
            shown = content_type or "none"
            return 415, f"request bodies must be JSON: send 'Content-Type: application/json' (got {shown!r})"
        return None
