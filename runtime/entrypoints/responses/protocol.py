"""Request bodies of OpenAI's Responses API (pydantic): ``POST /v1/responses``.

Types and ranges are checked here so a bad field is a 400 naming it (``input.2.call_id``); what
needs the model (the template, the context length, the grammars) is checked while planning.
Fields that would change the answer and that radixlm cannot honour are refused by name rather
than ignored; fields that only label a response (``metadata``, ``user``) are kept or ignored.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, model_validator

from radixlm.runtime.entrypoints.openai.protocol import (
    MAX_MESSAGES,
    MAX_TOOLS,
    Label,
    NonNegInt,
    Number,
    Priority,
)
from radixlm.runtime.speculative.prediction import MAX_CONTENT_PARTS

MAX_METADATA = 16  # OpenAI's own limits on metadata pairs


class _Lenient(BaseModel):
    """Clients send fields we do not read (``status`` of an item echoed back): ignore those."""

    model_config = ConfigDict(extra="ignore")


class TextPart(_Lenient):
    """A text content part: ``input_text`` (user, system), ``output_text`` (an assistant's)."""

    type: Literal["input_text", "output_text", "text", "reasoning_text", "summary_text"]
    text: str


Content = str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)]


def _joined(content: Content) -> str:
    return content if isinstance(content, str) else "".join(p.text for p in content)


class MessageItem(_Lenient):
    """An input or output message (``type`` may be left out, as the easy input form does)."""

    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: Content
    id: str | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        return _joined(self.content)


class FunctionCallItem(_Lenient):
    """A call the model made (sent back so the conversation can go on)."""

    type: Literal["function_call"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    name: Annotated[str, Field(min_length=1, max_length=64)]
    arguments: str
    id: str | None = None


class FunctionCallOutputItem(_Lenient):
    """The result of a call, matched to it by ``call_id``."""

    type: Literal["function_call_output"]
    call_id: Annotated[str, Field(min_length=1, max_length=256)]
    output: Content
    id: str | None = None

    def text(self) -> str:
        """The output's text (parts joined)."""
        return _joined(self.output)


class ReasoningItem(_Lenient):
    """A reasoning item of an earlier answer: accepted, not rendered (templates drop old thinking)."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[TextPart] = Field(default_factory=list)
    content: list[TextPart] | None = None


InputItem = Annotated[MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem, Field(discriminator="type")]
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")


class FunctionTool(_Lenient):
    """A ``tools`` entry: a function, its JSON-schema parameters and ``strict`` (default true)."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: StrictBool | None = None


class FunctionChoice(_Lenient):
    """``tool_choice`` naming one function."""

    type: Literal["function"]
    name: Annotated[str, Field(min_length=1)]


class TextFormat(_Lenient):
    """``text.format``: plain text, any JSON object, or a JSON schema (``name``, ``schema``, ``strict``)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> TextFormat:
        if self.type == "json_schema" and self.schema_ is None:
            raise ValueError("a format of type json_schema needs a schema")
        return self


class TextConfig(_Lenient):
    """``text``: the output's format (``verbosity`` is accepted and has no effect)."""

    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(_Lenient):
    """``reasoning``: echoed; ``effort`` reaches the chat template as ``reasoning_effort`` (GPT-OSS's
    system message says it), and otherwise a reasoning model thinks as its template lets it."""

    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(_Lenient):
    """``POST /v1/responses``."""

    model: str | None = None
    input: Annotated[list[InputItem], Field(max_length=MAX_MESSAGES)] | None = None  # a string is one user message
    instructions: str | None = None
    previous_response_id: Annotated[str, Field(min_length=1, max_length=256)] | None = None
    store: StrictBool = True
    stream: StrictBool = False
    tools: Annotated[list[FunctionTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | FunctionChoice | None = None
    parallel_tool_calls: StrictBool = True
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    max_output_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=MAX_METADATA)] | None = None
    user: str | None = None
    prompt_cache_key: Label | None = None
    truncation: Literal["disabled"] | None = None  # "auto" (drop the oldest items to fit) is refused
    # radixlm's extras (extra_body), as the chat route takes them
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # the tenant: stored responses and cached KV
    seed: StrictInt | None = None
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0, le=1)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=2)
    ignore_eos: StrictBool | None = None
    max_reasoning_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    priority: Priority = 0  # class under --schedule-policy priority (smaller is more urgent)
    # refused when set: radixlm does not run responses in the background, hold conversations
    # objects, serve prompt templates, or return logprobs here
    background: StrictBool | None = None
    conversation: Any = None
    prompt: Any = None
    top_logprobs: NonNegInt | None = None
    max_tool_calls: StrictInt | None = None

    @model_validator(mode="before")
    @classmethod
    def _typed_items(cls, data: Any) -> Any:
        """A string input is one user message; items without a ``type`` are messages (the easy
        input form), so they validate as one."""
        if isinstance(data, dict) and isinstance(data.get("input"), str):
            data = {**data, "input": [{"type": "message", "role": "user", "content": data["input"]}]}
        elif isinstance(data, dict) and isinstance(data.get("input"), list):
            data = {**data, "input": [{**item, "type": "message"} if isinstance(item, dict) and "type" not in item else item for item in data["input"]]}
        return data

    def refused(self) -> str | None:
        """The first field set that this server does not honour (None: all is well)."""
        for name, unset in (("background", (None, False)), ("conversation", (None,)), ("prompt", (None,)), ("top_logprobs", (None, 0)), ("max_tool_calls", (None,))):
            if getattr(self, name) not in unset:
                return name
        return None
