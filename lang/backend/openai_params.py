"""Sampling parameters of prompt programs (SGLang's names) as an OpenAI-compatible request's fields.

OpenAI's own fields go in the request; the fields only SGLang-style servers take (radixlm, SGLang,
vLLM: ``top_k``, ``min_p``, ``regex``, ``ebnf`` ...) go in its extra body, and only when the backend
is told the server has them. A parameter that has no OpenAI field and no extension is refused by
name unless it holds its neutral value (which changes nothing).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

# SGLang name -> OpenAI field (the same meaning on every OpenAI-compatible server)
STANDARD = {
    "max_new_tokens": "max_tokens",
    "stop": "stop",
    "temperature": "temperature",
    "top_p": "top_p",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "seed": "seed",
    "n": "n",
}

# SGLang name -> extra body field, and the value that changes nothing
EXTENSIONS = {
    "top_k": ("top_k", -1),
    "min_p": ("min_p", 0.0),
    "min_new_tokens": ("min_tokens", 0),
    "repetition_penalty": ("repetition_penalty", 1.0),
    "ignore_eos": ("ignore_eos", False),
    "stop_token_ids": ("stop_token_ids", []),
    "skip_special_tokens": ("skip_special_tokens", True),
    "regex": ("regex", None),
    "ebnf": ("ebnf", None),
}

REFUSED = {
    "stop_regex": "stop_regex has no OpenAI field; use stop strings or a regex constraint",
    "no_stop_trim": "no_stop_trim has no OpenAI field",
}


@dataclass
class Request:
    """The fields of one request: ``kwargs`` for the client, ``extra_body``, and which extensions it uses."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    extra_body: dict[str, Any] = field(default_factory=dict)
    extensions: list[str] = field(default_factory=list)  # SGLang names of the extra-body fields used

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``client.completions.create`` / ``client.chat.completions.create``."""
        return {**self.kwargs, "extra_body": dict(self.extra_body)} if self.extra_body else dict(self.kwargs)


def to_request(params: dict[str, Any], *, chat: bool, extensions: bool) -> Request:
    """Map SGLang sampling parameters to a request; raises ValueError naming a parameter it cannot send."""
    req = Request()
    for key, value in params.items():
        if value is None:
            continue
        if key in STANDARD:
            if key == "stop" and not value:
                continue
            req.kwargs[STANDARD[key]] = value
        elif key == "json_schema":
            _json_schema(req, value, chat=chat, extensions=extensions)
        elif key in EXTENSIONS:
            name, neutral = EXTENSIONS[key]
            if value == neutral:
                continue
            if not extensions:
                raise ValueError(f"{key}={value!r} needs a server with SGLang-style extensions (this backend was made with server_extensions=False)")
            req.extra_body[name] = value
            req.extensions.append(key)
        elif key in REFUSED:
            raise ValueError(f"the OpenAI backend cannot send {key}: {REFUSED[key]}")
        else:
            raise ValueError(f"the OpenAI backend does not know the sampling parameter {key!r}")
    return req


def _json_schema(req: Request, schema: Any, *, chat: bool, extensions: bool) -> None:
    parsed = json.loads(schema) if isinstance(schema, str) else schema
    if chat:  # OpenAI's structured outputs
        req.kwargs["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": parsed}}
        req.extensions.append("json_schema")
        return
    if not extensions:
        raise ValueError("json_schema on a completion model needs a server with SGLang-style extensions (this backend was made with server_extensions=False)")
    req.extra_body["json_schema"] = schema if isinstance(schema, str) else json.dumps(schema)
    req.extensions.append("json_schema")
