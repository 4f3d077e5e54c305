"""``radixlm explain-cache``: print why the last requests of a server hit (or missed) the cache."""

from __future__ import annotations

import argparse
import datetime
from typing import Any

_REASONS = {
    "full": "the whole cacheable prompt was cached",
    "new_text": "nothing cached continues this prompt",
    "evicted": "this prefix was cached, then evicted",
    "tokenization_boundary": "a cached prefix spells the same text with other tokens (a tokenization boundary or another rendering)",
    "cache_salt": "this prefix is cached under another cache_salt",
    "cache_disabled": "the radix cache is off",
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    """The ``explain-cache`` subcommand's arguments."""
    p = sub.add_parser(
        "explain-cache",
        help="Print the cache explanations of a server's last requests.",
        description="Ask a running radixlm server which earlier requests each recent request's cached prefix came from, and why its match stopped where it did.",
    )
    p.add_argument("--base-url", required=True, help="The server, e.g. http://127.0.0.1:30000.")
    p.add_argument("--last", type=int, default=10, help="How many of the latest requests to explain (default: 10).")
    p.add_argument("--api-key", default=None, help="The server's key (default: $RADIXLM_ADMIN_API_KEY, else $RADIXLM_API_KEY; prefer the variables, a command line is readable by every local user). Only the admin key shows every tenant's requests with their rids and labels; another key shows counts.")
    p.add_argument("--cache-salt", default=None, help="With a non-admin key: explain the requests of this cache_salt (default: those without one).")
    p.add_argument("--json", action="store_true", help="Print the raw JSON instead of text.")
    p.add_argument("--log-level", default="warning", help=argparse.SUPPRESS)


def run(ns: argparse.Namespace) -> int:
    """Fetch and print the explanations; 1 when the server refuses or cannot be reached."""
    import json
    import sys

    import httpx

    if ns.last < 0:
        raise ValueError(f"--last must be >= 0, got {ns.last}")
    from radixlm.runtime.entrypoints.secrets import ADMIN_KEY_ENV, API_KEY_ENV, resolve_key

    key = resolve_key(ns.api_key, ADMIN_KEY_ENV, "--api-key") or resolve_key(None, API_KEY_ENV, "--api-key")
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    if ns.cache_salt:
        headers["X-Cache-Salt"] = ns.cache_salt
    try:
        resp = httpx.get(ns.base_url.rstrip("/") + "/cache_explanations", params={"last": ns.last}, headers=headers, timeout=30)
    except httpx.HTTPError as exc:
        print(f"radixlm: error: cannot reach {ns.base_url}: {exc}", file=sys.stderr)
        return 1
    if resp.status_code != 200:
        try:
            message = resp.json().get("message", resp.text)
        except ValueError:
            message = resp.text
        print(f"radixlm: error: the server answered {resp.status_code}: {message}", file=sys.stderr)
        return 1
    items = resp.json()["data"]
    if ns.json:
        print(json.dumps(items, indent=2))
    else:
        print(format_explanations(items))
    return 0


def format_explanations(items: list[dict[str, Any]]) -> str:
    """Human-readable text of a list of cache explanations."""
    if not items:
        return "no requests explained yet"
    return "\n\n".join(_format_one(info) for info in items)


def _when(t: float | None) -> str:
    return datetime.datetime.fromtimestamp(t).strftime("%H:%M:%S") if t is not None else "?"


def _label(rid: str | None, program: str | None, key: str | None) -> str:
    extra = [f"program {program}"] if program else []
    extra += [f"prompt_cache_key {key}"] if key else []
    return (rid or "(hidden)") + (f" ({', '.join(extra)})" if extra else "")


def _format_one(info: dict[str, Any]) -> str:
    lines = [
        f"request {_label(info.get('rid'), info.get('program'), info.get('prompt_cache_key'))} at {_when(info.get('time'))}: "
        f"{info['prompt_tokens']} prompt tokens, {info['cached_tokens']} cached, {info['fresh_tokens']} computed fresh"
    ]
    for seg in info["segments"]:
        lines.append(
            f"  tokens [{seg['start']}, {seg['end']}) from request {_label(seg.get('origin_rid'), seg.get('program'), seg.get('prompt_cache_key'))}, "
            f"computed at {_when(seg.get('created'))}, reused by {seg['reuse_count']} request(s)"
        )
    miss = info["miss"]
    why = _REASONS.get(miss["reason"], miss["reason"])
    if miss["reason"] == "evicted":
        why += f" at {_when(miss.get('evicted_at'))}"
    if miss["reason"] == "tokenization_boundary":
        why += f" (ours {miss.get('text')!r} vs cached {miss.get('cached_text')!r} at token {miss.get('diverged_at')})"
    lines.append(f"  match stopped at token {miss['stopped_at']}: {why}")
    again = info.get("recomputed_after_eviction")
    if again:
        lines.append(f"  {again['tokens']} token(s) recomputed after their eviction at {_when(again['evicted_at'])}")
    return "\n".join(lines)
