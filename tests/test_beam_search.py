"""Beam search (``beam_width`` > 1): the beams and scores equal a reference beam search run here
on transformers' own logits, and transformers' ``generate(num_beams=...)``; beams share their
prefix's KV through the radix cache; stops, budgets and bad options; ``/generate`` and
``/v1/completions`` (``use_beam_search``)."""

from __future__ import annotations

import json
import math
import re
import time

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM

import radixlm
from radixlm.runtime.beam_search import BeamSearch
from radixlm.runtime.engine.beam import BeamAborted
from radixlm.runtime.stop_regex import StopRegexTooSlow

PROMPT = [5, 17, 42, 99, 7, 250, 31, 64]


@pytest.fixture(scope="module")
def hf_model(tiny_llama):
    return AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with radixlm.Engine(tiny_llama, max_total_tokens=4096, num_threads=1) as e:
        yield e


def reference_beam_search(model, prompt: list[int], width: int, max_new: int, length_penalty: float, early_stopping, eos: set[int]) -> list[tuple[list[int], float]]:
    """Beam search written out plainly over transformers' full log-softmax (no KV cache):
    transformers' ranking of max(2, 1 + #eos) * width continuations, finished hypotheses from the
    first width ranks, its early-stopping rules. Returns (output tokens, score), best first."""
    keep = max(2, 1 + len(eos)) * width
    beams: list[tuple[list[int], float]] = [([], 0.0)]
    finished: list[tuple[list[int], float]] = []
    improvable = True
    with torch.no_grad():
        for step in range(1, max_new + 1):
            cands = []
            for tokens, score in beams:
                logits = model(torch.tensor([prompt + tokens])).logits[0, -1].float()
                lp = torch.log_softmax(logits, dim=-1)
                for t in range(lp.shape[0]):
                    cands.append((score + lp[t].item(), tokens + [t]))
            cands.sort(key=lambda c: c[0], reverse=True)
            cands = cands[:keep]
            ends = [seq[-1] in eos or step >= max_new for _, seq in cands]
            full = len(finished) == width and early_stopping is True
            if not full and improvable:
                for rank, ((score, seq), end) in enumerate(zip(cands, ends)):
                    if end and rank < width:
                        finished.append((seq, score / step**length_penalty))
                finished = sorted(finished, key=lambda f: f[1], reverse=True)[:width]
            beams = [(seq, score) for (score, seq), end in zip(cands, ends) if not end][:width]
            if improvable and len(finished) == width and beams:
                best_len = max_new if early_stopping == "never" and length_penalty > 0 else step
                improvable = beams[0][1] / best_len**length_penalty > finished[-1][1]
            if not beams or not improvable or (len(finished) == width and early_stopping is True):
                break
    return finished


@pytest.mark.parametrize("width", [1, 2, 3, 4])
def test_beams_and_scores_equal_a_reference_beam_search_on_transformers_logits(engine, hf_model, width):
    eos = set(engine.end_ids)
    want = reference_beam_search(hf_model, PROMPT, width, 6, 1.0, False, eos)
    got = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "beam_width": width, "temperature": 0})  # width 1: greedy
    got = got if isinstance(got, list) else [got]
    assert [o["output_ids"] for o in got] == [seq for seq, _ in want]
    if width == 1:
        return  # beam_width 1 is plain (greedy) decoding: no beam scores
    for out, (_, score) in zip(got, want):
        assert math.isclose(out["meta_info"]["beam_score"], score, rel_tol=1e-4, abs_tol=1e-4)
    scores = [o["meta_info"]["beam_score"] for o in got]
    assert scores == sorted(scores, reverse=True), "best first"


@pytest.mark.parametrize(("length_penalty", "early_stopping"), [(1.0, False), (0.0, "never"), (2.0, True), (-1.0, False)])
def test_beams_equal_transformers_generate_with_num_beams(engine, hf_model, length_penalty, early_stopping):
    width, max_new = 3, 7
    with torch.no_grad():
        ref = hf_model.generate(
            torch.tensor([PROMPT]),
            attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long),
            num_beams=width,
            num_return_sequences=width,
            do_sample=False,
            max_new_tokens=max_new,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            output_scores=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    params = {"max_new_tokens": max_new, "beam_width": width, "length_penalty": length_penalty, "early_stopping": early_stopping}
    got = engine.generate(input_ids=PROMPT, sampling_params=params)
    eos = set(engine.end_ids)
    for out, seq, score in zip(got, ref.sequences, ref.sequences_scores):
        want = seq[len(PROMPT) :].tolist()
        while want and want[-1] == 0 and 0 not in eos and len(want) > len(out["output_ids"]):
            want.pop()  # transformers pads shorter hypotheses
        assert out["output_ids"] == want
        assert math.isclose(out["meta_info"]["beam_score"], score.item(), rel_tol=1e-4, abs_tol=1e-4)


def test_beams_that_end_on_a_stop_token_equal_transformers_with_that_token_as_eos(engine, hf_model):
    width, max_new = 3, 8
    free = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": max_new, "beam_width": width})
    stop_id = free[1]["output_ids"][3]  # a token the beams reach: some of them end there now
    eos = sorted(set(engine.end_ids) | {stop_id})
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([PROMPT]), attention_mask=torch.ones(1, len(PROMPT), dtype=torch.long), num_beams=width, num_return_sequences=width, do_sample=False, max_new_tokens=max_new, eos_token_id=eos, pad_token_id=eos[0], output_scores=True, return_dict_in_generate=True)
    got = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": max_new, "beam_width": width, "stop_token_ids": [stop_id]})
    assert any(o["meta_info"]["finish_reason"]["type"] == "stop" for o in got), "no beam ended on the stop token"
    for out, seq, score in zip(got, ref.sequences, ref.sequences_scores):
        assert out["output_ids"] == seq[len(PROMPT) :].tolist()[: len(out["output_ids"])]
        assert out["output_ids"][-1] in eos or len(out["output_ids"]) == max_new
        assert math.isclose(out["meta_info"]["beam_score"], score.item(), rel_tol=1e-4, abs_tol=1e-4)


def test_beam_search_class_follows_transformers_ranking_on_a_made_up_vocabulary():
    """Three tokens, token 2 ends: hand-computed rounds."""
    lp = {(): [math.log(0.5), math.log(0.3), math.log(0.2)], (0,): [math.log(0.1), math.log(0.1), math.log(0.8)], (1,): [math.log(0.6), math.log(0.3), math.log(0.1)]}
    search = BeamSearch(2, 3, 1.0, True, 1, lambda toks: {"type": "stop", "matched": 2} if toks[-1] == 2 else None)

    def proposals():
        return [sorted(enumerate(lp.get(tuple(b.tokens), [math.log(1 / 3)] * 3)), key=lambda x: -x[1])[:4] for b in search.beams]

    search.advance(proposals())  # candidates: 0 (.5), 1 (.3), 2 (.2, ends: rank 2 >= width, not kept)
    assert [b.tokens for b in search.beams] == [[0], [1]] and search.finished == []
    search.advance(proposals())  # 0,2 (.4, ends, rank 0), 1,0 (.18), 0,0 (.05), 0,1 (.05)
    assert [h.tokens for h in search.finished] == [[0, 2]]
    assert math.isclose(search.finished[0].score, math.log(0.4) / 2)
    assert [b.tokens for b in search.beams] == [[1, 0], [1, 1]]


@pytest.mark.parametrize(("early_stopping", "best"), [(False, [2]), ("never", [0, 1, 2])])
def test_early_stopping_false_stops_once_the_live_beam_cannot_win_at_its_length_and_never_waits(early_stopping, best):
    """Width 1, token 2 ends. Round 1 ends "2" at log .6 / 1; the live beam "0" has log .4. At its
    length (1) it cannot win, so False stops; "never" assumes the budget's length (3), under which
    log .4 / 3 could, and goes on to "0 1 2" at log(.4 * .99 * .99) / 3, which beats log .6."""
    lp = {(): {2: 0.6, 0: 0.4}, (0,): {1: 0.99, 2: 0.01}, (0, 1): {2: 0.99, 0: 0.01}}
    search = BeamSearch(1, 3, 1.0, early_stopping, 1, lambda toks: {"type": "stop", "matched": 2} if toks[-1] == 2 else None)
    while not search.done:
        search.advance([sorted(((t, math.log(p)) for t, p in lp[tuple(b.tokens)].items()), key=lambda x: -x[1]) for b in search.beams])
    assert [h.tokens for h in search.results()] == [best]


def test_beams_share_their_prefix_kv_through_the_radix_cache(engine):
    engine.flush_cache()
    prompt = [(i * 31) % 300 + 40 for i in range(64)]
    width, max_new = 4, 12
    out = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "beam_width": width})
    stats = engine.get_stats()
    # every round cached its beams' sequences: the tree holds the prompt once plus the branches
    assert stats["tree_slots"] <= len(prompt) + width * max_new
    assert stats["running_slots"] == 0 and stats["num_running"] == 0
    assert out[0]["meta_info"]["cached_tokens"] == 0
    again = engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": max_new, "beam_width": width})
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    assert again[0]["meta_info"]["cached_tokens"] == len(prompt) - 1  # the last prompt token is computed for its logits


def test_a_tenants_beams_never_read_another_tenants_cache(engine):
    prompt = [(i * 37) % 300 + 41 for i in range(48)]
    params = {"max_new_tokens": 4, "beam_width": 2}
    engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-a")
    other = engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-b")
    same = engine.generate(input_ids=prompt, sampling_params=params, cache_salt="tenant-a")
    assert other[0]["meta_info"]["cached_tokens"] == 0 and same[0]["meta_info"]["cached_tokens"] == len(prompt) - 1


def test_stop_strings_stop_tokens_and_the_budget_end_beams(engine, hf_model):
    base = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "beam_width": 2, "ignore_eos": True})
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" and len(o["output_ids"]) == 6 for o in base)
    stop_id = base[0]["output_ids"][2]
    stopped = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "beam_width": 2, "ignore_eos": True, "stop_token_ids": [stop_id]})
    assert any(o["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id} and o["output_ids"][-1] == stop_id for o in stopped)
    text = base[0]["text"]
    stop = text[len(text) // 2 :][:2]
    if stop.strip():
        by_text = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 6, "beam_width": 2, "ignore_eos": True, "stop": [stop]})
        hit = [o for o in by_text if o["meta_info"]["finish_reason"]["type"] == "stop"]
        assert hit and all(stop not in o["text"] for o in hit)


def test_a_pathological_stop_regex_is_cut_off_by_the_search_time_limit(engine):
    req = engine.make_request(lambda out: None, input_ids=PROMPT, sampling_params={"max_new_tokens": 40, "beam_width": 2, "stop_regex": "(a|aa)+b"})
    a_tokens = engine.tokenizer("a" * 40, add_special_tokens=False).input_ids  # (a|aa)+b backtracks exponentially over them
    with pytest.raises(StopRegexTooSlow, match="stop_regex"):
        engine._beam_stop(req)(a_tokens)


@pytest.mark.parametrize(
    ("constraint", "valid"),
    [
        ({"regex": "(yes|no|maybe)( indeed)?"}, lambda text: re.fullmatch("(yes|no|maybe)( indeed)?", text) is not None),
        ({"json_schema": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False}}, lambda text: isinstance(json.loads(text)["ok"], bool)),
    ],
)
def test_constrained_beams_are_all_valid_and_scored_by_the_models_own_logprobs(engine, hf_model, constraint, valid):
    outs = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 24, "beam_width": 3, **constraint})
    outs = outs if isinstance(outs, list) else [outs]
    # at most 3: the schema allows two outputs only ({"ok":true} and {"ok":false})
    assert 2 <= len(outs) <= 3 and len({tuple(o["output_ids"]) for o in outs}) == len(outs)
    for out in outs:
        assert out["meta_info"]["finish_reason"]["type"] == "stop", out
        assert valid(out["text"]), out["text"]
        ids = out["output_ids"]
        with torch.no_grad():
            lp = torch.log_softmax(hf_model(torch.tensor([PROMPT + ids])).logits[0, len(PROMPT) - 1 : -1].float(), dim=-1)
        teacher_forced = lp.gather(1, torch.tensor(ids)[:, None]).sum().item()  # unnormalized by the mask
        assert math.isclose(out["meta_info"]["cumulative_logprob"], teacher_forced, rel_tol=1e-4, abs_tol=1e-3)
        assert math.isclose(out["meta_info"]["beam_score"], teacher_forced / len(ids), rel_tol=1e-4, abs_tol=1e-3)


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"beam_width": 0}, "beam_width"),
        ({"beam_width": 99}, "beam_width"),
        ({"beam_width": 2, "n": 2}, "n must be 1"),
        ({"beam_width": 2, "json_schema": {"type": "object"}, "close_json_within_budget": True}, "close_json_within_budget"),
        ({"beam_width": 2, "repetition_penalty": 1.2}, "repetition_penalty"),
        ({"beam_width": 2, "early_stopping": "sometimes"}, "early_stopping"),
        ({"beam_width": 2, "early_stopping": 1}, "early_stopping"),
        ({"beam_width": 2, "length_penalty": "long"}, "length_penalty"),
    ],
)
def test_bad_beam_options_are_refused_by_name(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, **params})


def test_beam_search_does_not_stream(engine):
    with pytest.raises(ValueError, match="does not stream"):
        engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "beam_width": 2}, stream=True)


def test_a_batch_mixes_beam_and_sampled_prompts_prompt_major(engine):
    outs = engine.generate(input_ids=[PROMPT, PROMPT[:5]], sampling_params=[{"max_new_tokens": 4, "beam_width": 3}, {"max_new_tokens": 4, "temperature": 0}])
    assert len(outs) == 4 and "beam_score" in outs[2]["meta_info"] and "beam_score" not in outs[3]["meta_info"]
    alone = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "beam_width": 3})
    assert [o["output_ids"] for o in outs[:3]] == [o["output_ids"] for o in alone]
    both = engine.generate(input_ids=[PROMPT, PROMPT[:5]], sampling_params={"max_new_tokens": 4, "beam_width": 2})  # side by side
    first, second = (engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 4, "beam_width": 2}) for ids in (PROMPT, PROMPT[:5]))
    assert [o["output_ids"] for o in both] == [o["output_ids"] for o in first + second]


def test_a_beam_search_whose_round_fails_fails_alone_and_frees_its_kv(tiny_llama):
    with radixlm.Engine(tiny_llama, max_total_tokens=4096, num_threads=1, debug_fault_injection=True) as e:
        doomed = e.make_request(lambda out: None, input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "beam_width": 3}, rid="fault-sample-beams")
        with pytest.raises(BeamAborted, match="injected fault"):
            e.beam_search_sync(doomed)  # its rounds' rids extend its own: they fail at sampling
        ok = e.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 4, "beam_width": 3})
        assert len(ok) == 3
        stats = e.get_stats()
        assert stats["num_running"] == 0 and stats["running_slots"] == 0 and stats["num_waiting"] == 0
        e.check_accounting()


# ------------------------------------------------------------------ over HTTP
def test_generate_answers_beam_width_outputs_and_completions_take_use_beam_search(tiny_server, engine):
    want = engine.generate(input_ids=PROMPT, sampling_params={"max_new_tokens": 5, "beam_width": 3})
    r = httpx.post(tiny_server.base_url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5, "beam_width": 3}}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [o["output_ids"] for o in body] == [o["output_ids"] for o in want]
    assert all(math.isclose(a["meta_info"]["beam_score"], b["meta_info"]["beam_score"], rel_tol=1e-4) for a, b in zip(body, want))
    bad = httpx.post(tiny_server.base_url + "/generate", json={"input_ids": PROMPT, "sampling_params": {"beam_width": 3}, "stream": True}, timeout=60)
    assert bad.status_code == 400 and "beam_width" in bad.text
    oai = openai.OpenAI(base_url=tiny_server.base_url + "/v1", api_key="none", max_retries=0)
    comp = oai.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, n=3, extra_body={"use_beam_search": True})
    assert [c.text for c in comp.choices] == [o["text"] for o in want]
    assert [c.index for c in comp.choices] == [0, 1, 2] and comp.usage.completion_tokens == sum(len(o["output_ids"]) for o in want)


@pytest.fixture
def own_server(tiny_llama):
    """A server of its own: a long search would otherwise leave the shared server's cache full of beams."""
    from helpers import ServerProcess

    server = ServerProcess(tiny_llama, "--max-total-tokens", "4096")
    yield server
    assert server.stop() == 0


def test_a_client_that_leaves_ends_its_beam_search_at_the_next_round(own_server):
    tiny_server = own_server

    def stats() -> dict:
        return httpx.get(tiny_server.base_url + "/get_server_info", timeout=60).json()["stats"]

    before = stats()["forward_passes"]
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2000, "beam_width": 4, "ignore_eos": True}}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(tiny_server.base_url + "/generate", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline, last, still_since = time.monotonic() + 300, -1, time.monotonic()
    while time.monotonic() < deadline:  # until no pass has run for a second (rounds follow each other closely)
        after = stats()
        if after["forward_passes"] != last:
            last, still_since = after["forward_passes"], time.monotonic()
        elif time.monotonic() - still_since > 1.0:
            break
        time.sleep(0.1)
    assert after["num_running"] == 0 and after["running_slots"] == 0 and after["kv_invariant_holds"]
    assert after["forward_passes"] - before < 2000, "the search ran on after its client left"
