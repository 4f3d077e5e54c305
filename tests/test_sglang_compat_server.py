"""SGLang's /generate vocabulary and routes: n, stop_regex, logit_bias, stream_interval, the
neutral-only parameters, /server_info and /concate_and_append_request; over HTTP, in-process,
and through SGLang's own frontend client (``sglang.RuntimeEndpoint``, package 0.5.23)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

CLIENT_DIR = Path(os.environ.get("RADIXLM_SGLANG_CLIENT", Path(sys.executable).parent.parent / "sglang-client"))
SAMPLED = {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}
PROMPT = "Radix trees share prefixes; caches"


@pytest.fixture(scope="module")
def engine(tiny_llama):
    from radixlm.runtime.engine import Engine

    eng = Engine(model_path=tiny_llama, max_total_tokens=4096)
    yield eng
    eng.shutdown()


@pytest.fixture(scope="module")
def tokenizer(tiny_llama):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama)


def _generate(tiny_client, **body):
    r = tiny_client.post("/generate", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def _refused(tiny_client, sampling_params: dict, field: str) -> str:
    r = tiny_client.post("/generate", json={"text": "x", "sampling_params": sampling_params})
    assert r.status_code == 400, r.text
    err = r.json()
    assert err["param"] == field and field in err["message"], err
    return err["message"]


# ------------------------------------------------------------------ n
def test_n_samples_share_the_prompt_kv_and_seed_plus_j(tiny_client):
    tiny_client.post("/flush_cache")
    outs = _generate(tiny_client, text=PROMPT, sampling_params={**SAMPLED, "n": 3, "seed": 7})
    assert isinstance(outs, list) and len(outs) == 3
    prompt_tokens = outs[0]["meta_info"]["prompt_tokens"]
    assert outs[0]["meta_info"]["cached_tokens"] == 0
    assert [o["meta_info"]["cached_tokens"] for o in outs[1:]] == [prompt_tokens - 1] * 2  # all but the last prompt token
    alone = _generate(tiny_client, text=PROMPT, sampling_params={**SAMPLED, "seed": 8})
    assert outs[1]["output_ids"] == alone["output_ids"]  # sample 1 is seeded seed + 1


@pytest.mark.parametrize("page_size", [1, 4])
def test_n_samples_wait_for_the_first_prompt_kv_however_short_it_is(tiny_llama, page_size):
    from helpers import Driver
    from radixlm.runtime.engine import build_parts
    from radixlm.runtime.server_args import ServerArgs

    d = Driver(build_parts(ServerArgs(model_path=tiny_llama, max_total_tokens=2048, page_size=page_size)))
    prompt = list(range(10, 21))  # 11 tokens: below the usual in-batch sharing threshold
    rids = [d.add(prompt, max_new_tokens=3, temperature=0, ignore_eos=True, n=3) for _ in range(3)]
    d.run()
    cached = [d.results[r].meta_info["cached_tokens"] for r in rids]
    assert cached == [0] + [(len(prompt) - 1) // page_size * page_size] * 2
    assert d.steps <= 3 + 1  # the samples after the first wait one step, not one step each


def test_n_on_a_batch_answers_prompt_major(tiny_client):
    greedy = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
    outs = _generate(tiny_client, text=["The quick brown", "Once upon"], sampling_params={**greedy, "n": 2})
    singles = [_generate(tiny_client, text=t, sampling_params=greedy) for t in ("The quick brown", "Once upon")]
    assert [o["output_ids"] for o in outs] == [singles[0]["output_ids"]] * 2 + [singles[1]["output_ids"]] * 2


def test_n_refused_by_name_below_one_above_capacity_streamed_or_with_a_rid(tiny_client):
    _refused(tiny_client, {"n": 0}, "n")
    _refused(tiny_client, {"n": "two"}, "n")
    assert "at most" in _refused(tiny_client, {"n": 100_000}, "n")
    r = tiny_client.post("/generate", json={"text": "x", "stream": True, "sampling_params": {"n": 2}})
    assert r.status_code == 400 and r.json()["param"] == "n"
    r = tiny_client.post("/generate", json={"text": "x", "rid": "one", "sampling_params": {"n": 2}})
    assert r.status_code == 400 and r.json()["param"] == "rid"


# ------------------------------------------------------------------ stop_regex
def test_stop_regex_trims_the_match_and_reports_the_pattern(tiny_client):
    out = _generate(tiny_client, text="Code: ", sampling_params={"max_new_tokens": 16, "temperature": 0, "regex": "abc1def", "stop_regex": [r"\d", "zz"]})
    assert out["text"] == "abc"
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": r"\d"}
    kept = _generate(tiny_client, text="Code: ", sampling_params={"max_new_tokens": 16, "temperature": 0, "regex": "abc1def", "stop_regex": r"\d", "no_stop_trim": True})
    assert kept["text"] == "abc1"


def test_stop_regex_invalid_or_too_many_or_too_long_is_a_400_naming_it(tiny_client):
    assert "regular expression" in _refused(tiny_client, {"stop_regex": "(unclosed"}, "stop_regex")
    assert "at most 32" in _refused(tiny_client, {"stop_regex": ["a"] * 33}, "stop_regex")
    assert "256-byte" in _refused(tiny_client, {"stop_regex": "a" * 257}, "stop_regex")
    assert "empty string" in _refused(tiny_client, {"stop_regex": "a*"}, "stop_regex")


def test_stream_holds_back_text_a_stop_regex_may_still_trim(tokenizer):
    from radixlm.runtime.output import OutputBuilder
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams

    ids = tokenizer("The answer: 42; done", add_special_tokens=False).input_ids
    req = Req("r", [0], SamplingParams.from_dict({"stop_regex": r"answer: \d+;"}), sink=lambda out: None, stream=True)
    builder, shown = OutputBuilder(tokenizer), []
    for i in range(1, len(ids) + 1):
        req.output_ids = ids[:i]
        matched = builder.update_text(req, final=False)
        shown.append(req.text)
        if matched:
            break
    assert matched == r"answer: \d+;" and req.text == "The "
    assert all("answer" not in t for t in shown)  # never shown, then trimmed


# ------------------------------------------------------------------ other parameters
def test_logit_bias_forces_a_token_on_generate_and_openai(tiny_client, tokenizer):
    out = _generate(tiny_client, text="The quick", sampling_params={"max_new_tokens": 6, "temperature": 0, "logit_bias": {"70": 100}})
    assert out["output_ids"] == [70] * 6
    r = tiny_client.post("/v1/completions", json={"prompt": "The quick", "max_tokens": 4, "temperature": 0, "logit_bias": {"70": 100}})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == tokenizer.decode([70] * 4)
    unbiased = _generate(tiny_client, text="The quick", sampling_params={"max_new_tokens": 6, "temperature": 0})
    assert unbiased["output_ids"] != [70] * 6


def test_logit_bias_bad_ids_or_values_are_a_400_naming_it(tiny_client):
    assert "vocabulary" in _refused(tiny_client, {"logit_bias": {"100000": 1}}, "logit_bias")
    assert "token ids" in _refused(tiny_client, {"logit_bias": {"seven": 1}}, "logit_bias")
    assert "finite" in _refused(tiny_client, {"logit_bias": {"5": "high"}}, "logit_bias")
    r = tiny_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "logit_bias": {"-1": 5}})
    assert r.status_code == 400 and r.json()["param"] == "logit_bias"


def test_stream_interval_streams_every_k_tokens_and_keeps_every_logprob(tiny_client):
    body = {"text": "The quick", "stream": True, "return_logprob": True, "sampling_params": {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True, "stream_interval": 3}}
    with tiny_client.stream("POST", "/generate", json=body) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert [len(c["output_ids"]) for c in chunks] == [3, 6, 7]
    entries = [e for c in chunks for e in c["meta_info"]["output_token_logprobs"]]
    assert [e[1] for e in entries] == chunks[-1]["output_ids"]
    _refused(tiny_client, {"stream_interval": 0}, "stream_interval")


def test_sampling_seed_is_seed_and_a_conflict_is_refused(tiny_client):
    a = _generate(tiny_client, text=PROMPT, sampling_params={**SAMPLED, "sampling_seed": 11})
    b = _generate(tiny_client, text=PROMPT, sampling_params={**SAMPLED, "seed": 11})
    assert a["output_ids"] == b["output_ids"]
    _generate(tiny_client, text=PROMPT, sampling_params={**SAMPLED, "seed": 11, "sampling_seed": 11})
    _refused(tiny_client, {"seed": 1, "sampling_seed": 2}, "sampling_seed")


def test_spaces_between_special_tokens_matches_the_fast_tokenizer_decode(tiny_client, tokenizer):
    texts = []
    for spaces in (True, False):
        out = _generate(tiny_client, text="The quick", sampling_params={"max_new_tokens": 3, "temperature": 0, "skip_special_tokens": False, "spaces_between_special_tokens": spaces, "logit_bias": {"1": 100}})
        assert out["output_ids"] == [1, 1, 1]
        texts.append(out["text"])
    # measured: fast tokenizers decode special tokens the same either way (no spaces added)
    assert texts == [tokenizer.decode([1, 1, 1], skip_special_tokens=False)] * 2 == ["<|im_start|>" * 3] * 2
    _refused(tiny_client, {"spaces_between_special_tokens": "yes"}, "spaces_between_special_tokens")


@pytest.mark.parametrize("name, neutral, other", [("structural_tag", "", '{"type": "x"}'), ("custom_params", {}, {"k": 1}), ("watermark", {"enabled": False}, {"enabled": True})])
def test_unsupported_parameters_take_only_their_neutral_value(tiny_client, name, neutral, other):
    for value in (None, neutral):
        _generate(tiny_client, text="x", sampling_params={"max_new_tokens": 1, name: value})
    assert "not supported" in _refused(tiny_client, {name: other}, name)


# ------------------------------------------------------------------ routes
def test_server_info_is_get_server_info(tiny_client):
    new, old = tiny_client.get("/server_info"), tiny_client.get("/get_server_info")
    assert new.status_code == old.status_code == 200
    assert set(new.json()) == set(old.json()) and new.json()["model_path"] == old.json()["model_path"]


def test_concate_and_append_request_validates_and_changes_nothing(tiny_client):
    r = tiny_client.post("/concate_and_append_request", json={"src_rids": ["a", "b"], "dst_rid": "c"})
    assert r.status_code == 200 and r.json()["success"] is True and r.json()["kv_moved_tokens"] == 0
    for body, field in (({"dst_rid": "c"}, "src_rids"), ({"src_rids": [], "dst_rid": "c"}, "src_rids"), ({"src_rids": ["a", "a"], "dst_rid": "c"}, "src_rids"), ({"src_rids": ["a"]}, "dst_rid"), ({"src_rids": ["a"], "dst_rid": "a"}, "dst_rid"), ({"src_rids": ["a"], "dst_rid": "c", "extra": 1}, "extra")):
        r = tiny_client.post("/concate_and_append_request", json=body)
        assert r.status_code == 400 and r.json()["param"] == field, (body, r.text)
    stats = tiny_client.get("/server_info").json()["stats"]
    assert stats["kv_invariant_holds"] and stats["num_running"] == 0


# ------------------------------------------------------------------ in-process
def test_engine_generate_n_stop_regex_and_neutral_values(engine):
    outs = engine.generate(PROMPT, {**SAMPLED, "n": 2, "sampling_seed": 3})
    assert isinstance(outs, list) and len(outs) == 2 and outs[1]["meta_info"]["cached_tokens"] > 0
    batch = engine.generate([PROMPT, "Once upon"], {"max_new_tokens": 2, "temperature": 0, "n": 3})
    assert len(batch) == 6 and len({tuple(o["output_ids"]) for o in batch[3:]}) == 1
    single = engine.generate("Code: ", {"max_new_tokens": 16, "temperature": 0, "regex": "abc1def", "stop_regex": r"\d"})
    assert single["text"] == "abc" and single["meta_info"]["finish_reason"]["matched"] == r"\d"
    assert engine.generate("x", {"max_new_tokens": 1, "beam_width": 1, "custom_params": None})["output_ids"]
    for params, name in (({"n": 0}, "n"), ({"beam_width": 17}, "beam_width"), ({"stop_regex": "("}, "stop_regex"), ({"logit_bias": {"9999": 1}}, "logit_bias")):
        with pytest.raises(ValueError, match=name):
            engine.generate("x", params)
    with pytest.raises(ValueError, match="n = 1"):
        engine.generate("x", {"n": 2}, stream=True)
    engine.check_accounting()


def test_a_pathological_stop_regex_fails_its_own_request_and_the_engine_goes_on(engine):
    # the output is forced to 40 "a"s: searching "(a|aa)+b" over them backtracks exponentially
    # (Python's re takes seconds at 24 characters); the search's time limit ends that request only
    bad = {"max_new_tokens": 40, "temperature": 0, "regex": "a{40}", "stop_regex": "(a|aa)+b"}
    good = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
    outs = engine.generate(["Write:", "The quick"], [bad, good])
    finish = outs[0]["meta_info"]["finish_reason"]
    assert finish["type"] == "abort" and "stop_regex" in finish["message"] and "ms" in finish["message"]
    assert outs[1]["meta_info"]["finish_reason"]["type"] == "length" and len(outs[1]["output_ids"]) == 8
    engine.check_accounting()


# ------------------------------------------------------------------ SGLang's own client
def test_sglang_runtime_endpoint_runs_programs_against_radixlm_serve(tiny_server):
    if not (CLIENT_DIR / "sglang").is_dir():
        reason = f"SGLang's client is not installed in {CLIENT_DIR} (make setup installs it)"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    program = Path(__file__).with_name("sglang_client_program.py")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(CLIENT_DIR)
    proc = subprocess.run([sys.executable, "-P", str(program), tiny_server.base_url], capture_output=True, text=True, timeout=300, env=env, cwd=str(CLIENT_DIR))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(lines[-1][len("RESULT "):])
    assert out["stop_regex"] == "ab"  # regex "ab1cd" cut at its digit
    assert out["chat_messages"] == ["system", "user", "assistant"] and isinstance(out["chat_reply"], str)
    assert out["select"] in ("yes", "no", "maybe")
    assert len(out["regex"]) == 3 and out["regex"].isdigit()
    assert set(out["json"]) == {"name", "age"} and isinstance(out["json"]["age"], int)
    for mode in ("fork_gather", "fork_concate"):
        assert out[mode]["done"] == "ok"
    assert "Fact 0: " in out["fork_concate"]["text"] and "Fact 1: " in out["fork_concate"]["text"]
    assert out["gen_int"].lstrip("-").isdigit()
    assert out["run_batch"] == ["abc", "xyz", "mno"]
    assert "".join(out["stream_chunks"]) == out["stream_final"] and len(out["stream_final"]) == 3
    assert out["flushed"] and "stats" in out["server_info_keys"]
