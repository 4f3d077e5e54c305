"""Request bodies of Anthropic's Messages API (pydantic): ``POST /v1/messages`` and
``POST /v1/messages/count_tokens``.

Unknown fields are refused, as Anthropic's API refuses them, so a field this server cannot honour
(``container``, ``mcp_servers`` ...) is a 400 naming it rather than silently ignored. Content
blocks the served text model cannot take (images, documents, server tools' results) parse, so
that the planner can refuse them by their path (``messages.0.content.1.type``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from radixlm.runtime.entrypoints.http.body import parse_json
from radixlm.runtime.entrypoints.http.errors import APIError, validation_error
from radixlm.runtime.entrypoints.openai.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    BootstrapRoom,
    Priority,
)
from radixlm.runtime.sampling_params import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from radixlm.runtime.speculative.prediction import MAX_CONTENT_PARTS

Number = StrictInt | StrictFloat
MAX_BLOCKS = MAX_CONTENT_PARTS  # content blocks in one message (each also counts in the context)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Block(BaseModel):
    """A content block: fields this server does not use (``citations``) are ignored."""

    model_config = ConfigDict(extra="ignore")


class CacheControl(_Strict):
    """``cache_control`` on a block: keep the prompt up to the end of it cached (a soft hint)."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] = "5m"

    def seconds(self) -> int:
        return 3600 if self.ttl == "1h" else 300


class TextBlock(_Block):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Block):
    """An assistant's earlier call (sent back in the conversation)."""

    type: Literal["tool_use"]
    id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=128)]
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Block):
    """The result of a call, in a user message."""

    type: Literal["tool_result"]
    tool_use_id: Annotated[str, Field(min_length=1, max_length=256)]
    content: str | Annotated[list[Annotated[TextBlock | OtherBlock, Field(discriminator="type")]], Field(max_length=MAX_BLOCKS)] = ""
    is_error: StrictBool = False
    cache_control: CacheControl | None = None


class ThinkingBlock(_Block):
    """An earlier reasoning section sent back; dropped (templates leave old reasoning out)."""

    type: Literal["thinking", "redacted_thinking"]


class OtherBlock(_Block):
    """Blocks a text model cannot take: parsed so the planner refuses them by their path."""

    type: Literal["image", "document", "search_result", "server_tool_use", "web_search_tool_result", "web_fetch_tool_result", "code_execution_tool_result", "mcp_tool_use", "mcp_tool_result", "container_upload"]


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | OtherBlock, Field(discriminator="type")]
ToolResultBlock.model_rebuild()


class Message(_Strict):
    """One turn of the conversation."""

    role: Literal["user", "assistant"]
    content: str | Annotated[list[ContentBlock], Field(max_length=MAX_BLOCKS)]


class Tool(_Strict):
    """A client tool: its name, description and the JSON schema of its input."""

    type: Literal["custom"] | None = None
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")]
    description: str | None = None
    input_schema: dict[str, Any]
    strict: StrictBool | None = None  # false: the input may hold properties the schema does not declare
    cache_control: CacheControl | None = None
    # accepted, unused: every tool is in the prompt and called directly; inputs stream as generated
    allowed_callers: Annotated[list[str], Field(max_length=8)] | None = None
    defer_loading: StrictBool | None = None
    eager_input_streaming: StrictBool | None = None
    input_examples: Annotated[list[dict[str, Any]], Field(max_length=64)] | None = None


class ToolChoice(_Strict):
    """``tool_choice``: auto (the model decides), any (some tool), tool (this one), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: Annotated[str, Field(min_length=1)] | None = None
    disable_parallel_tool_use: StrictBool = False


class Thinking(_Strict):
    """``thinking``: enabled (with a token budget), adaptive or between_tools (no budget), or
    disabled; ``display: omitted`` sends thinking blocks without their text."""

    type: Literal["enabled", "adaptive", "between_tools", "disabled"]
    budget_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    display: Literal["summarized", "omitted"] | None = None


class OutputFormat(_Strict):
    """``output_config.format``: the answer is JSON valid against ``schema``."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(_Strict):
    """``output_config``: the answer's format; ``effort`` is accepted and unused."""

    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class Metadata(_Strict):
    user_id: Annotated[str, Field(max_length=256)] | None = None


class _Conversation(_Strict):
    """What both routes take: the prompt."""

    model: Annotated[str, Field(min_length=1, max_length=256)]
    messages: Annotated[list[Message], Field(min_length=1, max_length=MAX_MESSAGES)]
    system: str | Annotated[list[TextBlock], Field(max_length=MAX_BLOCKS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = None  # keep the whole prompt cached (a soft hint)
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # radixlm: share cached KV only within a salt
    # accepted, unused: one server, one speed, no workspaces
    speed: Literal["standard", "fast"] | None = None
    user_profile_id: Annotated[str, Field(max_length=256)] | None = None
    workspace_id: Annotated[str, Field(max_length=256)] | None = None


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    max_tokens: Annotated[StrictInt, Field(ge=1)]
    stop_sequences: Annotated[list[Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: StrictBool = False
    temperature: Number | None = Field(default=None, ge=0, le=1)  # the API's older sampling fields (SDKs before 2.x send them)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    top_k: Annotated[StrictInt, Field(ge=0)] | None = None
    metadata: Metadata | None = None  # accepted, unused
    service_tier: Literal["auto", "standard_only"] | None = None  # accepted, unused: one tier here
    inference_geo: Annotated[str, Field(max_length=64)] | None = None  # accepted, unused: it runs here
    bootstrap_room: BootstrapRoom | None = None  # pairs the halves of a disaggregated request (router-set)
    priority: Priority = 0  # radixlm's extra: class under --schedule-policy priority (smaller is more urgent)


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``."""


def parse_request(raw: bytes, model: type[BaseModel]) -> Any:
    """``raw`` checked and validated as ``model``; a 400 naming the field, said as the client
    wrote it: of a union's errors, the deepest (a block's missing field rather than "content
    is not a string"), its path without pydantic's union members (``str``, ``list[...]``) and
    block tags (``messages.0.content.1.text``, not ``...1.text.text``)."""
    value = parse_json(raw)
    if not isinstance(value, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(value)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        best = max(errors, key=lambda e: len(e.get("loc", ())))
        raise validation_error([{**best, "loc": _client_path(value, best.get("loc", ()))}]) from None


def _client_path(value: Any, loc: tuple) -> tuple:
    """``loc`` as a path through the request the client sent."""
    path: list[Any] = []
    node: Any = value
    parts = list(loc)
    for i, part in enumerate(parts):
        if isinstance(part, str) and (part == "str" or "[" in part):
            continue  # a union member's name
        if isinstance(node, dict) and part == node.get("type") and i + 1 < len(parts):
            continue  # a tagged union's tag: the block's type
        path.append(part)
        if isinstance(node, dict) and isinstance(part, str):
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node = node[part]
        else:
            node = None
    return tuple(path)
