"""RuntimeEndpoint: prompt programs on a ``radixlm serve`` server, over HTTP (SGLang's native routes)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.lang.backend.base import Backend, BackendError


class RuntimeEndpoint(Backend):
    """A running radixlm server at ``base_url`` (``api_key`` if it was started with one)."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0) -> None:
        super().__init__()
        self.base_url = base_url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )

    # -------------------------------------------------------------- transport
    def _post(self, path: str, body: dict[str, Any], parse: bool = True) -> Any:
        try:
            resp = self.client.post(path, json=body)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from exc
        _raise_for_status(resp)
        return resp.json() if parse else resp.text

    def _get(self, path: str) -> Any:
        try:
            resp = self.client.get(path)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from exc
        _raise_for_status(resp)
        return resp.json()

    # ---------------------------------------------------------------- backend
    def generate(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> dict[str, Any]:
        """POST /generate for one prompt; returns ``{"text", "meta_info"}``."""
        out = self._post("/generate", {"text": text, "sampling_params": sampling_params, **_native(logprob_options)})
        self.token_usage.add_outputs(out)
        return out

    def generate_stream(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> Iterator[dict[str, Any]]:
        """POST /generate with ``stream``; yields each server-sent event."""
        body = {"text": text, "sampling_params": sampling_params, "stream": True, **_native(logprob_options)}
        last = None
        try:
            with self.client.stream("POST", "/generate", json=body) as resp:
                if resp.status_code != 200:
                    resp.read()
                    _raise_for_status(resp)
                for line in resp.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        break
                    event = json.loads(payload)
                    if "error" in event:  # the request failed in the server after it started
                        raise BackendError(f"the server failed this request: {event['error'].get('message', event['error'])}")
                    last = event
                    yield event
        except httpx.HTTPError as exc:
            raise BackendError(f"the stream from {self.base_url} broke: {exc}") from exc
        if last is not None:
            self.token_usage.add_outputs(last)

    def prefill(self, input_ids: list[list[int]], logprob_start_len: int, lora: str | None = None) -> list[dict[str, Any]]:
        """One batched /generate of prompts with ``max_new_tokens=0`` and prompt logprobs."""
        body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True, "logprob_start_len": logprob_start_len, **_native({"lora": lora})}
        outs = self._post("/generate", body)
        self.token_usage.add_outputs(outs)
        return outs

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """POST /tokenize with a list of prompts."""
        return self._post("/tokenize", {"prompt": list(texts), "add_special_tokens": add_special_tokens})["tokens"]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """POST /apply_chat_template."""
        return self._post("/apply_chat_template", {"messages": messages, "add_generation_prompt": add_generation_prompt})["text"]

    def flush_cache(self) -> bool:
        """POST /flush_cache."""
        try:
            self._post("/flush_cache", {}, parse=False)
        except ValueError:  # 400: requests in flight
            return False
        return True

    def get_model_info(self) -> dict[str, Any]:
        """GET /get_model_info."""
        return self._get("/get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        """GET /get_server_info (options and live stats, incl. the cache hit rate)."""
        return self._get("/get_server_info")

    def shutdown(self) -> None:
        """Close the HTTP connections."""
        self.client.close()


def _native(options: dict[str, Any]) -> dict[str, Any]:
    """Request options as ``/generate`` names them: the adapter ``lora`` is SGLang's ``lora_path``."""
    out = {k: v for k, v in options.items() if k != "lora"}
    if options.get("lora") is not None:
        out["lora_path"] = options["lora"]
    return out


def _raise_for_status(resp: httpx.Response) -> None:
    if resp.status_code == 200:
        return
    try:
        message = resp.json().get("message", resp.text)
    except ValueError:
        message = resp.text
    if resp.status_code == 400:
        raise ValueError(message)
    raise BackendError(f"server answered {resp.status_code}: {message}")
