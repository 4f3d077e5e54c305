"""LoRA over HTTP: ``POST /load_lora_adapter`` and ``/unload_lora_adapter`` (admin), and how a
request names its adapter: ``lora_path`` on ``/generate`` (SGLang's field: the adapter's name),
``model: "base:name"`` or ``model: "name"`` on the OpenAI routes; ``/v1/models`` lists adapters."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, Field

from radixlm.runtime.entrypoints.http.body import read_model
from radixlm.runtime.entrypoints.http.common import ServerState
from radixlm.runtime.entrypoints.http.errors import APIError
from radixlm.runtime.entrypoints.http.tenancy import require_admin
from radixlm.runtime.sampling_params import per_sample_params

UNLOAD_TIMEOUT_S = 600.0


class LoadLoraRequest(BaseModel):
    """``POST /load_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)


class UnloadLoraRequest(BaseModel):
    """``POST /unload_lora_adapter``."""

    model_config = ConfigDict(extra="forbid")
    lora_name: str = Field(min_length=1)


def add_routes(app: FastAPI, state: ServerState) -> None:
    """Register the adapter load/unload routes on ``app`` (both need the admin key)."""
    engine = state.engine

    @app.post("/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> dict[str, Any]:
        require_admin(request, state, "/load_lora_adapter changes what every tenant is served")
        body = await read_model(request, LoadLoraRequest)
        try:  # the folder is read in a worker thread: neither the event loop nor the engine waits
            await asyncio.to_thread(engine.load_lora_adapter, body.lora_name, body.lora_path)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_path" if "already" not in str(exc) else "lora_name") from None
        return {"success": True, "error_message": "", "loaded_adapters": loaded(state)}

    @app.post("/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> dict[str, Any]:
        require_admin(request, state, "/unload_lora_adapter changes what every tenant is served")
        body = await read_model(request, UnloadLoraRequest)
        try:  # returns once the requests queued or running with it have finished
            done = await asyncio.to_thread(engine.unload_lora_adapter, body.lora_name, UNLOAD_TIMEOUT_S)
        except ValueError as exc:
            raise APIError(400, str(exc), param="lora_name") from None
        return {"success": done, "error_message": "" if done else "requests still use it", "loaded_adapters": loaded(state)}


def loaded(state: ServerState) -> dict[str, str]:
    """The served adapters' names (their folders are the admin's to know: not shown)."""
    lora = state.engine.runner.lora
    return {} if lora is None else dict.fromkeys(lora.pool.names(), "")


def model_cards(state: ServerState) -> list[dict[str, Any]]:
    """``/v1/models`` entries of the served adapters (``id`` as the OpenAI routes take it)."""
    lora = state.engine.runner.lora
    names = [] if lora is None else lora.pool.names()
    return [{"id": f"{state.model_name}:{n}", "object": "model", "owned_by": "radixlm", "parent": state.model_name, "max_model_len": state.engine.context_len} for n in names]


def _check(state: ServerState, name: str, param: str) -> str:
    lora = state.engine.runner.lora
    served = [] if lora is None else lora.pool.names()
    if name not in served:
        raise APIError(400, f"{param}: no LoRA adapter {name!r} is loaded (loaded: {served})", param=param)
    return name


def lora_of_model(state: ServerState, model: str | None) -> str | None:
    """The adapter an OpenAI ``model`` names: ``base:name`` or an adapter's own name; None: the base model."""
    if model is None or model == state.model_name:
        return None
    base, sep, name = model.rpartition(":")
    if sep and base == state.model_name:
        return _check(state, name, "model")
    lora = state.engine.runner.lora
    return model if lora is not None and model in lora.pool.names() else None


def generate_loras(state: ServerState, lora_path: str | list[str | None] | None, params: list[Any]) -> list[str | None]:
    """One adapter name per ``/generate`` request (``n`` per prompt, prompt-major) from ``lora_path``:
    one name for every prompt or a list with one per prompt."""
    names = lora_path if isinstance(lora_path, list) else [lora_path] * len(params)
    if len(names) != len(params):
        raise APIError(400, f"lora_path as a list needs one entry per prompt ({len(params)}), got {len(names)}", param="lora_path")
    for name in set(names) - {None}:
        _check(state, name, "lora_path")
    return [name for name, sp in zip(names, params) for _ in per_sample_params(sp)]
