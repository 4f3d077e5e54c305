"""Request and response bodies of the HTTP API (pydantic): native /generate and OpenAI's routes.

Request models validate types and ranges so a bad field is a 400 that names it; semantic checks
that need the model (context length, grammar compilation) happen in the handlers.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_validator,
)

from radixlm.runtime.speculative.prediction import MAX_CONTENT_PARTS, ContentPart, Prediction

NonNegInt = Annotated[StrictInt, Field(ge=0)]
Number = StrictInt | StrictFloat
Priority = Annotated[StrictInt, Field(ge=-(2**31), lt=2**31)]  # a request's class: smaller is more urgent
Label = Annotated[str, Field(min_length=1, max_length=256)]  # program names, prompt_cache_key
CacheTTL = Annotated[Number, Field(gt=0, le=86400)]  # seconds a retention hint asks for
BootstrapRoom = Annotated[StrictInt, Field(ge=0, lt=2**63)]  # prefill/decode pairing id
# Counts a request may carry (each is also bounded by the context length once rendered): one
# request must not make the server build millions of objects before it is refused.
MAX_MESSAGES = 4096
MAX_TOOLS = 512


class _Lenient(BaseModel):
    """OpenAI clients send fields we do not use (user, metadata, store ...): ignore those."""

    model_config = ConfigDict(extra="ignore")


# ------------------------------------------------------------------ native
class GenerateRequest(BaseModel):
    """SGLang's native ``/generate`` body."""

    model_config = ConfigDict(extra="forbid")

    text: str | list[str] | None = None
    input_ids: list[StrictInt] | list[list[StrictInt]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    return_logprob: StrictBool = False
    logprob_start_len: StrictInt = Field(default=-1, ge=-1)
    top_logprobs_num: NonNegInt = Field(default=0, le=20)
    return_text_in_logprobs: StrictBool = False
    stream: StrictBool = False
    rid: str | list[str] | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None
    return_cache_info: StrictBool = False  # meta_info.cache_info: where the cached prefix came from
    program: Label | None = None  # origin label recorded on the prefixes this request computes
    prompt_cache_key: Label | None = None  # groups a session's requests
    cache_ttl: CacheTTL | None = None  # soft retention hint for the whole prompt, in seconds
    prediction: str | Prediction | None = None  # expected output: proposed as speculative drafts
    bootstrap_room: BootstrapRoom | None = None  # pairs the halves of a disaggregated request (router-set)
    priority: Priority = 0  # class under --schedule-policy priority: smaller is more urgent
    lora_path: Annotated[str, Field(min_length=1)] | list[Annotated[str, Field(min_length=1)] | None] | None = None  # the LoRA adapter's name (one, or one per prompt)

    @model_validator(mode="after")
    def _one_input(self) -> GenerateRequest:
        if (self.text is None) == (self.input_ids is None):
            raise ValueError("give exactly one of text or input_ids")
        return self


# ------------------------------------------------------------------ OpenAI
class StreamOptions(_Lenient):
    """``stream_options``."""

    include_usage: StrictBool = False


class JsonSchemaFormat(_Lenient):
    """``response_format.json_schema``."""

    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: StrictBool | None = None


class ResponseFormat(_Lenient):
    """``response_format``: text, any JSON object, or a JSON schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.schema_ is None):
            raise ValueError("response_format of type json_schema needs json_schema.schema")
        return self


class FunctionDef(_Lenient):
    """A tool's function: name, description and JSON-schema parameters."""

    name: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")]
    description: str | None = None
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: StrictBool | None = None


class Tool(_Lenient):
    """An entry of ``tools``."""

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedToolChoice(_Lenient):
    """``tool_choice`` naming one function."""

    type: Literal["function"] = "function"
    function: dict[str, str]

    @field_validator("function")
    @classmethod
    def _has_name(cls, v: dict[str, str]) -> dict[str, str]:
        if not v.get("name"):
            raise ValueError("tool_choice.function needs a name")
        return v


class ToolCallFunction(_Lenient):
    """The function part of an assistant's tool call."""

    name: str
    arguments: str


class ToolCall(_Lenient):
    """A tool call in an assistant message."""

    id: str = Field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")
    type: Literal["function"] = "function"
    function: ToolCallFunction


class CacheControl(BaseModel):
    """A message's ``cache_control``: keep the prompt up to the end of this message cached (soft)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["ephemeral"]
    ttl: CacheTTL = 300


class ChatMessage(_Lenient):
    """One chat message."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[ContentPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: str | None = None
    cache_control: CacheControl | None = None

    def text(self) -> str:
        """The message's text (parts joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class _SamplingFields(_Lenient):
    """Sampling fields shared by completions and chat (OpenAI's plus SGLang's extras)."""

    model: str | None = None
    temperature: Number | None = Field(default=None, ge=0, le=2)
    top_p: Number | None = Field(default=None, gt=0, le=1)
    n: StrictInt = Field(default=1, ge=1, le=16)
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: StrictInt | None = None
    presence_penalty: Number | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: Number | None = Field(default=None, ge=-2, le=2)
    # extras, as SGLang and vLLM accept them
    top_k: StrictInt | None = Field(default=None, ge=-1)
    min_p: Number | None = Field(default=None, ge=0, le=1)
    repetition_penalty: Number | None = Field(default=None, gt=0, le=2)
    min_tokens: NonNegInt | None = None
    ignore_eos: StrictBool | None = None
    stop_token_ids: list[NonNegInt] | None = None
    skip_special_tokens: StrictBool | None = None
    regex: str | None = None
    ebnf: str | None = None
    json_schema: dict[str, Any] | str | None = None
    close_json_within_budget: StrictBool | None = None  # JSON output steered to close within max_tokens (default: on)
    logit_bias: dict[str, Number] | None = None
    best_of: StrictInt | None = None
    cache_salt: Annotated[str, Field(min_length=1)] | None = None  # share cached KV only within a salt
    prompt_cache_key: Label | None = None  # OpenAI's session grouping key (shown in cache explanations)
    return_cache_info: StrictBool = False  # each choice gains cache_info (via extra_body)
    prediction: Prediction | None = None  # Predicted Outputs: proposed as speculative drafts
    bootstrap_room: BootstrapRoom | None = None  # pairs the halves of a disaggregated request (router-set)
    priority: Priority = 0  # class under --schedule-policy priority (vLLM's extra field): smaller is more urgent


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: NonNegInt | None = 16
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: StrictBool = False
    suffix: str | None = None
    # vLLM's beam search: n beams, answered as n choices best first
    use_beam_search: StrictBool = False
    length_penalty: Number | None = None
    early_stopping: StrictBool | Literal["never"] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)]
    max_tokens: NonNegInt | None = None
    max_completion_tokens: NonNegInt | None = None
    max_reasoning_tokens: Annotated[StrictInt, Field(ge=1)] | None = None  # reasoning models: the most tokens of the reasoning section
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: StrictBool = True
    chat_template_kwargs: Annotated[dict[str, Any], Field(max_length=32)] | None = None  # extra template variables (Qwen3: enable_thinking)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None  # the template's ``reasoning_effort`` (GPT-OSS)


# ------------------------------------------------------------- responses
class Usage(BaseModel):
    """Token counts of a response."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, Any] | None = None  # cached_tokens (and with KV tiers, cached_tokens_details by tier)


class ErrorResponse(BaseModel):
    """The error body (OpenAI's shape, as SGLang and vLLM send it)."""

    object: Literal["error"] = "error"
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


def new_id(prefix: str) -> str:
    """A fresh response id."""
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    """Unix time for ``created`` fields."""
    return int(time.time())
