"""Engine fault isolation: a request that fails at any stage fails alone, frees its KV uncached,
and the loop keeps serving; if the loop itself ends, every waiter is answered at once."""

from __future__ import annotations

import asyncio
import queue

import pytest

import radixlm
from radixlm.runtime.engine import EngineError
from radixlm.runtime.faults import STAGES

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
PROMPTS = ["The quick brown fox", "Radix trees share", "Once upon a time"]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, max_running_requests=16, debug_fault_injection=True) as eng:
        yield eng


def _run_with_one_fault(engine, stage: str, params: dict, stream: bool = False) -> tuple[dict, list[dict]]:
    """Submit three good requests and one that fails at ``stage`` back to back (so they share
    steps); return the failing one's final output and the good ones' outputs."""
    sinks = [queue.Queue() for _ in range(4)]
    reqs = [engine.make_request(q.put, prompt=p, sampling_params=GREEDY) for q, p in zip(sinks, PROMPTS)]
    bad = engine.make_request(sinks[3].put, prompt="Question: what is two", sampling_params=params, rid=f"fault-{stage}-1", stream=stream)
    engine.attach_grammar(bad)
    for req in [*reqs[:2], bad, reqs[2]]:
        engine.submit(req)

    def final(q):
        while not (out := q.get(timeout=120)).finished:
            pass
        return out

    outs = [final(q) for q in sinks]
    return outs[3], [{"output_ids": o.output_ids, "meta_info": o.meta_info} for o in outs[:3]]


@pytest.mark.parametrize("stage", [s for s in STAGES if s != "grammar"])
def test_a_request_failing_at_any_stage_fails_alone(engine, stage):
    expected = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    bad, outs = _run_with_one_fault(engine, stage, dict(GREEDY))
    reason = bad.meta_info["finish_reason"]
    assert reason["type"] == "abort" and reason["status"] == 500, reason
    assert reason["message"]
    assert [o["output_ids"] for o in outs] == expected
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    engine.check_accounting()
    assert engine.generate("still serving", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_a_grammar_fault_during_draft_verification_fails_only_that_request(engine):
    # The regex forces text, so the first pass verifies jump-forward drafts (the path whose
    # failure used to kill the loop while the KV length still counted the drafts).
    bad, outs = _run_with_one_fault(engine, "grammar", {"regex": "forced text here [0-9]", "max_new_tokens": 16, "temperature": 0})
    assert bad.meta_info["finish_reason"]["status"] == 500
    assert all(o["meta_info"]["finish_reason"]["type"] == "length" for o in outs)
    engine.check_accounting()
    assert engine.is_alive()


def test_a_budget_closer_that_raises_fails_only_its_request(engine, monkeypatch):
    from radixlm.runtime.constrained.budget import BudgetMatcher

    def broken(self, *args, **kwargs):
        raise RuntimeError("walk broke")

    monkeypatch.setattr(BudgetMatcher, "_walk_out", broken)  # only the JSON request has a budget closer
    expected = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    bad, outs = _run_with_one_fault(engine, "none", {"json_schema": '{"type": "object"}', "max_new_tokens": 16, "temperature": 0})
    reason = bad.meta_info["finish_reason"]
    assert reason["type"] == "abort" and reason["status"] == 500 and "walk broke" in reason["message"], reason
    assert [o["output_ids"] for o in outs] == expected
    engine.check_accounting()
    assert engine.generate("still serving", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_a_semantic_check_that_raises_fails_only_its_request(engine, monkeypatch):
    from radixlm.runtime.constrained.semantic import JsonFollower

    def broken(self, *args, **kwargs):
        raise RuntimeError("follower broke")

    monkeypatch.setattr(JsonFollower, "_complete", broken)  # only the uniqueItems request has a follower
    expected = [engine.generate(p, GREEDY)["output_ids"] for p in PROMPTS]
    schema = '{"type": "array", "items": {"type": "integer"}, "uniqueItems": true}'
    bad, outs = _run_with_one_fault(engine, "none", {"json_schema": schema, "max_new_tokens": 16, "temperature": 0})
    reason = bad.meta_info["finish_reason"]
    assert reason["type"] == "abort" and reason["status"] == 500 and "follower broke" in reason["message"], reason
    assert [o["output_ids"] for o in outs] == expected
    engine.check_accounting()
    assert engine.generate("still serving", GREEDY)["meta_info"]["finish_reason"]["type"] == "length"


def test_non_finite_logits_are_never_cached(engine):
    prompt = "0123456789 abcdefghij unique prompt for nan"
    ids = engine.tokenize(prompt)
    bad, _ = _run_with_one_fault_ids(engine, ids)
    assert "non-finite" in bad.meta_info["finish_reason"]["message"]
    cached = engine._call(lambda: engine.kv.tree.match_prefix(ids).length)
    assert cached == 0
    engine.check_accounting()


def _run_with_one_fault_ids(engine, ids):
    async def main():
        req, q = await engine.start_request(input_ids=ids, sampling_params=GREEDY, rid="fault-nan-ids")
        while True:
            out = await q.get()
            if out.finished:
                return out, None

    return asyncio.run(main())


def test_a_streaming_request_failing_gets_a_final_error_output(engine):
    bad, outs = _run_with_one_fault(engine, "output", dict(GREEDY), stream=True)
    assert bad.finished and bad.meta_info["finish_reason"]["status"] == 500
    engine.check_accounting()


def test_a_reused_rid_is_refused_while_in_flight(engine):
    async def main():
        req, q = await engine.start_request(prompt="first", sampling_params={"max_new_tokens": 64, "ignore_eos": True}, rid="same-rid")
        with pytest.raises(ValueError, match="rid"):
            await engine.start_request(prompt="second", sampling_params=GREEDY, rid="same-rid")
        while not (await q.get()).finished:
            pass
        # once the first has finished, the rid may be used again
        req2, q2 = await engine.start_request(prompt="third", sampling_params=GREEDY, rid="same-rid")
        while not (out := await q2.get()).finished:
            pass
        return out

    assert asyncio.run(main()).meta_info["finish_reason"]["type"] == "length"
    engine.check_accounting()


def test_jump_forward_never_exceeds_max_new_tokens(engine):
    for n in (1, 2, 3, 5):
        out = engine.generate("Say it:", {"regex": "a fixed answer that is long enough", "max_new_tokens": n, "temperature": 0})
        assert len(out["output_ids"]) == n, (n, out)


def test_a_stop_token_inside_accepted_drafts_ends_the_request_there(engine):
    forced = "forced text here ok"
    ids = engine.tokenize(forced, add_special_tokens=False)
    stop_at = ids[1]
    out = engine.generate("Say it:", {"regex": forced, "max_new_tokens": 32, "temperature": 0, "stop_token_ids": [stop_at]})
    assert out["output_ids"][-1] == stop_at and stop_at not in out["output_ids"][:-1], out
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_at}


def test_a_context_length_off_the_page_size_leaks_no_page(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024, context_length=100, page_size=16) as eng:
        prompt = list(range(10, 90))
        for _ in range(3):
            out = eng.generate(input_ids=prompt, sampling_params={"max_new_tokens": 19, "ignore_eos": True, "temperature": 0})
            assert out["meta_info"]["finish_reason"]["type"] == "length"
            assert len(prompt) + len(out["output_ids"]) <= 100
        eng.check_accounting()
        assert eng.get_stats()["running_slots"] == 0


def test_a_dead_loop_answers_every_waiter_at_once(tiny_llama):
    eng = radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024)
    try:
        sched = eng.scheduler
        step = sched.step

        q_inbox: queue.Queue = queue.Queue()  # its request is still in the inbox when the loop dies

        def dying_step():
            step()
            if len(sched.waiting) + len(sched.running) >= 2:  # both waiters are in: die now
                eng.submit(eng.make_request(q_inbox.put, prompt="queued", sampling_params=GREEDY))
                raise SystemExit("simulated fatal error")  # not an Exception: nothing per-request catches it

        sched.step = dying_step
        q_sync: queue.Queue = queue.Queue()
        eng.submit(eng.make_request(q_sync.put, prompt="a long one", sampling_params={"max_new_tokens": 500, "ignore_eos": True}))

        async def waiter():
            req, q = await eng.start_request(prompt="another", sampling_params={"max_new_tokens": 500, "ignore_eos": True})
            while not (out := await q.get()).finished:
                pass
            return out

        out = asyncio.run(asyncio.wait_for(waiter(), timeout=120))
        assert out.meta_info["finish_reason"]["status"] == 503
        while not (final := q_sync.get(timeout=120)).finished:
            pass
        assert final.meta_info["finish_reason"]["status"] == 503
        assert q_inbox.get(timeout=120).meta_info["finish_reason"]["status"] == 503
        assert not eng.is_alive()
        with pytest.raises(EngineError):
            eng.generate("after", GREEDY)
    finally:
        eng.shutdown()


def test_a_call_queued_when_the_loop_dies_is_answered_not_left_waiting(tiny_llama):
    """A /metrics or dashboard read queued behind the fatal error gets EngineError at once."""
    import threading

    from radixlm.runtime.faults import FatalEngineError

    eng = radixlm.Engine(model_path=tiny_llama, max_total_tokens=1024)
    try:
        release, entered = threading.Event(), threading.Event()

        def hold() -> None:  # keeps the loop busy while the fatal error and the read queue up
            entered.set()
            release.wait(60)

        holder = threading.Thread(target=lambda: eng._call(hold))
        holder.start()
        assert entered.wait(60)
        eng._inbox.put(("fatal", FatalEngineError("simulated lost worker")))
        answers: list[BaseException | dict] = []

        def read_stats() -> None:
            try:
                answers.append(eng.get_stats())
            except BaseException as exc:
                answers.append(exc)

        reader = threading.Thread(target=read_stats, daemon=True)
        reader.start()
        while eng._inbox.qsize() < 2:  # the read sits behind the fatal error
            assert reader.is_alive() or answers
            threading.Event().wait(0.01)
        release.set()
        reader.join(60)
        assert not reader.is_alive(), "the queued call was never answered"
        assert isinstance(answers[0], EngineError), answers
        holder.join(60)
    finally:
        release.set()
        eng.shutdown()


def test_chunked_prefill_lets_new_requests_in_while_a_long_prompt_runs(tiny_llama):
    with radixlm.Engine(model_path=tiny_llama, max_total_tokens=4096, chunked_prefill_size=64) as eng:
        sched = eng.scheduler

        def scenario():
            from radixlm.runtime.request import Req
            from radixlm.runtime.sampling_params import SamplingParams

            long = Req("long", list(range(5, 5 + 900)), SamplingParams(max_new_tokens=1), sink=lambda out: None)
            short = Req("short", [7, 8, 9], SamplingParams(max_new_tokens=1), sink=lambda out: None)
            sched.add(long)
            sched.step()
            sched.add(short)
            steps = 0
            while short.finish is None:
                sched.step()
                steps += 1
            long_done = long.finish is not None
            while sched.has_work():
                sched.step()
            return steps, long_done

        steps, long_done = eng._call(scenario)
        assert not long_done and steps <= 2
        eng.check_accounting()


def test_cache_salt_keeps_one_clients_prefix_from_another(engine):
    engine.flush_cache()
    prompt = "Once upon a time, in a small village, there lived a curious engineer."
    engine.generate(prompt, GREEDY, cache_salt="alice")
    other = engine.generate(prompt, GREEDY, cache_salt="mallory")
    unsalted = engine.generate(prompt, GREEDY)
    same = engine.generate(prompt, GREEDY, cache_salt="alice")
    assert other["meta_info"]["cached_tokens"] == 0
    assert unsalted["meta_info"]["cached_tokens"] == 0
    assert same["meta_info"]["cached_tokens"] > 0
    assert other["output_ids"] == same["output_ids"] == unsalted["output_ids"]
    engine.check_accounting()


def test_jump_forward_drafts_leave_room_for_the_token_after_them(engine):
    from radixlm.runtime.request import Req
    from radixlm.runtime.sampling_params import SamplingParams

    class Forcing:  # a grammar that forces a long text
        def forced_text(self) -> str:
            return "forced text here " * 4

    for max_new in (1, 2, 3, 6):
        req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=max_new), sink=lambda out: None, grammar=Forcing())
        engine.scheduler.decoder.propose_initial_drafts(req)
        assert len(req.draft_ids) == max_new - 1  # the verifying pass adds one token past them


@pytest.mark.parametrize("temperature", [1e-46, 1e-300, 5e-324])
def test_a_vanishing_temperature_decodes_greedily_instead_of_dividing_by_zero(engine, temperature):
    greedy = engine.generate("The quick brown fox", GREEDY)
    tiny = engine.generate("The quick brown fox", dict(GREEDY, temperature=temperature))
    assert tiny["output_ids"] == greedy["output_ids"]
    assert tiny["meta_info"]["finish_reason"]["type"] == "length"


def test_a_text_far_over_the_context_is_refused_without_tokenizing(engine, monkeypatch):
    calls = []
    real = engine.tokenizer.__class__.__call__
    monkeypatch.setattr(engine.tokenizer.__class__, "__call__", lambda self, *a, **k: calls.append(1) or real(self, *a, **k))
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("word " * 2_000_000, GREEDY)
    assert calls == []
