"""How model families write tool calls in their output, chosen from the chat template.

- ``hermes`` (Hermes, Qwen, and our own system prompt): ``<tool_call>{"name": ..., "arguments":
  {...}}</tool_call>``, one wrapped object per call.
- ``mistral``: ``[TOOL_CALLS]`` then one JSON array of ``{"name", "arguments"}`` objects.
- ``llama3`` (Llama 3.1+ JSON tool calling): the answer is the call itself, ``{"name": ...,
  "parameters": {...}}``, calls separated by ``;``.

These shape ``tool_choice: "auto"`` output, where the model decides whether to call: its grammar
and its parse follow the family. ``required`` and a named function answer in a form of our own
whatever the family (a JSON array of calls, or the arguments object), as SGLang and vLLM do.
"""

from __future__ import annotations

from dataclasses import dataclass

from radixlm.runtime.entrypoints.openai.tool_markers import CLOSE, OPEN


@dataclass(frozen=True)
class ToolFormat:
    """The text that carries tool calls in one family's output."""

    name: str
    open: str  # before each call (hermes) or before the list of calls (mistral); "" (llama3)
    close: str = ""  # after each call (hermes)
    args_key: str = "arguments"  # the key the call object holds its arguments under
    as_list: bool = False  # the calls are one JSON array after ``open`` (mistral)
    separator: str = ""  # between calls written one after another, whitespace aside (llama3: ";")


HERMES = ToolFormat("hermes", OPEN, CLOSE)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", as_list=True)
LLAMA3 = ToolFormat("llama3", "", args_key="parameters", separator=";")
FORMATS = {f.name: f for f in (HERMES, MISTRAL, LLAMA3)}
ARGUMENT_KEYS = ("arguments", "parameters")  # what a parsed call may hold its arguments under


def detect(tokenizer) -> ToolFormat:
    """The format the model's chat template teaches: Mistral's marker, Llama 3's ``ipython`` role
    or ``<|python_tag|>``, else Hermes (also for templates without tools, which get our prompt)."""
    template = getattr(tokenizer, "chat_template", None) or ""
    if not isinstance(template, str):  # a dict of named templates
        template = "".join(str(t) for t in template.values()) if isinstance(template, dict) else str(template)
    if MISTRAL.open in template:
        return MISTRAL
    if "<|python_tag|>" in template or "ipython" in template:
        return LLAMA3
    return HERMES


def marker_ids(tokenizer, fmt: ToolFormat) -> dict[str, int]:
    """The markers of ``fmt`` that the tokenizer has as tokens of their own (added tokens, such
    as Qwen's ``<tool_call>`` or Mistral's ``[TOOL_CALLS]``), by text. The grammar names those
    by id: llguidance treats every added token as special, so a literal would not match it."""
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    by_text = {getattr(tok, "content", None): int(tid) for tid, tok in added.items()}
    return {m: by_text[m] for m in (fmt.open, fmt.close) if m and m in by_text}
