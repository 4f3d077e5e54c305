"""The expression nodes of prompt programs: what ``s += expr`` appends to a state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# SGLang's names for the regexes of ``gen(dtype=...)``; bounded, so a constrained generation always ends.
REGEX_INT = r"-?(0|[1-9][0-9]{0,17})"
REGEX_FLOAT = r"-?(0|[1-9][0-9]{0,15})(\.[0-9]{1,8})?"
REGEX_BOOL = r"(True|False)"
REGEX_STR = r'"[^"\\\x00-\x1f]{0,256}"'


class Expr:
    """A piece of a prompt program; ``a + b`` concatenates pieces and strings."""

    def __add__(self, other: Any) -> ExprList:
        return ExprList([self, as_expr(other)])

    def __radd__(self, other: Any) -> ExprList:
        return ExprList([as_expr(other), self])

    def flatten(self) -> list[Expr]:
        """The leaf expressions, in order."""
        return [self]

    @property
    def var_name(self) -> str | None:
        """The variable this expression sets, if any."""
        return None


def as_expr(value: Any) -> Expr:
    """An expression for ``value`` (a string becomes constant text)."""
    if isinstance(value, Expr):
        return value
    if isinstance(value, str):
        return Constant(value)
    raise TypeError(f"a program state takes strings and expressions, not {type(value).__name__} (convert it with str())")


@dataclass(eq=False)
class Constant(Expr):
    """Literal text."""

    text: str


@dataclass(eq=False)
class ExprList(Expr):
    """A sequence of expressions (nested lists are flattened)."""

    items: list[Expr]

    def __post_init__(self) -> None:
        self.items = [leaf for item in self.items for leaf in as_expr(item).flatten()]

    def flatten(self) -> list[Expr]:
        """The leaf expressions, in order."""
        return list(self.items)


@dataclass(eq=False)
class RoleBegin(Expr):
    """Opens a chat message of ``role`` (renders the template's prefix)."""

    role: str


@dataclass(eq=False)
class RoleEnd(Expr):
    """Closes the open chat message of ``role`` (renders the template's suffix)."""

    role: str


@dataclass(eq=False)
class VarScopeBegin(Expr):
    """Starts capturing the text appended from here into a variable."""

    name: str


@dataclass(eq=False)
class VarScopeEnd(Expr):
    """Stores the text appended since the matching begin as a variable."""

    name: str

    @property
    def var_name(self) -> str | None:
        return self.name


@dataclass(eq=False)
class Gen(Expr):
    """Generate text (optionally constrained) and store it as a variable."""

    name: str | None
    sampling_params: dict[str, Any] = field(default_factory=dict)  # SGLang's keys, given ones only
    regex: str | None = None
    json_schema: str | None = None
    tools: list[Any] | None = None  # radixlm.lang.tools.Tool objects
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    label: str = "gen()"
    return_cache_info: bool | None = None  # meta_info gains the runtime's cache explanation
    lora: str | None = None  # the LoRA adapter's name; None: the run's

    @property
    def var_name(self) -> str | None:
        return self.name


@dataclass(eq=False)
class Select(Expr):
    """Append the choice the model scores highest and store it as a variable."""

    name: str | None
    choices: list[str]
    temperature: float
    method: Any  # a radixlm.lang.choices.ChoicesMethod
    label: str = "select()"
    lora: str | None = None  # the LoRA adapter its choices are scored with; None: the run's

    @property
    def var_name(self) -> str | None:
        return self.name


@dataclass(eq=False)
class SetVar(Expr):
    """Store a value computed in Python (e.g. a tool's result) as a variable."""

    name: str
    value: Any
    meta_info: dict[str, Any] | None = None

    @property
    def var_name(self) -> str | None:
        return self.name


@dataclass(eq=False)
class CachePrefix(Expr):
    """Prefill the state's text with no new tokens, so requests that extend it hit the cache."""


def check_lora(lora: Any, label: str) -> str | None:
    """``lora`` checked as an adapter's name (None: not given); the error names ``lora``."""
    if lora is None:
        return None
    if not isinstance(lora, str):
        raise TypeError(f"{label}: lora must be a LoRA adapter's name (a string), not {type(lora).__name__}")
    if not lora.strip():
        raise ValueError(f"{label}: lora must be a non-empty LoRA adapter name, got {lora!r}")
    return lora


def describe_call(fn: str, first: Any = None, **kwargs: Any) -> str:
    """A short source-like rendering of a DSL call for error messages, e.g. ``gen('x', regex='a+')``."""
    parts = [] if first is None else [repr(first)]
    for key, value in kwargs.items():
        if value is None:
            continue
        text = value.__name__ if isinstance(value, type) else repr(value)
        if len(text) > 80:
            text = text[:77] + "..."
        parts.append(f"{key}={text}")
    return f"{fn}({', '.join(parts)})"
