"""The app in-process over a real engine on the tiny Llama: a request that fails while starting
never leaks its admission slot, and a request that failed inside the engine (finish_reason with a
``status``) reaches the HTTP client as that status, or as a final stream error event."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from radixlm.runtime.engine import Engine
from radixlm.runtime.entrypoints.http.server import create_app

GREEDY = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def engine(tiny_llama):
    eng = Engine(model_path=tiny_llama, max_total_tokens=2048)
    yield eng
    eng.shutdown()


@pytest.fixture
def app(engine):
    return create_app(engine, max_queued_requests=4)


def _run(app, calls):
    async def main():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1", timeout=120) as c:
            return await calls(c)

    return asyncio.run(main())


def _events(r: httpx.Response) -> list:
    return [line[6:] for line in r.text.splitlines() if line.startswith("data: ")]


def test_any_exception_while_starting_a_request_is_a_400_and_releases_its_slot(app, engine, monkeypatch):
    real = engine.start_request

    async def start(**kwargs):
        prompt = kwargs.get("prompt") or ""
        if "boom" in prompt or kwargs.get("input_ids") == [7, 7, 7]:
            raise TypeError("TextEncodeInput must be Union[TextInputSequence, Tuple[InputSequence, InputSequence]]")
        return await real(**kwargs)

    monkeypatch.setattr(engine, "start_request", start)

    async def calls(c):
        codes = []
        for i in range(240):  # 1,200 prompts; the server holds 4 + max_running at once
            r = await c.post("/generate", json={"text": ["ok", "ok", "boom", "ok", "ok"] if i % 2 else ["boom"] * 5, "sampling_params": GREEDY})
            codes.append(r.status_code)
            assert r.json()["param"] == "text", r.json()
        r = await c.post("/v1/completions", json={"prompt": [7, 7, 7], "max_tokens": 2})
        assert r.status_code == 400 and r.json()["param"] == "prompt"
        r = await c.post("/generate", json={"text": "boom", "stream": True})
        assert r.status_code == 400
        ok = await c.post("/generate", json={"text": "fine", "sampling_params": GREEDY})
        return codes, ok

    codes, ok = _run(app, calls)
    assert set(codes) == {400}
    assert ok.status_code == 200 and len(ok.json()["output_ids"]) == 3
    assert app.state.radixlm.in_flight == 0 and not app.state.radixlm.rids


@pytest.fixture
def failing(engine, monkeypatch):
    """start_request whose prompts containing 'fail' end as the engine reports a request that
    failed inside it (the contract: finish_reason abort with a message and an HTTP status)."""
    real = engine.start_request

    async def start(**kwargs):
        req, q = await real(**kwargs)
        text = kwargs.get("prompt") or engine.tokenizer.decode(kwargs.get("input_ids") or [])
        if "fail" not in text and "fail" not in (kwargs.get("rid") or ""):
            return req, q
        out_q: asyncio.Queue = asyncio.Queue()

        async def forward():
            while True:
                out = await q.get()
                if out.finished:
                    out.meta_info["finish_reason"] = {"type": "abort", "matched": None, "message": "sampling failed: injected", "status": 500}
                out_q.put_nowait(out)
                if out.finished:
                    return

        asyncio.get_running_loop().create_task(forward())
        return req, out_q

    monkeypatch.setattr(engine, "start_request", start)


def test_a_request_that_failed_in_the_engine_is_an_error_with_its_status(app, failing):
    async def calls(c):
        one = await c.post("/generate", json={"text": "please fail", "sampling_params": GREEDY})
        batch = await c.post("/generate", json={"text": ["fine", "please fail"], "sampling_params": GREEDY})
        comp = await c.post("/v1/completions", json={"prompt": "please fail", "max_tokens": 3, "n": 2})
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fail"}], "max_tokens": 3})
        fine = await c.post("/generate", json={"text": "fine", "sampling_params": GREEDY})
        return one, batch, comp, chat, fine

    one, batch, comp, chat, fine = _run(app, calls)
    for r in (one, batch, comp, chat):
        assert r.status_code == 500, r.text
        err = r.json()
        assert err["object"] == "error" and err["message"] == "sampling failed: injected" and err["code"] == 500
    assert fine.status_code == 200
    assert app.state.radixlm.in_flight == 0


def test_a_stream_that_failed_in_the_engine_ends_with_an_error_event_then_done(app, failing):
    async def calls(c):
        native = await c.post("/generate", json={"text": "please fail", "sampling_params": GREEDY, "stream": True})
        chat = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "fail"}], "max_tokens": 3, "stream": True})
        comp = await c.post("/v1/completions", json={"prompt": "fail", "max_tokens": 3, "stream": True, "n": 2})
        return native, chat, comp

    for r in _run(app, calls):
        events = _events(r)
        assert events[-1] == "[DONE]", events
        err = json.loads(events[-2])["error"]
        assert err["message"] == "sampling failed: injected" and err["code"] == 500 and err["object"] == "error"
        assert all("error" not in json.loads(e) for e in events[:-2])
    assert app.state.radixlm.in_flight == 0


def test_a_client_abort_keeps_its_200_with_finish_reason_abort(app, engine):
    async def calls(c):
        task = asyncio.ensure_future(c.post("/generate", json={"text": "x", "rid": "to-abort", "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}))
        for _ in range(600):
            if (await c.post("/abort_request", json={"rid": "to-abort"})).json()["aborted"]:
                break
            await asyncio.sleep(0.1)
        return await task

    r = _run(app, calls)
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_full_grammar_compilers_answer_429_not_400(app, engine, monkeypatch):
    from radixlm.runtime.constrained.compiler import GrammarBusy

    async def busy(**kwargs):
        raise GrammarBusy("16 compilations are running; retry later (grammar_compile_timeout)")

    monkeypatch.setattr(engine, "start_request", busy)

    async def calls(c):
        return await c.post("/generate", json={"text": "x", "sampling_params": {"regex": "a+"}})

    r = _run(app, calls)
    assert r.status_code == 429, r.text
    assert r.json()["object"] == "error"
    assert app.state.radixlm.in_flight == 0
