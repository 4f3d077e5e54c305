"""ProgramState (what a program's ``s`` is) and ProgramStateGroup (what ``s.fork(n)`` returns)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.lang import ir
from radixlm.lang.errors import ProgramError, caller_site
from radixlm.lang.interpreter import StreamExecutor, wait_text
from radixlm.lang.roles import RoleMethods


class ProgramState(RoleMethods):
    """The state of a running program: its text, chat messages and named variables."""

    def __init__(self, executor: StreamExecutor, body: threading.Thread | None = None) -> None:
        self._ex = executor
        self._body = body  # the thread running the program's Python, for ``run(stream=True)``
        self._group: ProgramStateGroup | None = None  # set on a ``copy()``, joined when its ``with`` ends
        self.ret_value: Any = None

    def _settle(self) -> None:
        """From outside a streaming program's own thread, wait until its Python has finished."""
        if self._body is not None and threading.current_thread() is not self._body:
            self._body.join()

    # ---------------------------------------------------------- appending
    def __iadd__(self, other: Any) -> ProgramState:
        self._ex.submit(other, caller_site())
        return self

    def _role(self, role: str, expr: Any) -> Any:
        site = caller_site()
        if expr is not None:
            self._ex.submit(ir.ExprList([ir.RoleBegin(role), expr, ir.RoleEnd(role)]), site)
            return None
        return self._role_block(role, site)

    @contextmanager
    def _role_block(self, role: str, site: Any) -> Iterator[None]:
        self._ex.submit(ir.RoleBegin(role), site)
        yield
        self._ex.submit(ir.RoleEnd(role), caller_site())

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """Store the text appended inside the ``with`` block as variable ``name``."""
        self._ex.submit(ir.VarScopeBegin(name), caller_site())
        yield
        self._ex.submit(ir.VarScopeEnd(name), caller_site())

    # ------------------------------------------------------------- reading
    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: object) -> bool:
        """True when variable ``name`` is set (waits for a queued call that sets it)."""
        return isinstance(name, str) and self._ex.has_var(name)

    def get_var(self, name: str) -> Any:
        """The value of variable ``name`` (waits for the call that sets it)."""
        if name not in self._ex.variables and not self._ex.var_done(name):
            self._settle()
        return self._ex.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        """Set variable ``name`` (in order with the program's other calls; at once on a finished state)."""
        if not isinstance(name, str):
            raise TypeError(f"variable names are strings, not {type(name).__name__}")
        if not self._ex.ended:
            try:
                self._ex.submit(ir.SetVar(name, value), caller_site())
                return
            except RuntimeError:  # the program returned meanwhile
                pass
        self._settle()
        self._ex.set_var_now(name, value)

    def get_meta_info(self, name: str) -> dict[str, Any] | None:
        """The runtime's meta_info of the call that set ``name`` (tokens, cache hits, logprobs)."""
        self.get_var(name)
        return self._ex.meta_info.get(name)

    def text(self) -> str:
        """The whole text so far (waits for queued calls)."""
        self._settle()
        self._ex.sync()
        return self._ex.transcript.text

    def messages(self) -> list[dict[str, Any]]:
        """The chat messages so far, as ``{"role", "content"}`` dicts."""
        self._settle()
        self._ex.sync()
        return [dict(m) for m in self._ex.transcript.messages]

    def sync(self) -> None:
        """Wait until every call submitted so far has run."""
        self._settle()
        self._ex.sync()

    def error(self) -> BaseException | None:
        """The first error of this state (after waiting for its calls), or None."""
        self._settle()
        self._ex.sync()
        return self._ex.error

    # ----------------------------------------------------------- branching
    def fork(self, size: int = 1) -> ProgramStateGroup:
        """``size`` states continuing from this one; with several, the shared text is cached first."""
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be a positive integer, got {size!r}")
        branches = self._ex.fork(size, caller_site())
        return ProgramStateGroup([ProgramState(b) for b in branches], self)

    def copy(self) -> ProgramState:
        """One independent state continuing from this one.

        Used as ``with s.copy() as c:`` (SGLang's form), leaving the block joins it back: the
        variables ``c`` set become one-element lists on ``s``.
        """
        group = self.fork(1)
        branch = group[0]
        branch._group = group
        return branch

    def __enter__(self) -> ProgramState:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        group, self._group = self._group, None
        if group is None:
            return
        if exc_type is None:
            group.join()
        else:  # the block failed: end the copy without raising over the block's own error
            self._ex.end()

    # ----------------------------------------------------------- streaming
    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is generated (with ``run(stream=True)``), or of one variable; else all at once."""
        ex = self._ex
        if not ex.stream:
            yield self.text() if var_name is None else str(self.get_var(var_name))
            return
        if var_name is None:
            current: Callable[[], str] = lambda: ex.transcript.text  # noqa: E731
            done: Callable[[], bool] = lambda: ex.finished  # noqa: E731
        else:
            current = lambda: v if isinstance(v := ex.variables.get(var_name, ""), str) else ""  # noqa: E731
            done = lambda: ex.var_done(var_name)  # noqa: E731
        seen = 0
        while True:
            chunk, finished = wait_text(ex, seen, current, done)
            if chunk:
                seen += len(chunk)
                yield chunk
            elif finished:
                return

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """The asyncio form of ``text_iter``."""
        it = self.text_iter(var_name)
        end = object()
        while True:
            chunk = await asyncio.to_thread(next, it, end)
            if chunk is end:
                return
            yield chunk

    def __aiter__(self) -> AsyncIterator[str]:
        return self.text_async_iter()

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The branches of a fork: ``group += expr`` appends to each, ``join()`` gathers them."""

    def __init__(self, states: list[ProgramState], source: ProgramState) -> None:
        self.states = states
        self.source = source

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: Any) -> None:
        """Accept ``group[i] += expr`` (Python stores the branch back); replacing a branch is an error."""
        if value is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced; extend one with group[i] += expr")

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        site = caller_site()
        if callable(other) and not isinstance(other, ir.Expr):
            parts = [other(i) for i in range(len(self.states))]
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"{len(other)} expressions for {len(self.states)} branches")
            parts = list(other)
        else:
            parts = [other] * len(self.states)
        for state, part in zip(self.states, parts):
            state._ex.submit(part, site)
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch; gather their new variables into lists on the source state.

        ``mode="concate_and_append"`` appends each branch's new text to the source instead.
        If a branch failed, its error is raised once all branches have finished.
        """
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(f"join mode must be 'gather_variable' or 'concate_and_append', got {mode!r}")
        for state in self.states:
            state._ex.sync()
        failed = next((s._ex.error for s in self.states if s._ex.error is not None), None)
        src = self.source._ex
        src.sync()
        try:
            if failed is not None:
                raise failed.again() if isinstance(failed, ProgramError) else failed
            if mode == "gather_variable":
                names = list(dict.fromkeys(n for s in self.states for n in s._ex.set_since_fork))
                for name in names:
                    values = [s._ex.variables.get(name) for s in self.states]
                    metas = [s._ex.meta_info.get(name) for s in self.states]
                    src.submit(ir.SetVar(name, values, {"branches": metas}), caller_site())
            else:
                text = "".join(s._ex.transcript.text[s._ex.fork_start :] for s in self.states)
                src.submit(text, caller_site())
        finally:
            for state in self.states:
                state._ex.end()
