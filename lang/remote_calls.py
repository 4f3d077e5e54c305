"""How a program state's calls run on an OpenAI-compatible API (the interpreter's hook for ``radixlm.OpenAI``).

- Chat models get the state's chat messages, not its text: a ``gen`` (or ``select``) must open
  an assistant message, because the API writes whole messages.
- ``select`` scores the choices by their prompt logprobs where the server gives them
  (completions with ``echo``), and otherwise generates one choice: constrained to the choices by a
  regex on servers with SGLang's extensions, else free text matched to the nearest choice.
  ``meta_info["select_method"]`` says which way was used.
- A call's LoRA adapter (``gen(lora=...)``, else the run's) goes with every request it sends, as
  the model ``"<model>:<name>"`` (``OpenAI.model_of``).
- ``@function(num_api_spec_tokens=N)`` speculates (see ``radixlm.lang.api_speculation``), except in
  ``run(stream=True)`` and for constrained, ``n`` > 1 or logprob-returning ``gen`` calls, which
  are sent as they are.

Everything else (roles, constant text, variables, a completion model's plain ``gen``) is left
to the interpreter, which sends completion models the text through ``OpenAI.generate``.
"""

from __future__ import annotations

from typing import Any

from radixlm.lang import ir
from radixlm.lang.api_speculation import MessagePlan, Speculation, spec_key, token_ends
from radixlm.lang.choices import ChoiceScores

_NO_USAGE = {"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}
_REGEX_SPECIAL = set("\\.^$*+?{}[]|()/\"")


def choices_regex(choices: list[str]) -> str:
    """A regex that matches exactly one of ``choices``."""
    def escape(text: str) -> str:
        return "".join("\\" + c if c in _REGEX_SPECIAL else {"\n": "\\n", "\t": "\\t", "\r": "\\r"}.get(c, c) for c in text)

    return "(" + "|".join(escape(c) for c in choices) + ")"


def nearest_choice(text: str, choices: list[str]) -> int:
    """The choice ``text`` starts with (the longest), else the one sharing the longest prefix with it."""
    body = text.strip()
    starts = [i for i, c in enumerate(choices) if body.startswith(c)]
    if starts:
        return max(starts, key=lambda i: len(choices[i]))

    def common(c: str) -> int:
        n = 0
        while n < min(len(c), len(body)) and c[n] == body[n]:
            n += 1
        return n

    return max(range(len(choices)), key=lambda i: common(choices[i]))


def span_logprobs(entries: list[tuple], choice: str) -> list[tuple]:
    """The last entries whose token texts cover ``choice`` (a token straddling the prompt counts)."""
    covered, k = 0, len(entries)
    while k > 0 and covered < len(choice):
        k -= 1
        covered += len(entries[k][2] or "")
    span = entries[k:]
    if not span or any(e[0] is None for e in span):
        raise ValueError("select needs text before it (the first token has no logprob)")
    return [tuple(e) for e in span]


class ApiExecution:
    """Runs the calls of one program state that an OpenAI-compatible API needs run its own way."""

    def __init__(self, backend: Any, executor: Any) -> None:
        self.backend = backend
        self.ex = executor
        self.spec: Speculation | None = None
        self.plan: MessagePlan | None = None  # an assistant message whose gen calls are speculated
        self.plan_lora: str | None = None  # the adapter of the plan's gen calls (all the same)

    @property
    def spec_tokens(self) -> int | None:
        """``num_api_spec_tokens`` of the program, or None."""
        return getattr(self.ex, "num_api_spec_tokens", None)

    def run(self, expr: ir.Expr) -> bool:
        """Run ``expr`` when this backend must; False leaves it to the interpreter."""
        if self.plan is not None:
            if self._plan(expr):
                return True
            if isinstance(expr, ir.RoleEnd):
                self._write_plan()
                return False
        chat = self.backend.is_chat_model
        if isinstance(expr, ir.Gen):
            if chat:
                self._chat_gen(expr)
                return True
            if self.spec_tokens and self._speculable(expr):
                self._spec_gen(expr)
                return True
            return False
        if isinstance(expr, ir.Select):
            self._select(expr)
            return True
        if isinstance(expr, ir.RoleBegin) and expr.role == "assistant" and chat and self.spec_tokens and not self.ex.stream:
            self.plan = MessagePlan()  # the interpreter opens the role; its pieces are collected
        return False

    # ------------------------------------------------------------- chat models
    def _params(self, g: ir.Gen) -> dict[str, Any]:
        params = {**self.ex.defaults.sampling_params, **g.sampling_params}
        if g.regex is not None:
            params["regex"] = g.regex
        if g.json_schema is not None:
            params["json_schema"] = g.json_schema
        return params

    def _open_assistant(self, label: str) -> None:
        t = self.ex.transcript
        if t.role != "assistant":
            raise ValueError(f"{label}: {self.backend.model!r} is a chat model, which writes whole assistant messages: put it inside one (s += assistant({label}))")
        if t.text[t.role_start :]:
            hint = "num_api_spec_tokens does not apply with stream=True" if self.spec_tokens and self.ex.stream else "for text before or between gen calls use @function(num_api_spec_tokens=...)"
            raise ValueError(f"{label}: a chat model writes whole assistant messages, so it must come first in its message; {hint}")

    def _chat_gen(self, g: ir.Gen) -> None:
        self._open_assistant(g.label)
        if g.tools:
            raise ValueError(f"{g.label}: gen(tools=...) needs a completion model on the OpenAI backend (is_chat_model=False)")
        params, lora = self._params(g), self.ex.lora_of(g)
        messages = [dict(m) for m in self.ex.transcript.messages]
        if self.ex.stream:
            out = self._stream(g.name, messages, params, lora)
            self._store(g.name, out["text"], out["meta_info"])
            return
        outs = self.backend.request(messages, params, chat=True, lora=lora)
        self.ex._append(outs[0]["text"])
        if g.name is not None:
            if len(outs) > 1:
                self.ex._set_var(g.name, [o["text"] for o in outs], [o["meta_info"] for o in outs])
            else:
                self.ex._set_var(g.name, outs[0]["text"], outs[0]["meta_info"])

    def _stream(self, name: str | None, messages: list[dict[str, Any]], params: dict[str, Any], lora: str | None) -> dict[str, Any]:
        shown, out = 0, None
        for out in self.backend.request_stream(messages, params, chat=True, lora=lora):
            shown = self.ex.show_streamed(name, out["text"], shown)
        return out

    def _store(self, name: str | None, text: str, meta: dict[str, Any]) -> None:
        if name is not None:
            self.ex._set_var(name, text, meta)

    # -------------------------------------------------- speculated chat messages
    def _plan(self, expr: ir.Expr) -> bool:
        plan = self.plan
        if isinstance(expr, ir.Constant):
            plan.add_text(expr.text)
            return True
        if isinstance(expr, ir.Gen) and not (expr.regex or expr.json_schema or expr.tools or self._params(expr).get("n", 1) > 1):
            lora = self.ex.lora_of(expr)
            if plan.has_gen and lora != self.plan_lora:
                raise ValueError(f"{expr.label}: the gen calls of one speculated assistant message must share their LoRA adapter (one request writes the message); {plan.labels[0]} uses {self.plan_lora!r}")
            plan.add_gen(expr.name, self._params(expr), expr.label)
            self.plan_lora = lora
            return True
        if isinstance(expr, ir.RoleEnd):
            return False
        if plan.terms:
            raise ValueError(f"{_label(expr)} cannot run inside an assistant message whose gen calls are speculated (num_api_spec_tokens): only text and unconstrained gen calls can")
        self.plan = None  # the message starts with something else: run it the ordinary way
        return False

    def _write_plan(self) -> None:
        plan, self.plan = self.plan, None
        if not plan.has_gen:
            for term in plan.terms:
                self.ex._append(term.text)
            return
        params = {k: v for k, v in plan.params.items() if k != "stop"}
        params["max_new_tokens"] = max(self.spec_tokens, 1)
        messages = [dict(m) for m in self.ex.transcript.messages]
        tries = 1 if params.get("temperature", 1.0) == 0 else 3
        written = []
        for _ in range(tries):
            out = self.backend.request(messages, params, chat=True, lora=self.plan_lora)[0]
            written.append(out["text"])
            values = plan.match(out["text"])
            if values is not None:
                break
        else:
            raise ValueError(f"the assistant message the model wrote does not fit the program's text around {', '.join(plan.labels)} (num_api_spec_tokens={self.spec_tokens}, {tries} tries); it wrote {written[-1]!r}")
        meta = {**out["meta_info"], "api_spec": "message"}
        for term, value in zip(plan.terms, values):
            self.ex._append(value)
            if term.is_gen:
                self._store(term.name, value, meta)

    # -------------------------------------------- speculated completion gens
    def _speculable(self, g: ir.Gen) -> bool:
        params = self._params(g)
        return not (self.ex.stream or g.regex or g.json_schema or g.tools or g.return_logprob or params.get("n", 1) > 1 or params.get("stop_regex"))

    def _spec_gen(self, g: ir.Gen) -> None:
        params, lora = self._params(g), self.ex.lora_of(g)
        text, stop, limit = self.ex.transcript.text, params.get("stop"), params.get("max_new_tokens", 128)
        key = (spec_key(params), lora)  # another adapter's continuation serves no gen
        if self.spec is not None and self.spec.key == key:
            served = self.spec.serve(text, stop, limit)
            if served is not None:
                self._take(g, served, {**_NO_USAGE, "api_spec": "served"})
                return
        want = max(limit, self.spec_tokens)
        out = self.backend.request(text, {**params, "stop": None, "max_new_tokens": want}, chat=False, logprobs=0, lora=lora)[0]
        meta = out["meta_info"]
        tokens = [e[2] for e in meta.pop("output_token_logprobs", [])]
        meta.pop("text_offset", None)
        finished = (meta.get("finish_reason") or {}).get("type") == "stop"
        self.spec = Speculation(text, out["text"], finished, key, want, token_ends(out["text"], tokens))
        served = self.spec.serve(text, stop, limit, fresh=True)
        if served is None:  # the gen's own token limit cannot be found in the speculated text
            self.spec = None
            plain = self.backend.request(text, params, chat=False, lora=lora)[0]
            self._take(g, (plain["text"], plain["meta_info"]["finish_reason"]), {**plain["meta_info"], **_pair(meta), "api_spec": "generated"})
            return
        self._take(g, served, {**meta, "api_spec": "generated"})

    def _take(self, g: ir.Gen, served: tuple[str, Any], meta: dict[str, Any]) -> None:
        value, finish = served
        self.ex._append(value)
        self._store(g.name, value, {**meta, "finish_reason": finish})

    # ------------------------------------------------------------------ select
    def _select(self, sel: ir.Select) -> None:
        b = self.backend
        if b.is_chat_model:
            self._open_assistant(sel.label)
        elif not b.refused("prompt_logprobs"):
            try:
                index, meta = self._score(sel)
            except ValueError as exc:
                if "refused" not in str(exc):
                    raise
                b.mark_refused("prompt_logprobs")
            else:
                self._chose(sel, index, meta)
                return
        self._chose(sel, *self._generate_choice(sel))

    def _score(self, sel: ir.Select) -> tuple[int, dict[str, Any]]:
        prompt, lora = self.ex.transcript.text, self.ex.lora_of(sel)
        outs = self.backend.request([prompt + c for c in sel.choices], {"max_new_tokens": 0}, chat=False, logprobs=0, echo=True, lora=lora)
        entries = [o["meta_info"].get("output_token_logprobs") or [] for o in outs]
        spans = [span_logprobs(e, c) for e, c in zip(entries, sel.choices)]
        scores = ChoiceScores(list(sel.choices), spans)
        if sel.method.needs_unconditional:
            texts = ["".join(t[2] or "" for t in s) for s in spans]
            alone = self.backend.request(texts, {"max_new_tokens": 0}, chat=False, logprobs=0, echo=True, lora=lora)
            scores.unconditional = [[tuple(t) for t in (o["meta_info"].get("output_token_logprobs") or [])][-len(s) :] for o, s in zip(alone, spans)]
        index, meta = sel.method.decide(scores, sel.temperature)
        meta.update(select_method="scored", prompt_tokens=[len(e) for e in entries], cached_tokens=outs[0]["meta_info"]["cached_tokens"] if outs else 0)
        return index, meta

    def _generate_choice(self, sel: ir.Select) -> tuple[int, dict[str, Any]]:
        b = self.backend
        chat = b.is_chat_model
        prompt: Any = [dict(m) for m in self.ex.transcript.messages] if chat else self.ex.transcript.text
        params: dict[str, Any] = {"max_new_tokens": 4 * max(len(c) for c in sel.choices) + 4, "temperature": sel.temperature}
        lora = self.ex.lora_of(sel)
        how = "generated"
        if b.server_extensions and not b.refused("regex"):
            try:
                out = b.request(prompt, {**params, "regex": choices_regex(sel.choices)}, chat=chat, lora=lora)[0]
                how = "constrained"
            except ValueError as exc:
                if "refused" not in str(exc):
                    raise
                b.mark_refused("regex")
        if how == "generated":
            out = b.request(prompt, params, chat=chat, lora=lora)[0]
        index = nearest_choice(out["text"], sel.choices)
        return index, {**out["meta_info"], "select_method": how, "generated_text": out["text"]}

    def _chose(self, sel: ir.Select, index: int, meta: dict[str, Any]) -> None:
        self.ex._append(sel.choices[index])
        if sel.name is not None:
            self.ex._set_var(sel.name, sel.choices[index], meta)


def _pair(meta: dict[str, Any]) -> dict[str, Any]:
    """The speculation request's usage, kept beside the plain request's."""
    return {"api_spec_request": {k: meta.get(k) for k in ("prompt_tokens", "completion_tokens", "cached_tokens")}}


def _label(expr: ir.Expr) -> str:
    return getattr(expr, "label", None) or type(expr).__name__
