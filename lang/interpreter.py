"""StreamExecutor: runs one program state's expressions, in order, on its own worker thread.

``s += expr`` only queues work, so a program's Python keeps going while the model generates;
reading a variable waits for just that variable. Each fork branch has its own executor, which
is what lets branches run concurrently (and the runtime batch them).

Failure never leaves anyone waiting: the worker handles every queued item exactly once. After
the first error it records a ProgramError (naming the call and its program line) and skips the
rest, still setting every variable's event and counting every item as done.
"""

from __future__ import annotations

import inspect
import json
import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixlm.lang import ir
from radixlm.lang.choices import score_choices
from radixlm.lang.errors import CallSite, ProgramError
from radixlm.lang.global_config import global_config
from radixlm.lang.tools import CLOSE, OPEN, calls_schema
from radixlm.lang.transcript import Transcript

logger = logging.getLogger(__name__)


@dataclass
class RunDefaults:
    """The sampling settings of one run; a ``gen``'s own arguments override them."""

    sampling_params: dict[str, Any] = field(default_factory=dict)
    return_logprob: bool = False
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    program: str | None = None  # the function's name, sent as the origin label where the backend takes one
    lora: str | None = None  # the LoRA adapter of the run's gen and select calls (each may name its own)


_LOGPROB_KEYS = ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")

def _takes_cache_options(backend) -> bool:
    """True when the backend's ``generate`` passes extra options (program, return_cache_info) on."""
    try:
        params = inspect.signature(backend.generate).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def _takes_lora(method: Any) -> bool:
    """True when a backend method takes ``lora`` (by name or in its ``**kwargs``)."""
    try:
        params = inspect.signature(method).parameters
    except (TypeError, ValueError):
        return False
    return "lora" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def _lora_option(backend: Any, method: str, lora: str | None, label: str) -> dict[str, Any]:
    """``{"lora": lora}`` for the backend's ``method`` (empty for the base model); a backend that
    cannot send an adapter is refused by name rather than silently answering with the base model."""
    if lora is None:
        return {}
    if not _takes_lora(getattr(backend, method)):
        raise ValueError(f"{label}: lora={lora!r} needs a backend that sends LoRA adapters ({type(backend).__name__}.{method} takes no lora)")
    return {"lora": lora}


def _label(expr: ir.Expr) -> str:
    if isinstance(expr, (ir.Gen, ir.Select)):
        return expr.label
    if isinstance(expr, ir.RoleBegin):
        return f"{expr.role}_begin()"
    if isinstance(expr, ir.RoleEnd):
        return f"{expr.role}_end()"
    if isinstance(expr, (ir.VarScopeBegin, ir.VarScopeEnd)):
        return f"var_scope({expr.name!r})"
    if isinstance(expr, ir.SetVar):
        return f"s[{expr.name!r}] = ..."
    if isinstance(expr, ir.CachePrefix):
        return "fork()"
    return "text"


def _output_defaults() -> dict[str, Any]:
    """The detokenization settings of ``global_config`` that differ from the runtime's defaults."""
    params: dict[str, Any] = {}
    if not global_config.skip_special_tokens_in_output:
        params["skip_special_tokens"] = False
    if not global_config.spaces_between_special_tokens_in_out:
        params["spaces_between_special_tokens"] = False
    return params


def _check_finished(out: dict[str, Any]) -> None:
    finish = out["meta_info"].get("finish_reason") or {}
    if finish.get("type") == "abort":
        raise RuntimeError(f"the runtime aborted the request: {finish.get('message')}")


def _program_hook(backend: Any, executor: StreamExecutor) -> Any:
    """The backend's own runner of some calls (``program_hook``: an API backend's), or None."""
    make = getattr(backend, "program_hook", None)
    return make(executor) if make is not None else None


class StreamExecutor:
    """Executes the expressions submitted to one program state."""

    def __init__(self, backend, defaults: RunDefaults, stream: bool = False, transcript: Transcript | None = None, variables: dict | None = None, meta_info: dict | None = None, num_api_spec_tokens: int | None = None) -> None:
        self.backend = backend
        self.num_api_spec_tokens = num_api_spec_tokens
        self.hook = _program_hook(backend, self)
        self.defaults = defaults
        self.stream = stream
        self.transcript = transcript or Transcript(backend.get_chat_template if backend is not None else lambda: None)
        self.variables: dict[str, Any] = dict(variables or {})
        self.meta_info: dict[str, Any] = dict(meta_info or {})
        self.fork_start = len(self.transcript.text)
        self.set_since_fork: list[str] = []
        self.error: ProgramError | None = None
        self.children: list[StreamExecutor] = []
        self.cond = threading.Condition()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._outstanding = 0
        self._ended = self.finished = self._cancelled = False
        self._thread: threading.Thread | None = None
        self._var_events: dict[str, threading.Event] = {}
        self._failed: set[str] = set()
        self._scopes: dict[str, int] = {}

    # ------------------------------------------------------------ submitting
    def submit(self, expr: Any, site: CallSite | None) -> None:
        """Queue an expression (or string) for the worker."""
        items = ir.as_expr(expr).flatten()
        with self.cond:
            if self._ended:
                raise RuntimeError("this program state has finished; use fork() or copy() to continue from it")
            for item in items:
                event = None
                if item.var_name is not None:
                    event = self._var_events[item.var_name] = threading.Event()
                self._outstanding += 1
                self._queue.put((item, site, event))
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="radixlm-program", daemon=True)
                self._thread.start()
            self.cond.notify_all()

    @property
    def ended(self) -> bool:
        """True once no more expressions may be submitted (the program returned)."""
        return self._ended

    def sync(self) -> None:
        """Wait until everything submitted so far has run (or been skipped after an error)."""
        with self.cond:
            self.cond.wait_for(lambda: self._outstanding == 0)

    def end(self) -> None:
        """No more submissions: let the worker exit once the queue drains (and end the branches)."""
        with self.cond:
            if not self._ended:
                self._ended = True
                if self._thread is None:
                    self.finished = True
                else:
                    self._queue.put(None)
                self.cond.notify_all()
            children = list(self.children)
        for child in children:
            child.end()

    def cancel(self) -> None:
        """Skip whatever is still queued (the program's Python failed)."""
        self._cancelled = True

    # -------------------------------------------------------------- reading
    def get_var(self, name: str) -> Any:
        """The variable's value once its producer has run; raises the program's error if it failed."""
        event = self._var_events.get(name)
        if event is not None:
            event.wait()
        if name in self._failed and self.error is not None:
            raise self.error.again()
        if name in self.variables:
            return self.variables[name]
        self.sync()
        if name in self.variables:
            return self.variables[name]
        if self.error is not None:
            raise self.error.again()
        raise KeyError(f"no variable {name!r} (variables: {', '.join(sorted(self.variables)) or 'none'})")

    def has_var(self, name: str) -> bool:
        """True when ``name`` is set, after waiting for a queued call that sets it."""
        event = self._var_events.get(name)
        if event is not None:
            event.wait()
        return name in self.variables

    def set_var_now(self, name: str, value: Any) -> None:
        """Set a variable of a finished state directly (nothing is queued any more)."""
        self.sync()
        self._set_var(name, value)

    def var_done(self, name: str) -> bool:
        """True once the latest producer of ``name`` has run (or the program has finished)."""
        event = self._var_events.get(name)
        return self.finished or (event is not None and event.is_set())

    # ------------------------------------------------------------- branching
    def fork(self, size: int, site: CallSite | None) -> list[StreamExecutor]:
        """``size`` executors continuing from this one's text; the shared text is prefilled first."""
        precache = size > 1 and global_config.enable_parallel_encoding
        if precache and not self._ended:
            self.submit(ir.CachePrefix(), site)
        self.sync()
        if precache and self._ended and self.error is None and self.transcript.text:
            _check_finished(self._cache_prefix(self.transcript.text))  # forking a finished state
        if self.error is not None:
            raise self.error.again()
        branches = [StreamExecutor(self.backend, self.defaults, self.stream, self.transcript.copy(), self.variables, self.meta_info, self.num_api_spec_tokens) for _ in range(size)]
        with self.cond:
            self.children.extend(branches)
        return branches

    # ------------------------------------------------------------ the worker
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                break
            expr, site, event = item
            try:
                if self.error is None and not self._cancelled:
                    self._execute(expr)
                elif expr.var_name is not None:
                    self._failed.add(expr.var_name)
            except BaseException as exc:
                self.error = ProgramError(_label(expr), site, exc)
                logger.debug("program call failed: %s", self.error)
                if expr.var_name is not None:
                    self._failed.add(expr.var_name)
            finally:
                if event is not None:
                    event.set()
                with self.cond:
                    self._outstanding -= 1
                    self.cond.notify_all()
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def _execute(self, expr: ir.Expr) -> None:
        if self.hook is not None and self.hook.run(expr):
            return
        t = self.transcript
        if isinstance(expr, ir.Constant):
            self._append(expr.text)
        elif isinstance(expr, ir.RoleBegin):
            t.begin_role(expr.role)
        elif isinstance(expr, ir.RoleEnd):
            t.end_role(expr.role)
        elif isinstance(expr, ir.Gen):
            self._gen_call(expr) if expr.tools else self._gen(expr)
        elif isinstance(expr, ir.Select):
            self._select(expr)
        elif isinstance(expr, ir.VarScopeBegin):
            self._scopes[expr.name] = len(t.text)
        elif isinstance(expr, ir.VarScopeEnd):
            if expr.name not in self._scopes:
                raise ValueError(f"var_scope({expr.name!r}) ends without a begin")
            self._set_var(expr.name, t.text[self._scopes.pop(expr.name) :])
        elif isinstance(expr, ir.SetVar):
            self._set_var(expr.name, expr.value, expr.meta_info)
        elif isinstance(expr, ir.CachePrefix):
            if t.text:
                _check_finished(self._cache_prefix(t.text))
        else:
            raise TypeError(f"cannot run {type(expr).__name__} (is it a traced placeholder?)")

    def _append(self, text: str) -> None:
        with self.cond:
            self.transcript.append(text)
            self.cond.notify_all()

    def _set_var(self, name: str, value: Any, meta: dict[str, Any] | None = None) -> None:
        with self.cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta
            self.set_since_fork.append(name)
            self.cond.notify_all()

    def lora_of(self, expr: ir.Gen | ir.Select) -> str | None:
        """The LoRA adapter ``expr`` runs with: its own, else the run's (None: the base model)."""
        return expr.lora if expr.lora is not None else self.defaults.lora

    def _cache_prefix(self, text: str) -> dict[str, Any]:
        """Prefill ``text`` under the run's adapter (KV is cached per adapter: the base model's would not serve it)."""
        return self.backend.cache_prefix(text, **_lora_option(self.backend, "cache_prefix", self.defaults.lora, "fork()"))

    def _options(self, g: ir.Gen) -> dict[str, Any]:
        d = self.defaults

        def pick(own: Any, default: Any, fallback: Any) -> Any:
            return own if own is not None else (default if default is not None else fallback)

        options = {
            "return_logprob": pick(g.return_logprob, d.return_logprob, False),
            "logprob_start_len": pick(g.logprob_start_len, d.logprob_start_len, -1),
            "top_logprobs_num": pick(g.top_logprobs_num, d.top_logprobs_num, 0),
            "return_text_in_logprobs": pick(g.return_text_in_logprobs, d.return_text_in_logprobs, False),
        }
        takes_labels = _takes_cache_options(self.backend)
        if g.return_cache_info:
            if not takes_labels:
                raise ValueError(f"{g.label}: return_cache_info needs a radixlm backend (an Engine or a radixlm server)")
            options["return_cache_info"] = True
        if d.program is not None and takes_labels:
            options["program"] = d.program
        options.update(_lora_option(self.backend, "generate", self.lora_of(g), g.label))
        return options

    def _gen(self, g: ir.Gen) -> None:
        params = {**_output_defaults(), **self.defaults.sampling_params, **g.sampling_params}
        if g.regex is not None:
            params["regex"] = g.regex
        if g.json_schema is not None:
            params["json_schema"] = g.json_schema
        prompt, options = self.transcript.text, self._options(g)
        if params.get("n", 1) > 1:  # k samples sharing the prompt: the text goes on with the first
            outs = self.backend.generate(prompt, params, **options)
            for out in outs:
                _check_finished(out)
            self._append(outs[0]["text"])
            if g.name is not None:
                self._set_var(g.name, [o["text"] for o in outs], [o["meta_info"] for o in outs])
            return
        if self.stream:
            out = self._stream(g.name, prompt, params, options)
        else:
            out = self.backend.generate(prompt, params, **options)
            _check_finished(out)
            self._append(out["text"])
        if g.name is not None:
            self._set_var(g.name, out["text"], out["meta_info"])

    def _stream(self, name: str | None, prompt: str, params: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
        shown, out = 0, None
        logprobs: dict[str, list] = {}  # streamed chunks carry only the entries new since the last
        for out in self.backend.generate_stream(prompt, params, **options):
            for key in _LOGPROB_KEYS:
                if out["meta_info"].get(key) is not None:
                    logprobs.setdefault(key, []).extend(out["meta_info"][key])
            shown = self.show_streamed(name, out["text"], shown)
        if out is None:
            raise RuntimeError("the stream ended without output")
        _check_finished(out)
        return {**out, "meta_info": {**out["meta_info"], **logprobs}}

    def show_streamed(self, name: str | None, text: str, shown: int) -> int:
        """Append what a stream's text (so far) adds past ``shown`` and set ``name`` to it; returns its length."""
        with self.cond:
            self.transcript.append(text[shown:])
            if name is not None:
                self.variables[name] = text
            self.cond.notify_all()
        return len(text)

    def _gen_call(self, g: ir.Gen) -> None:
        run_level = {k: v for k, v in self.defaults.sampling_params.items() if k not in ("stop", "stop_regex", "n")}  # a run's stops must not cut the call, nor its n split it
        params = {**run_level, **g.sampling_params}
        params["json_schema"] = json.dumps(calls_schema(g.tools))
        self._append(OPEN)
        out = self.backend.generate(self.transcript.text, params, **self._options(g))
        _check_finished(out)
        reason = out["meta_info"].get("finish_reason") or {}
        if reason.get("type") == "length" and not reason.get("closed_within_budget"):  # a call shortened to fit is whole
            raise ValueError(f"the tool call was cut off at max_tokens={params.get('max_new_tokens')}: {out['text']!r}; raise max_tokens")
        call = json.loads(out["text"])
        self._append(out["text"] + CLOSE)
        if g.name is not None:
            self._set_var(g.name, call, out["meta_info"])

    def _select(self, sel: ir.Select) -> None:
        scores, metas = score_choices(self.backend, self.transcript.text, sel.choices, sel.method, **_lora_option(self.backend, "prefill", self.lora_of(sel), sel.label))
        index, meta = sel.method.decide(scores, sel.temperature)
        meta["prompt_tokens"] = [m["prompt_tokens"] for m in metas]
        meta["cached_tokens"] = [m["cached_tokens"] for m in metas]
        self._append(sel.choices[index])
        if sel.name is not None:
            self._set_var(sel.name, sel.choices[index], meta)


def wait_text(ex: StreamExecutor, seen: int, current: Callable[[], str], done: Callable[[], bool]) -> tuple[str, bool]:
    """Block until ``current()`` grows past ``seen`` or ``done()``; returns (new text, done)."""
    with ex.cond:
        ex.cond.wait_for(lambda: len(current()) > seen or done())
        return current()[seen:], done()
