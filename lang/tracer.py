"""The tracer: runs a program with placeholder arguments to find the text every call shares.

Unbound arguments become ``Argument`` placeholders; the tracing state renders constant text and
role markers exactly as a real run would, and stops at the first thing whose value differs
between calls (an argument, a generated value, a fork). The text up to there is the program's
shared prefix, which ``run_batch`` and ``Function.cache`` prefill once.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from radixlm.lang import ir
from radixlm.lang.errors import StopTracing
from radixlm.lang.roles import RoleMethods
from radixlm.lang.transcript import Transcript


@dataclass
class Trace:
    """What tracing found: the shared prefix and what ended it."""

    prefix: str
    complete: bool  # the program ran to its end without needing a per-call value
    stopped_at: str | None = None


class Argument(ir.Expr):
    """A placeholder for an argument whose value differs between calls."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(f"argument {object.__getattribute__(self, '_name')!r}")

    __str__ = __format__ = __iter__ = __len__ = __getitem__ = __bool__ = __int__ = __float__ = _stop
    __eq__ = __lt__ = __contains__ = __call__ = __mul__ = __mod__ = _stop
    __hash__ = object.__hash__

    def __getattr__(self, name: str) -> Any:
        self._stop()

    def __repr__(self) -> str:
        return f"Argument({object.__getattribute__(self, '_name')!r})"


class TracingState(RoleMethods):
    """Stands in for ProgramState while tracing; records constant text and role markers only."""

    def __init__(self, template: Callable[[], Any]) -> None:
        self._t = Transcript(template)

    def __iadd__(self, other: Any) -> TracingState:
        for item in ir.as_expr(other).flatten():
            if isinstance(item, ir.Constant):
                self._t.append(item.text)
            elif isinstance(item, ir.RoleBegin):
                self._begin(item.role)
            elif isinstance(item, ir.RoleEnd):
                self._t.end_role(item.role)
            elif isinstance(item, (ir.VarScopeBegin, ir.VarScopeEnd, ir.SetVar)):
                continue
            elif isinstance(item, Argument):
                item._stop()
            else:
                raise StopTracing(getattr(item, "label", type(item).__name__))
        return self

    def _begin(self, role: str) -> None:
        try:
            self._t.begin_role(role)
        except ValueError as exc:
            raise StopTracing(f"{role}(): {exc}") from None

    def _role(self, role: str, expr: Any) -> Any:
        if expr is not None:
            self += ir.ExprList([ir.RoleBegin(role), expr, ir.RoleEnd(role)])
            return None
        return self._block(role)

    @contextmanager
    def _block(self, role: str) -> Iterator[None]:
        self._begin(role)
        yield
        self._t.end_role(role)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Variable scopes add no text."""
        yield

    def __getitem__(self, name: str) -> Any:
        raise StopTracing(f"s[{name!r}]")

    def __getattr__(self, name: str) -> Any:
        raise StopTracing(f"s.{name}")

    @property
    def text(self) -> str:
        """The traced text (the shared prefix)."""
        return self._t.text


def trace_program(func: Callable[..., Any], bound: dict[str, Any], backend: Any) -> Trace:
    """Run ``func``'s body with placeholders for every argument not in ``bound``."""
    params = list(inspect.signature(func).parameters.values())[1:]
    kwargs = {}
    for p in params:
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        kwargs[p.name] = bound[p.name] if p.name in bound else Argument(p.name)
    state = TracingState(backend.get_chat_template if backend is not None else lambda: None)
    try:
        func(state, **kwargs)
    except StopTracing as stop:
        return Trace(state.text, False, str(stop))
    except Exception as exc:  # the program's Python needed a real value: its text diverges here
        return Trace(state.text, False, f"{type(exc).__name__}: {exc}")
    return Trace(state.text, True)
