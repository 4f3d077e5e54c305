"""Bug 6: llguidance's shared template is rebuilt safely while the engine thread poisons it."""

from __future__ import annotations

import threading

import pytest


@pytest.fixture(scope="module")
def llg(tiny_llama):
    from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend
    from radixlm.runtime.loader import load_model_config
    from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

    tok = load_tokenizer(tiny_llama)
    cfg = load_model_config(tiny_llama)
    return LLGuidanceBackend(tok, cfg.vocab_size, end_token_ids(tok, cfg.eos_token_ids))


def test_a_poisoned_grammar_is_rebuilt_once_however_many_threads_ask(llg):
    grammar = llg.compile("regex", "[a-z]{1,8}")
    build = grammar._build
    builds = []

    def slow_build():
        builds.append(1)
        threading.Event().wait(0.05)  # widen the window in which a second caller could also see "poisoned"
        return build()

    grammar._build = slow_build
    grammar.mark_poisoned()
    start = threading.Barrier(8)
    errors = []

    def make():
        start.wait()
        try:
            assert grammar.matcher().error() is None
        except Exception as exc:
            errors.append(exc)

    threads = [threading.Thread(target=make) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(builds) == 1 and grammar.rebuilds == 1 and not grammar.poisoned


def test_matchers_made_from_many_threads_while_another_poisons_are_all_usable(llg, tiny_llama):
    grammar = llg.compile("regex", "(ab|cd){1,4}")
    stop = threading.Event()
    errors = []

    def poison():
        while not stop.is_set():
            grammar.mark_poisoned()
            stop.wait(0.001)

    def hammer():
        try:
            for _ in range(40):
                m = grammar.matcher()
                assert m.error() is None and not m.is_terminated()
        except Exception as exc:
            errors.append(exc)

    poisoner = threading.Thread(target=poison)
    poisoner.start()
    workers = [threading.Thread(target=hammer) for _ in range(4)]
    for t in workers:
        t.start()
    for t in workers:
        t.join(120)
    stop.set()
    poisoner.join(10)
    assert not errors
    assert grammar.rebuilds >= 1
