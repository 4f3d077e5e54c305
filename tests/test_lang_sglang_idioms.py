"""SGLang programs run unmodified on radixlm: ``import sglang as sgl`` resolves to radixlm.

Each idiom a user of SGLang's frontend writes (fork item assignment, state setitem and
``in``, the REGEX_* constants, ``num_api_spec_tokens``, ``global_config``, ``token_usage``,
``with s.copy()``, positional ``run_batch``, ``gen(n=...)``, ``stop_regex``) runs in-process and
over HTTP on the tiny random-weight Llama.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest


@pytest.fixture
def sgl(monkeypatch: pytest.MonkeyPatch):
    """``sglang`` and its submodules aliased to radixlm's in sys.modules (what a porting user does)."""
    import radixlm.lang.agent  # noqa: F401  (load every submodule a program may import)
    import radixlm.lang.backend.endpoint  # noqa: F401
    import radixlm.lang.interpreter  # noqa: F401

    for name, module in list(sys.modules.items()):
        if name == "radixlm" or name.startswith("radixlm."):
            monkeypatch.setitem(sys.modules, "sglang" + name[len("radixlm"):], module)
    import sglang

    assert sglang is radixlm
    return sglang


def test_fork_item_augmented_assignment_extends_each_branch(sgl, lang_backend):
    @sgl.function
    def tree_of_thought(s, width):
        s += "Think of options.\n"
        forks = s.fork(width)
        for i in range(width):
            forks[i] += f"Option {i}:" + sgl.gen("option", max_tokens=4)
        forks.join()

    state = tree_of_thought.run(width=3, backend=lang_backend, temperature=0)
    assert state.error() is None
    assert isinstance(state["option"], list) and len(state["option"]) == 3


def test_replacing_a_fork_branch_is_refused(sgl, lang_backend):
    @sgl.function
    def swap(s):
        s += "x"
        forks = s.fork(2)
        forks[0] = forks[1]

    with pytest.raises(TypeError, match="cannot be replaced"):
        swap.run(backend=lang_backend)


def test_state_setitem_after_run_and_contains(sgl, lang_backend):
    @sgl.function
    def short(s):
        s += "Say:" + sgl.gen("said", max_tokens=3)

    state = short.run(backend=lang_backend, temperature=0)
    assert "said" in state and "other" not in state and 0 not in state
    state["note"] = {"checked": True}
    assert state["note"] == {"checked": True} and "note" in state
    state["said"] = "overridden"
    assert state["said"] == "overridden"


def test_contains_waits_for_the_call_that_sets_the_variable(sgl, lang_backend):
    @sgl.function
    def slow(s):
        s += "Say:" + sgl.gen("said", max_tokens=8)
        assert "said" in s  # queued, not yet run: ``in`` waits for it
        s["copy"] = s["said"]

    state = slow.run(backend=lang_backend, temperature=0)
    assert state.error() is None and state["copy"] == state["said"]


def test_regex_constants_import_from_the_ir_and_constrain(sgl, lang_backend):
    from sglang.lang.ir import REGEX_BOOL, REGEX_FLOAT, REGEX_INT, REGEX_STR

    @sgl.function
    def typed(s):
        # budgets cover each pattern's longest match (every token is at least one character)
        s += "int:" + sgl.gen("i", regex=REGEX_INT, max_tokens=20)
        s += " float:" + sgl.gen("f", regex=REGEX_FLOAT, max_tokens=27)
        s += " bool:" + sgl.gen("b", regex=REGEX_BOOL, max_tokens=4)
        s += " str:" + sgl.gen("t", regex=REGEX_STR, max_tokens=12)

    state = typed.run(backend=lang_backend, temperature=1.0)
    assert state.error() is None
    for var, rx in (("i", REGEX_INT), ("f", REGEX_FLOAT), ("b", REGEX_BOOL)):
        assert re.fullmatch(rx, state[var]), (var, state[var])
    assert state["t"].startswith('"')  # may be cut at max_tokens, never outside the pattern


def test_num_api_spec_tokens_is_a_no_op_hint_on_local_backends(sgl, lang_backend):
    @sgl.function(num_api_spec_tokens=64)
    def spec(s):
        s += "Say:" + sgl.gen("said", max_tokens=4)

    @sgl.function
    def plain(s):
        s += "Say:" + sgl.gen("said", max_tokens=4)

    assert spec.run(backend=lang_backend, temperature=0)["said"] == plain.run(backend=lang_backend, temperature=0)["said"]


def test_global_config_is_the_default_backend_and_verbosity(sgl, lang_backend, monkeypatch, capsys):
    from sglang.lang.global_config import global_config

    assert global_config is sgl.global_config
    monkeypatch.setattr(global_config, "default_backend", lang_backend)
    monkeypatch.setattr(global_config, "verbosity", 2)

    @sgl.function
    def hello(s):
        s += "Hello from verbosity two:" + sgl.gen("x", max_tokens=2)

    state = hello.run(temperature=0)
    assert sgl.get_default_backend() is lang_backend
    assert state.text() in capsys.readouterr().out


def test_precache_with_tracing_can_be_turned_off(sgl, lang_backend, monkeypatch):
    @sgl.function
    def qa(s, q):
        s += "A shared instruction for every question.\nQ: " + q + "\nA:" + sgl.gen("a", max_tokens=2)

    batch = [{"q": "one"}, {"q": "two"}]
    before = lang_backend.token_usage.requests
    qa.run_batch(batch, backend=lang_backend, temperature=0)
    with_precache = lang_backend.token_usage.requests - before
    monkeypatch.setattr(sgl.global_config, "enable_precache_with_tracing", False)
    before = lang_backend.token_usage.requests
    qa.run_batch(batch, backend=lang_backend, temperature=0)
    assert with_precache == 3 and lang_backend.token_usage.requests - before == 2


def test_token_usage_counts_every_request(sgl, lang_backend):
    @sgl.function
    def two_calls(s):
        s += "Count:" + sgl.gen("a", max_tokens=3) + " and" + sgl.gen("b", max_tokens=3)

    usage = lang_backend.token_usage
    before = (usage.prompt_tokens, usage.completion_tokens, usage.requests)
    state = two_calls.run(backend=lang_backend, temperature=0)
    metas = [state.get_meta_info(v) for v in ("a", "b")]
    assert usage.requests - before[2] == 2
    assert usage.prompt_tokens - before[0] == sum(m["prompt_tokens"] for m in metas)
    assert usage.completion_tokens - before[1] == sum(m["completion_tokens"] for m in metas)
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_copy_as_a_context_manager_joins_its_variables_back(sgl, lang_backend):
    @sgl.function
    def side_note(s):
        s += "Main text."
        with s.copy() as c:
            c += " A side note:" + sgl.gen("note", max_tokens=3)
        s += " Back to the main text."

    state = side_note.run(backend=lang_backend, temperature=0)
    assert state.error() is None
    assert isinstance(state["note"], list) and len(state["note"]) == 1
    assert state.text() == "Main text. Back to the main text."  # the copy's text stays in the copy


def test_run_batch_takes_positional_argument_lists(sgl, lang_backend):
    @sgl.function
    def add(s, a, b, suffix="="):
        s += f"{a}+{b}{suffix}" + sgl.gen("sum", max_tokens=2)

    states = add.run_batch([(1, 2), [3, 4, "=?"], {"a": 5, "b": 6}], backend=lang_backend, temperature=0)
    assert [s.text().split("=")[0] for s in states] == ["1+2", "3+4", "5+6"]
    assert states[1].text().startswith("3+4=?")
    with pytest.raises(TypeError, match="add"):
        add.run_batch([(1, 2, 3, 4)], backend=lang_backend)


def test_gen_n_returns_samples_that_share_the_prompt(sgl, lang_backend):
    @sgl.function
    def sample(s):
        s += "A prompt long enough to be worth sharing between samples: " * 4
        s += sgl.gen("draws", n=3, max_tokens=4, temperature=1.0)
        s += " then:" + sgl.gen("after", max_tokens=2)

    state = sample.run(backend=lang_backend)
    draws, metas = state["draws"], state.get_meta_info("draws")
    assert isinstance(draws, list) and len(draws) == 3 and len(metas) == 3
    assert state.text().startswith("A prompt") and (draws[0] + " then:") in state.text()
    prompt = metas[0]["prompt_tokens"]
    assert all(m["prompt_tokens"] == prompt for m in metas)
    assert sum(m["cached_tokens"] for m in metas) >= 2 * (prompt - 1)  # computed once, shared twice


def test_stop_regex_stops_at_the_first_match_and_trims_it(sgl, lang_backend):
    @sgl.function
    def stops(s):
        s += "Write:" + sgl.gen("w", max_tokens=24, stop_regex=r"[A-Za-z]{2}")

    state = stops.run(backend=lang_backend, temperature=0, ignore_eos=True)
    finish = state.get_meta_info("w")["finish_reason"]
    if finish["type"] == "stop":
        assert not re.search(r"[A-Za-z]{2}", state["w"])
    else:  # the random model never wrote two letters in a row: nothing to trim
        assert finish["type"] == "length" and not re.search(r"[A-Za-z]{2}", state["w"])


def test_a_bad_stop_regex_or_n_names_the_argument(sgl):
    with pytest.raises(ValueError, match="stop_regex"):
        sgl.gen("x", stop_regex="(unclosed")
    with pytest.raises(ValueError, match="n"):
        sgl.gen("x", n=0)
    with pytest.raises(ValueError, match="n > 1"):
        sgl.gen("x", n=2, choices=["a", "b"])


def test_import_radixlm_loads_neither_torch_nor_transformers():
    code = "import sys, radixlm; print('torch' in sys.modules, 'transformers' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.split() == ["False", "False"]
