"""The tenant boundary of the HTTP front: who may see and change what.

A *tenant* is a ``cache_salt``: requests share cached KV, rids and cache explanations only with
requests of the same salt, and requests without a salt form one shared tenant. A salt is a
capability, so make it long and random. The *admin* is whoever presents ``--admin-api-key``:
only the admin sees across tenants (token text in the dashboard, every tenant's cache
explanations, rids of running requests, file paths in the server's info) and acts across them
(``/flush_cache``, aborting any rid). Everyone else sees sizes and counts of what is not theirs.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from fastapi import Request

from radixlm.runtime.entrypoints.http.errors import APIError

if TYPE_CHECKING:
    from radixlm.runtime.entrypoints.http.common import ServerState

ADMIN_SCOPE_KEY = "radixlm_admin"  # set in the ASGI scope's state by the guard
_PATH_FIELDS = ("model_path", "tokenizer_path", "speculative_draft_model_path", "disaggregation_bootstrap", "kv_disk_cache_dir")
# explanation fields that name other requests or carry their text
_PRIVATE_EXPLANATION_FIELDS = ("rid", "program", "prompt_cache_key")


def is_admin(request: Request) -> bool:
    """True when the request presented the admin key (or its dashboard token)."""
    return bool(request.scope.get("state", {}).get(ADMIN_SCOPE_KEY, False))


def require_admin(request: Request, state: ServerState, what: str) -> None:
    """Raise 403 unless the caller is the admin; a server with no key at all lets anyone act."""
    if is_admin(request) or state.open_server:
        return
    hint = "send the admin key" if state.admin_key else "start the server with --admin-api-key (or $RADIXLM_ADMIN_API_KEY) and send that key"
    raise APIError(403, f"{what}: this needs the admin key ({hint})")


def redact_paths(values: dict[str, Any]) -> dict[str, Any]:
    """``values`` with file paths cut to their last component and the KV link's address hidden."""
    out = dict(values)
    for name in _PATH_FIELDS:
        value = out.get(name)
        if isinstance(value, str):
            out[name] = "(hidden)" if name == "disaggregation_bootstrap" else os.path.basename(value.rstrip("/")) or value
    if isinstance(out.get("lora_paths"), list):  # name=path: the names only
        out["lora_paths"] = [str(spec).partition("=")[0] if "=" in str(spec) else os.path.basename(str(spec).rstrip("/")) for spec in out["lora_paths"]]
    return out


def redact_explanation(item: dict[str, Any]) -> dict[str, Any]:
    """A cache explanation without what names other requests or shows their text: counts remain."""
    out = {k: v for k, v in item.items() if k not in _PRIVATE_EXPLANATION_FIELDS}
    out["segments"] = [{k: v for k, v in seg.items() if k not in ("origin_rid", "program", "prompt_cache_key")} for seg in item.get("segments", [])]
    miss = dict(item.get("miss") or {})
    miss.pop("text", None)
    miss.pop("cached_text", None)
    out["miss"] = miss
    return out


def visible_explanations(items: list[dict[str, Any]], admin: bool) -> list[dict[str, Any]]:
    """What a caller may read of the explanations it was given (already its tenant's alone unless
    it is the admin): everything for the admin, else counts without rids, labels or text."""
    return items if admin else [redact_explanation(item) for item in items]


def redact_dashboard(snapshot: dict[str, Any]) -> dict[str, Any]:
    """A dashboard state without token text or rids (sizes, ages and counts remain)."""
    for node in snapshot["tree"]["nodes"]:
        node.pop("head", None)
        node.pop("text", None)
    for rows in (snapshot["queues"]["running"], snapshot["queues"]["waiting"]):
        for row in rows:
            row["rid"] = None
    snapshot["redacted"] = True
    return snapshot
