"""OpenAI: prompt programs on any OpenAI-compatible server (radixlm's own, llama.cpp, vLLM, a hosted API).

Requests go through the ``openai`` client package, imported when a backend is created (so that
``import radixlm`` stays light). How the program's calls become requests (messages for chat
models, ``select`` without prompt logprobs, API speculative execution) is in
``radixlm.lang.remote_calls``; this module sends requests and keeps the token usage.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import httpx

from radixlm.lang.backend.base import Backend, BackendError
from radixlm.lang.backend.openai_params import Request, to_request
from radixlm.lang.chat_template import ChatTemplate

# OpenAI's models that only have the completions API; every other name is taken for a chat model.
COMPLETION_MODEL_PREFIXES = ("gpt-3.5-turbo-instruct", "davinci-002", "babbage-002", "text-davinci", "text-curie", "text-babbage", "text-ada")

# Role markers for a state's text when the server cannot render its model's template (display only
# for chat models: those get the messages themselves).
DEFAULT_TEMPLATE = ChatTemplate(
    roles={r: (f"<|im_start|>{r}\n", "<|im_end|>\n") for r in ("system", "user", "assistant", "tool")},
    generation_prompt="<|im_start|>assistant\n",
)


def decide_chat_model(model: str) -> bool:
    """SGLang's rule: OpenAI's completion-only models (``gpt-3.5-turbo-instruct``, ``davinci-002`` ...) are not chat models; every other name is."""
    name = model.rsplit("/", 1)[-1].lower()
    return not name.startswith(COMPLETION_MODEL_PREFIXES)


class OpenAI(Backend):
    """A model behind an OpenAI-compatible API (``/v1/completions``, ``/v1/chat/completions``).

    - ``is_chat_model``: chat models get the state's chat messages (a ``gen`` must be inside an
      assistant message); completion models get the state's text. When not given it is decided
      from the name (``decide_chat_model``): pass ``is_chat_model=False`` for a base model on a
      local server.
    - ``chat_template``: the role markers written into the state's text. By default they are
      probed from the server's ``/apply_chat_template`` (radixlm and SGLang have it); a server
      without it gets ChatML markers.
    - ``server_extensions``: the server takes SGLang's extra body fields (``regex``, ``ebnf``,
      ``json_schema`` for completions, ``top_k``, ``min_p`` ...). With False, a program using one
      fails with an error naming it; a server that refuses one (4xx) does too.
    - ``lora`` (``gen(lora=...)``, ``run(lora=...)``) is sent as the model ``"<model>:<name>"``,
      how radixlm's and SGLang's OpenAI routes name an adapter of the served model.
    - ``client_args`` go to ``openai.OpenAI`` (``timeout``, ``max_retries``, ``http_client`` ...).
    """

    def __init__(
        self,
        model: str,
        base_url: str | None = None,
        api_key: str | None = None,
        is_chat_model: bool | None = None,
        chat_template: ChatTemplate | None = None,
        server_extensions: bool = True,
        **client_args: Any,
    ) -> None:
        super().__init__()
        try:
            import openai
        except ImportError as exc:  # the dev extra installs it
            raise ImportError("the OpenAI backend needs the openai package: pip install openai") from exc
        if not isinstance(model, str) or not model:
            raise ValueError("model must be a non-empty model name")
        if api_key is None and base_url is not None:
            api_key = os.environ.get("OPENAI_API_KEY", "EMPTY")  # local servers usually take any key
        self._openai = openai
        self.client = openai.OpenAI(base_url=base_url, api_key=api_key, **client_args)
        self.model = model
        self.base_url = str(self.client.base_url).rstrip("/")
        self.is_chat_model = decide_chat_model(model) if is_chat_model is None else bool(is_chat_model)
        self.server_extensions = server_extensions
        self._fixed_template = chat_template
        self._refused: set[str] = set()  # features the server refused once (e.g. "prompt_logprobs")
        self._refused_lock = threading.Lock()

    # -------------------------------------------------------------- requests
    def model_of(self, lora: str | None) -> str:
        """The ``model`` of a request under the LoRA adapter ``lora`` (None: the base model)."""
        return self.model if lora is None else f"{self.model}:{lora}"

    def request(self, prompt: str | list[str] | list[list[int]] | list[dict[str, Any]], params: dict[str, Any], *, chat: bool | None = None, logprobs: int | None = None, echo: bool = False, lora: str | None = None) -> list[dict[str, Any]]:
        """Send one request (``lora``: under that adapter); returns each choice as ``{"text", "meta_info"}`` (meta_info with the request's usage)."""
        chat = self.is_chat_model if chat is None else chat
        req = to_request(params, chat=chat, extensions=self.server_extensions)
        kwargs = req.client_kwargs()
        if logprobs is not None:
            if chat:
                kwargs.update(logprobs=True, top_logprobs=logprobs or None)
            else:
                kwargs["logprobs"] = logprobs
        if echo:
            kwargs["echo"] = True
        model = self.model_of(lora)
        if chat:
            resp = self._call(req, model, lambda: self.client.chat.completions.create(model=model, messages=prompt, **kwargs))
        else:
            resp = self._call(req, model, lambda: self.client.completions.create(model=model, prompt=prompt, **kwargs))
        usage = self._count(resp.usage)
        return [{"text": _choice_text(c, chat), "meta_info": {**usage, "finish_reason": _finish(c.finish_reason), **_logprobs(c, chat)}} for c in resp.choices]

    def request_stream(self, prompt: str | list[dict[str, Any]], params: dict[str, Any], *, chat: bool | None = None, lora: str | None = None) -> Iterator[dict[str, Any]]:
        """Stream one request of one choice; yields ``{"text", "meta_info"}`` with the text so far."""
        chat = self.is_chat_model if chat is None else chat
        req = to_request(params, chat=chat, extensions=self.server_extensions)
        kwargs = {**req.client_kwargs(), "stream": True, "stream_options": {"include_usage": True}}
        model = self.model_of(lora)
        if chat:
            stream = self._call(req, model, lambda: self.client.chat.completions.create(model=model, messages=prompt, **kwargs))
        else:
            stream = self._call(req, model, lambda: self.client.completions.create(model=model, prompt=prompt, **kwargs))
        text, finish, usage = "", None, None
        try:
            for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage
                for c in chunk.choices or []:
                    piece = (c.delta.content if chat else c.text) or ""
                    finish = c.finish_reason or finish
                    if piece:
                        text += piece
                        yield {"text": text, "meta_info": {"finish_reason": None}}
        except self._openai.APIError as exc:
            raise BackendError(f"the stream from {self.base_url} broke: {exc}") from exc
        finally:
            stream.close()
        yield {"text": text, "meta_info": {**self._count(usage), "finish_reason": _finish(finish)}}

    def _call(self, req: Request, model: str, send: Any) -> Any:
        openai = self._openai
        try:
            return send()
        except openai.APIStatusError as exc:
            message = _error_message(exc)
            if 400 <= exc.status_code < 500 and exc.status_code not in (401, 403, 429):
                if _error_field(exc, "param") == "model" or _error_field(exc, "code") == "model_not_found":
                    # not a refused feature: select's fallbacks must not take it for one and stop asking
                    raise ValueError(f"the server at {self.base_url} does not serve the model {model!r} ({exc.status_code}: {message})") from None
                if req.extensions:
                    used = ", ".join(req.extensions)
                    raise ValueError(f"the server at {self.base_url} refused a request using {used} (answered {exc.status_code}: {message}); this server may not support {used}") from None
                raise ValueError(f"the server at {self.base_url} refused the request ({exc.status_code}): {message}") from None
            raise BackendError(f"the server at {self.base_url} answered {exc.status_code}: {message}") from None
        except openai.APIError as exc:  # connection errors and timeouts
            raise BackendError(f"cannot reach the server at {self.base_url}: {exc}") from exc

    def _count(self, usage: Any) -> dict[str, int]:
        if usage is None:
            return {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
        details = getattr(usage, "prompt_tokens_details", None)
        cached = (getattr(details, "cached_tokens", None) or 0) if details is not None else 0
        self.token_usage.add(usage.prompt_tokens or 0, usage.completion_tokens or 0, cached)
        return {"prompt_tokens": usage.prompt_tokens or 0, "completion_tokens": usage.completion_tokens or 0, "cached_tokens": cached}

    def refused(self, feature: str) -> bool:
        """True once the server has refused ``feature`` (then the backend stops asking for it)."""
        with self._refused_lock:
            return feature in self._refused

    def mark_refused(self, feature: str) -> None:
        """Remember that the server refused ``feature``."""
        with self._refused_lock:
            self._refused.add(feature)

    # ----------------------------------------------------------- Backend API
    def generate(self, text: str, sampling_params: dict[str, Any], *, return_logprob: bool = False, top_logprobs_num: int = 0, logprob_start_len: int = -1, return_text_in_logprobs: bool = False, lora: str | None = None) -> Any:
        """Complete ``text`` on the completions API (a list of outputs when ``n`` > 1); output logprobs only."""
        self._need_completions("generate")
        outs = self.request(text, sampling_params, chat=False, logprobs=top_logprobs_num if return_logprob else None, lora=lora)
        return outs if sampling_params.get("n", 1) > 1 else outs[0]

    def generate_stream(self, text: str, sampling_params: dict[str, Any], **logprob_options: Any) -> Iterator[dict[str, Any]]:
        """Stream a completion of ``text``; yields the text so far, the last with usage."""
        self._need_completions("generate_stream")
        if logprob_options.get("return_logprob"):
            raise ValueError("the OpenAI backend cannot stream logprobs; run without stream=True")
        yield from self.request_stream(text, sampling_params, chat=False, lora=logprob_options.get("lora"))

    def prefill(self, input_ids: list[list[int]], logprob_start_len: int, lora: str | None = None) -> list[dict[str, Any]]:
        """Prompt logprobs of token-id prompts (completions with ``echo`` and ``max_tokens=0``)."""
        self._need_completions("prefill")
        outs = self.request(input_ids, {"max_new_tokens": 0}, chat=False, logprobs=0, echo=True, lora=lora)
        for out in outs:
            out["meta_info"]["input_token_logprobs"] = out["meta_info"].pop("output_token_logprobs", [])[logprob_start_len:]
        return outs

    def tokenize(self, texts: list[str], add_special_tokens: bool = True) -> list[list[int]]:
        """Token ids from the server's ``/tokenize`` (radixlm's and SGLang's route; OpenAI has none)."""
        return self._native("/tokenize", {"prompt": list(texts), "add_special_tokens": add_special_tokens})["tokens"]

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """Render messages with the server's ``/apply_chat_template`` (radixlm's route)."""
        return self._native("/apply_chat_template", {"messages": messages, "add_generation_prompt": add_generation_prompt})["text"]

    def get_chat_template(self) -> ChatTemplate:
        """The given template, else the server's (probed once), else ChatML markers."""
        if self._fixed_template is not None:
            return self._fixed_template
        with self._template_lock:
            if self._template is None:
                try:
                    self._template = ChatTemplate.probe(self.apply_chat_template, self.tokenize)
                except (BackendError, ValueError):
                    self._template = DEFAULT_TEMPLATE
            return self._template

    def cache_prefix(self, text: str, lora: str | None = None) -> dict[str, Any]:
        """Nothing to do: the server's own prefix caching sees the repeated text (and a hosted API would bill it)."""
        return {"text": "", "meta_info": {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0, "finish_reason": {"type": "length"}}}

    def flush_cache(self) -> bool:
        """POST ``/flush_cache`` on a radixlm or SGLang server; False where the server has no such route."""
        try:
            self._native("/flush_cache", {}, parse=False)
        except (ValueError, BackendError):
            return False
        return True

    def program_hook(self, executor: Any) -> Any:
        """What runs a program state's calls on this backend (see ``radixlm.lang.remote_calls``)."""
        from radixlm.lang.remote_calls import ApiExecution

        return ApiExecution(self, executor)

    def shutdown(self) -> None:
        """Close the client's connections."""
        self.client.close()

    # --------------------------------------------------------------- helpers
    def _need_completions(self, what: str) -> None:
        if self.is_chat_model:
            raise ValueError(f"{what}: {self.model!r} is used as a chat model (programs send it messages); pass is_chat_model=False to use its completions API")

    def _native(self, path: str, body: dict[str, Any], parse: bool = True) -> Any:
        """POST to a route of the server's root (the base URL without ``/v1``)."""
        root = self.base_url[: -len("/v1")] if self.base_url.endswith("/v1") else self.base_url
        try:
            resp = httpx.post(root + path, json=body, headers={"Authorization": f"Bearer {self.client.api_key}"}, timeout=30.0)
        except httpx.HTTPError as exc:
            raise BackendError(f"cannot reach {root + path}: {exc}") from exc
        if resp.status_code == 404:
            raise BackendError(f"the server at {root} has no {path} route")
        if resp.status_code != 200:
            raise ValueError(f"{path} answered {resp.status_code}: {resp.text[:300]}")
        return resp.json() if parse else resp.text


def _choice_text(choice: Any, chat: bool) -> str:
    return (choice.message.content or "") if chat else (choice.text or "")


def _finish(reason: str | None) -> dict[str, Any] | None:
    return {"type": reason} if reason else None


def _logprobs(choice: Any, chat: bool) -> dict[str, Any]:
    """``output_token_logprobs`` as ``(logprob, None, token_text)`` triples (the API gives no token ids)."""
    lp = choice.logprobs
    if lp is None:
        return {}
    if chat:
        return {"output_token_logprobs": [(t.logprob, None, t.token) for t in (lp.content or [])]}
    return {"output_token_logprobs": [(v, None, t) for v, t in zip(lp.token_logprobs or [], lp.tokens or [])], "text_offset": list(lp.text_offset or [])}


def _error_field(exc: Any, key: str) -> Any:
    """A field of an API error's body (OpenAI's ``{"error": {...}}`` or radixlm's flat shape), or None."""
    body = getattr(exc, "body", None)
    inner = body.get("error", body) if isinstance(body, dict) else None
    return inner.get(key) if isinstance(inner, dict) else None


def _error_message(exc: Any) -> str:
    body = getattr(exc, "body", None)
    if isinstance(body, dict):
        inner = body.get("error", body)
        if isinstance(inner, dict) and inner.get("message"):
            return str(inner["message"])
    return str(getattr(exc, "message", exc))
