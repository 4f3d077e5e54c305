"""Load with faults against one ``radixlm serve`` child: 64 concurrent streams per round, a quarter
of the clients disconnecting at random points, grammar and sampling faults injected into some
requests, 3 rounds. Afterwards nothing is left behind: no ghost request, no leaked KV slot, no
leaked admission slot; every surviving stream is complete and every faulted one got its error."""

from __future__ import annotations

import asyncio
import json
import random
import time

import httpx
import pytest

from helpers import ServerProcess

STREAMS = 64
ROUNDS = 3
MAX_NEW_TOKENS = 16
DISCONNECT_TOKENS = 1000  # a disconnecting client asks for many tokens: only its abort ends it early
PASSES_PER_ROUND = 400  # a round needs ~20 forward passes; unaborted disconnects would need 1000
ADMISSION_SLOTS = 2 * STREAMS  # --max-running-requests 64 + --max-queued-requests 64
REGEX = "[a-z ]{4,40}"
PROMPTS = ["The quick brown fox", "Radix trees share prefixes", "Question: what is two plus two?", "Once upon a time"]


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(
        tiny_llama,
        "--max-total-tokens", "32768",
        "--max-running-requests", str(STREAMS),
        "--max-queued-requests", str(ADMISSION_SLOTS - STREAMS),
        "--debug-fault-injection",
    )
    yield srv
    assert srv.stop() == 0, srv.output()[-3000:]


def plan_round(rng: random.Random, round_no: int) -> list[dict]:
    """The 64 clients of one round: which disconnect (and after how many events), which carry a fault."""
    kinds = ["disconnect"] * (STREAMS // 4) + ["fault-grammar"] * 4 + ["fault-sample"] * 4
    kinds += ["plain"] * (STREAMS - len(kinds))
    rng.shuffle(kinds)
    clients = []
    for i, kind in enumerate(kinds):
        params: dict = {"max_new_tokens": MAX_NEW_TOKENS, "temperature": rng.choice([0.0, 0.8]), "seed": rng.randrange(1000)}
        if kind == "disconnect":  # runs until its client goes away
            params.update(max_new_tokens=DISCONNECT_TOKENS, ignore_eos=True)
        elif kind == "fault-grammar" or (kind == "plain" and rng.random() < 0.25):
            params["regex"] = REGEX
        else:
            params["ignore_eos"] = rng.random() < 0.5
        rid = f"{kind}-r{round_no}-{i}" if kind.startswith("fault-") else f"load-r{round_no}-{i}"
        clients.append({
            "kind": kind,
            "rid": rid,
            "body": {"text": rng.choice(PROMPTS) + f" #{round_no}.{i}", "sampling_params": params, "stream": True, "rid": rid},
            "cut_after": rng.randrange(0, MAX_NEW_TOKENS) if kind == "disconnect" else None,
        })
    return clients


async def run_client(http: httpx.AsyncClient, client: dict) -> dict:
    """Stream one request; a disconnecting client closes the connection after ``cut_after`` events."""
    events: list = []
    done = False
    async with http.stream("POST", "/generate", json=client["body"]) as r:
        status = r.status_code
        if status != 200:
            return {"status": status, "events": [await r.aread()], "done": False}
        if client["cut_after"] == 0:
            return {"status": status, "events": events, "done": False}
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                done = True
                continue
            assert not done, f"{client['rid']}: an event after [DONE]"
            events.append(json.loads(line[6:]))
            if client["cut_after"] is not None and len(events) >= client["cut_after"]:
                break  # leaving the block closes the connection mid-stream
    return {"status": status, "events": events, "done": done}


def failure_status(event: dict) -> int | None:
    """The HTTP status a failed stream's last event reports: an error event or an abort finish_reason."""
    if "error" in event:
        err = event["error"]
        return err.get("code") if isinstance(err, dict) else None
    reason = (event.get("meta_info") or {}).get("finish_reason") or {}
    return reason.get("status") if reason.get("type") == "abort" else None


def check_result(client: dict, res: dict) -> None:
    """A surviving stream is complete; a faulted one ends with a 500 error, then [DONE]."""
    rid, kind = client["rid"], client["kind"]
    assert res["status"] == 200, f"{rid}: HTTP {res['status']} {res['events']}"
    if kind == "disconnect":
        return
    assert res["done"] and res["events"], f"{rid}: the stream ended without [DONE] ({len(res['events'])} events)"
    last = res["events"][-1]
    if kind.startswith("fault-"):
        assert failure_status(last) == 500, f"{rid}: {last}"
        return
    reason = last["meta_info"]["finish_reason"]
    assert reason is not None and reason["type"] in ("length", "stop"), f"{rid}: {reason}"
    n = len(last["output_ids"])
    assert n == last["meta_info"]["completion_tokens"]
    assert n == MAX_NEW_TOKENS if reason["type"] == "length" else 0 < n <= MAX_NEW_TOKENS, f"{rid}: {reason} after {n} tokens"
    assert all(e["meta_info"]["finish_reason"] is None for e in res["events"][:-1]), f"{rid}: finished before its last event"


async def wait_idle(http: httpx.AsyncClient, deadline_s: float = 60.0) -> dict:
    """Poll the server's stats until no request runs or waits (generous deadline); return them."""
    deadline = time.monotonic() + deadline_s
    while True:
        stats = (await http.get("/get_server_info")).json()["stats"]
        if stats["num_running"] == 0 and stats["num_waiting"] == 0:
            return stats
        assert time.monotonic() < deadline, f"ghost requests left: {stats}"
        await asyncio.sleep(0.2)


async def wait_admission_free(http: httpx.AsyncClient, deadline_s: float = 30.0) -> None:
    """One batch of exactly ADMISSION_SLOTS prompts must be admitted: any leaked slot makes it 429."""
    body = {"input_ids": [[5 + i % 50] for i in range(ADMISSION_SLOTS)], "sampling_params": {"max_new_tokens": 0}}
    deadline = time.monotonic() + deadline_s
    while True:
        r = await http.post("/generate", json=body)
        if r.status_code == 200:
            return
        assert r.status_code == 429 and time.monotonic() < deadline, f"admission slots leaked: {r.status_code} {r.text[:300]}"
        await asyncio.sleep(0.2)


def test_64_streams_with_disconnects_and_faults_leave_no_ghosts_or_leaked_slots(server):
    rng = random.Random(10)
    counts = {"disconnect": 0, "fault": 0, "complete": 0}

    async def main() -> dict:
        limits = httpx.Limits(max_connections=2 * STREAMS, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=httpx.Timeout(60.0), limits=limits) as http:
            passes_before = (await http.get("/get_server_info")).json()["stats"]["forward_passes"]
            for round_no in range(ROUNDS):
                clients = plan_round(rng, round_no)
                results = await asyncio.wait_for(asyncio.gather(*(run_client(http, c) for c in clients)), timeout=90)
                for client, res in zip(clients, results):
                    check_result(client, res)
                    counts["disconnect" if client["kind"] == "disconnect" else "fault" if client["kind"].startswith("fault-") else "complete"] += 1
                stats = await wait_idle(http)
                passes = stats["forward_passes"] - passes_before
                assert passes < PASSES_PER_ROUND, f"round {round_no}: {passes} forward passes; disconnected requests kept decoding"
                passes_before = stats["forward_passes"]
            stats = await wait_idle(http)
            await wait_admission_free(http)
            return stats

    stats = asyncio.run(main())
    assert stats["kv_invariant_holds"], stats
    assert stats["running_slots"] == 0, stats
    assert stats["free_slots"] + stats["tree_slots"] == stats["max_total_tokens"], stats
    assert counts == {"disconnect": ROUNDS * 16, "fault": ROUNDS * 8, "complete": ROUNDS * 40}
    # The server is still serving after it all.
    out = httpx.post(server.base_url + "/generate", json={"text": "still serving", "sampling_params": {"max_new_tokens": 4, "ignore_eos": True}}, timeout=60).json()
    assert out["meta_info"]["finish_reason"]["type"] == "length"
