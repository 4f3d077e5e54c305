"""Hostile sampling parameters (issue 32, findings 6 and 10): what one request may make every
decode step do is bounded, values that would overflow the logits are refused by name, and a row
whose logits still end up non-finite fails alone instead of emitting token 0."""

from __future__ import annotations

import queue

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import radixlm
from radixlm.runtime.constrained.base import GrammarError
from radixlm.runtime.sampler import NON_FINITE, NOTHING_ALLOWED, SamplingRow, accept_draft, sample
from radixlm.runtime.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS_ENTRIES,
    MAX_N,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    REPETITION_PENALTY_RANGE,
    SamplingParams,
)
from radixlm.runtime.stop_regex import StopRegexTooSlow, find_stop_regex, partial_stop_len
from radixlm.runtime.stop_strings import StopScan, StopStrings


# ------------------------------------------------------------------ the stop automaton
def _scan_every_stop(text: str, new_chars: int, stops: list[str]) -> tuple[int, int, str] | None:
    """The reference: of every occurrence of every stop that ends in the last ``new_chars``,
    the one that starts first, and of those the one listed first."""
    hits = []
    for index, s in enumerate(stops):
        i = text.find(s)
        while i >= 0:
            if i + len(s) > len(text) - new_chars:
                hits.append((i, index))
            i = text.find(s, i + 1)
    if not hits:
        return None
    start, index = min(hits)
    return start, start + len(stops[index]), stops[index]


def _old_window_scan(text: str, new_chars: int, stops: list[str]) -> tuple[int, int, str] | None:
    """What output.py did before the automaton (a find per stop over a window per step)."""
    scan_from = max(0, len(text) - new_chars - max(len(s) for s in stops) + 1)
    best = None
    for s in stops:
        i = text.find(s, scan_from)
        if i >= 0 and (best is None or i < best[0]):
            best = (i, i + len(s), s)
    return best


_stops = st.lists(st.text("abc", min_size=1, max_size=5), min_size=1, max_size=6)
_chunks = st.lists(st.text("abc", max_size=4), min_size=1, max_size=12)


@settings(max_examples=400, deadline=None)
@given(stops=_stops, chunks=_chunks)
def test_stop_automaton_agrees_with_a_scan_of_every_stop_at_every_step(stops, chunks):
    scan, text = StopScan(StopStrings(stops)), ""
    for chunk in chunks:
        text += chunk
        assert scan.update(text) == _scan_every_stop(text, len(chunk), stops), (stops, text)
        assert scan.hold() == partial_stop_len(text, stops), (stops, text)


@settings(max_examples=400, deadline=None)
@given(stops=_stops, chunks=_chunks)
def test_stop_automaton_ends_a_request_where_the_old_scan_did(stops, chunks):
    # a request ends at its first stop: up to there the old window scan and the automaton agree
    scan, text = StopScan(StopStrings(stops)), ""
    for chunk in chunks:
        text += chunk
        found = scan.update(text)
        assert found == _old_window_scan(text, len(chunk), stops), (stops, text)
        if found is not None:
            break


class _CountingText(str):
    """A str that counts the characters read from it by index."""

    reads = 0

    def __getitem__(self, key):
        if isinstance(key, int):
            _CountingText.reads += 1
        return super().__getitem__(key)


@pytest.mark.parametrize("stops", [["zq"], ["q" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS, [f"{i:03d}" + "ab" * 100 for i in range(MAX_STOP_STRINGS)]], ids=["one", "limit-alike", "limit-distinct"])
def test_each_step_reads_only_its_new_characters_whatever_the_stops(stops):
    scan, text = StopScan(StopStrings(stops)), ""
    _CountingText.reads = 0
    for step in range(200):
        text += "abq0 "[step % 5] * (1 + step % 3)
        before = _CountingText.reads
        assert scan.update(_CountingText(text)) is None
        assert _CountingText.reads - before == 1 + step % 3  # the characters this step added, once each


def test_stop_automaton_reports_the_earliest_stop_and_ties_by_list_order():
    scan = StopScan(StopStrings(["abc", "ab", "bcd", "b"]))
    assert scan.update("xxab") == (2, 4, "ab")
    scan = StopScan(StopStrings(["bc", "abc"]))
    assert scan.update("zabc") == (1, 4, "abc")  # starts first
    scan = StopScan(StopStrings(["abcd", "ab"]))
    assert scan.update("ab") == (0, 2, "ab")  # a stop within a longer one ends the text at once
    scan = StopScan(StopStrings(["abcd"]))
    assert scan.update("xab") is None and scan.hold() == 2
    assert scan.update("xabcd") == (1, 5, "abcd")


# ------------------------------------------------------------------ the limits
@pytest.mark.parametrize("params, field", [
    ({"stop": [f"s{i}" for i in range(200_000)]}, "stop"),
    ({"stop": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop"),
    ({"stop": "x" * (MAX_STOP_STRING_CHARS + 1)}, "stop"),
    ({"stop_token_ids": [1] * (MAX_STOP_TOKEN_IDS + 1)}, "stop_token_ids"),
    ({"logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS_ENTRIES + 1)}}, "logit_bias"),
    ({"logit_bias": {"5": 1e39}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": -100.5}}, "logit_bias"),
    ({"repetition_penalty": 1e-45}, "repetition_penalty"),
    ({"repetition_penalty": 0.001}, "repetition_penalty"),
    ({"n": MAX_N + 1}, "n"),
], ids=lambda v: v if isinstance(v, str) else None)
def test_values_past_the_limits_are_refused_naming_the_field(params, field):
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict(params, vocab_size=1000)
    assert str(err.value).startswith(field), err.value


def test_values_at_the_limits_are_taken():
    lo, hi = LOGIT_BIAS_RANGE
    sp = SamplingParams.from_dict({
        "stop": ["x" * MAX_STOP_STRING_CHARS] * MAX_STOP_STRINGS,
        "stop_token_ids": list(range(MAX_STOP_TOKEN_IDS)),
        "logit_bias": {str(i): (lo if i % 2 else hi) for i in range(MAX_LOGIT_BIAS_ENTRIES)},
        "repetition_penalty": REPETITION_PENALTY_RANGE[0],
        "n": MAX_N,
        "max_new_tokens": 4095,
    }, vocab_size=2000, context_len=4096)
    assert sp.stop_strings().stops == tuple(sp.stop)  # built while validating, off the engine loop


def test_max_new_tokens_no_context_can_hold_is_refused_naming_it():
    for value in (2**63, 4096):
        with pytest.raises(ValueError, match=r"^max_new_tokens: this model's maximum context length is 4096 tokens"):
            SamplingParams.from_dict({"max_new_tokens": value}, context_len=4096)
    assert SamplingParams.from_dict({"max_new_tokens": 2**63}).max_new_tokens == 2**63  # no context known: no bound


def test_stop_regex_searches_of_one_step_share_one_deadline():
    assert find_stop_regex("aaa", 1, ["a"], deadline=None) is not None
    with pytest.raises(StopRegexTooSlow, match="^stop_regex"):
        find_stop_regex("aaa", 1, ["b", "a"], deadline=0.0)  # a deadline long past: no search starts


# ------------------------------------------------------------------ the sampler's defence in depth
def _row(params: SamplingParams, prompt=(), banned=(), gen=None) -> SamplingRow:
    return SamplingRow(params, list(prompt), [], gen, list(banned), False, 0)


LOGITS = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])


@pytest.mark.parametrize("bad", [
    SamplingParams(logit_bias={3: 1e39}),  # unvalidated: an overflow to +inf
    SamplingParams(repetition_penalty=1e-45),  # divides the seen positive logits to +inf
    SamplingParams(temperature=1e-40),  # finite logits over a tiny temperature: +inf, NaN probabilities
], ids=["logit_bias", "repetition_penalty", "temperature"])
def test_a_row_whose_logits_overflow_is_reported_and_the_others_are_sampled_as_alone(bad):
    good = SamplingParams(temperature=1.0)
    alone = sample(LOGITS, [_row(good, gen=torch.Generator().manual_seed(1))])
    res = sample(LOGITS.repeat(2, 1), [_row(bad, prompt=[0, 1]), _row(good, gen=torch.Generator().manual_seed(1))])
    assert res.failure(0) == NON_FINITE and res.failure(1) is None
    assert res.token_ids[1] == alone.token_ids[0]


def test_a_row_with_every_token_banned_is_reported_but_a_grammar_that_allows_nothing_is_left_to_it():
    p = SamplingParams(temperature=0)
    res = sample(LOGITS, [_row(p, banned=range(6))])
    assert res.failure(0) == NOTHING_ALLOWED
    nothing = torch.zeros(1, 6, dtype=torch.bool)  # a failed grammar's mask: the decoder refuses the pick
    assert sample(LOGITS, [_row(p)], allowed_mask=nothing).failure(0) is None


def test_accept_draft_reports_overflowing_logits():
    for params in (SamplingParams(logit_bias={3: 1e39}), SamplingParams(logit_bias={3: 1e39}, temperature=0)):
        assert accept_draft(LOGITS[0], _row(params), draft=3).failure(0) == NON_FINITE


# ------------------------------------------------------------------ in the engine
@pytest.fixture(scope="module")
def engine(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=8) as eng:
        yield eng


GREEDY = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}


def _final(q: queue.Queue):
    while not (out := q.get(timeout=120)).finished:
        pass
    return out


def test_a_request_whose_logits_overflow_fails_alone_with_a_clear_error(engine):
    expected = engine.generate("The quick", GREEDY)["output_ids"]
    # SamplingParams given as an object are not validated: the sampler is the last line
    bad_params = SamplingParams(max_new_tokens=8, temperature=1.0, ignore_eos=True, logit_bias={5: 1e39})
    sinks = [queue.Queue(), queue.Queue()]
    bad = engine.make_request(sinks[0].put, prompt="Radix trees", sampling_params=bad_params)
    good = engine.make_request(sinks[1].put, prompt="The quick", sampling_params=GREEDY)
    engine.submit(bad)
    engine.submit(good)
    bad_out, good_out = _final(sinks[0]), _final(sinks[1])
    reason = bad_out.meta_info["finish_reason"]
    assert reason["type"] == "abort" and reason["status"] == 500 and reason["message"] == NON_FINITE, reason
    assert bad_out.output_ids == []  # no token 0, no "stop"
    assert good_out.output_ids == expected and good_out.meta_info["finish_reason"]["type"] == "length"
    engine.check_accounting()


def test_slow_stop_regexes_fail_their_request_as_the_clients_error_and_others_go_on(engine):
    # forced to 40 "a"s, "(a|aa)+b" backtracks exponentially; 32 of them share one step's budget
    bad = {"max_new_tokens": 40, "temperature": 0, "regex": "a{40}", "stop_regex": ["(a|aa)+b"] * 32}
    outs = engine.generate(["Write:", "The quick"], [bad, GREEDY])
    reason = outs[0]["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and reason["status"] == 400 and reason["message"].startswith("stop_regex"), reason
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "length" and len(outs[1]["output_ids"]) == 8
    engine.check_accounting()


def test_a_request_at_the_stop_limits_ends_at_its_stop_as_before(engine):
    plain = engine.generate("The quick", dict(GREEDY, max_new_tokens=16))["text"]
    cut = plain[3:5]
    stops = ["\x00" * MAX_STOP_STRING_CHARS] * (MAX_STOP_STRINGS - 1) + [cut]
    out = engine.generate("The quick", dict(GREEDY, max_new_tokens=16, stop=stops))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": cut}
    assert out["text"] == plain[: plain.index(cut)]


def test_a_json_schema_pattern_too_large_to_build_is_refused_at_compile(engine):
    with pytest.raises(GrammarError, match="^json_schema pattern at /properties/a is too large"):
        engine.grammars.compile("json_schema", '{"type": "object", "properties": {"a": {"type": "string", "pattern": "^a{1000000}$"}}}')
    with pytest.raises(GrammarError, match="^json_schema patternProperties key"):
        engine.grammars.compile("json_schema", '{"type": "object", "patternProperties": {"^b{99999}$": {"type": "string"}}}')


# ------------------------------------------------------------------ over HTTP
HOSTILE = [
    ("/generate", {"text": "x", "sampling_params": {"logit_bias": {"5": 1e39}}}, "logit_bias"),
    ("/generate", {"text": "x", "sampling_params": {"repetition_penalty": 1e-45, "temperature": 1}}, "repetition_penalty"),
    ("/generate", {"text": "x", "sampling_params": {"max_new_tokens": 2**63}}, "max_new_tokens"),
    ("/generate", {"text": "x", "sampling_params": {"json_schema": '{"type": "string", "pattern": "^a{1000000}$"}'}}, "json_schema"),
    ("/generate", {"text": "x", "sampling_params": {"stop": [f"s{i}" for i in range(200_000)]}}, "stop"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"5": 101}}, "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": -101}}, "logit_bias"),
]


@pytest.mark.parametrize("path, body, field", HOSTILE, ids=[f"{p.rsplit('/', 1)[-1]}-{f}" for p, _, f in HOSTILE])
def test_each_hostile_value_is_a_400_naming_its_field(tiny_client, path, body, field):
    r = tiny_client.post(path, json=body)
    assert r.status_code == 400, r.text[:300]
    err = r.json()
    assert err["param"] == field and field in err["message"], err


def test_slow_stop_regexes_are_a_400_over_http(tiny_client):
    body = {"text": "Write:", "sampling_params": {"max_new_tokens": 40, "temperature": 0, "regex": "a{40}", "stop_regex": ["(a|aa)+b"] * 32}}
    r = tiny_client.post("/generate", json=body)
    assert r.status_code == 400 and r.json()["message"].startswith("stop_regex"), r.text[:300]
    assert tiny_client.post("/generate", json={"text": "x", "sampling_params": GREEDY}).status_code == 200


def test_one_update_of_a_request_gives_all_its_stop_regex_searches_one_deadline(engine, monkeypatch):
    from radixlm.runtime import stop_regex
    from radixlm.runtime.output import OutputBuilder
    from radixlm.runtime.request import Req

    seen: list = []
    search = stop_regex._search

    def recording(pattern, text, start, deadline, partial=False):
        seen.append(deadline)
        return search(pattern, text, start, deadline, partial)

    monkeypatch.setattr(stop_regex, "_search", recording)
    req = Req("r", [1], SamplingParams.from_dict({"stop_regex": ["zz+", "yy+", "q"]}), sink=lambda out: None, stream=True)
    req.output_ids = engine.tokenize("abc", add_special_tokens=False)
    assert OutputBuilder(engine.tokenizer).update_text(req, final=False) is None
    assert len(seen) == 6 and None not in seen and len(set(seen)) == 1  # 3 searches, 3 partial searches
