"""Faults injected inside the engine reach HTTP clients as errors (issue 10): with
``--debug-fault-injection``, a request whose rid is ``fault-<stage>-...`` fails at that stage; its
client gets an OpenAI-shaped 500 with the message (a stream: an error event, then [DONE]), while
a request running beside it finishes normally and nothing is left behind."""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from helpers import ServerProcess

STAGES = ("admit", "sample", "forward", "output", "nan")


@pytest.fixture(scope="module")
def server(tiny_llama):
    srv = ServerProcess(tiny_llama, "--max-total-tokens", "4096", "--debug-fault-injection")
    yield srv
    assert srv.stop() == 0


@pytest.mark.parametrize("stage", STAGES)
def test_an_injected_fault_is_a_500_for_its_client_only(server, stage):
    neighbour: list[httpx.Response] = []
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True, "temperature": 0}}
    t = threading.Thread(target=lambda: neighbour.append(httpx.post(server.base_url + "/generate", json=body, timeout=120)))
    t.start()
    r = httpx.post(server.base_url + "/generate", json={**body, "rid": f"fault-{stage}-1"}, timeout=120)
    t.join(120)
    assert r.status_code == 500, r.text
    err = r.json()
    expected = ("nan", "finite") if stage == "nan" else ("injected fault",)
    assert err["object"] == "error" and err["code"] == 500 and any(w in err["message"].lower() for w in expected), err
    assert neighbour[0].status_code == 200 and len(neighbour[0].json()["output_ids"]) == 40


def test_an_injected_fault_ends_a_stream_with_an_error_event_and_leaves_the_server_clean(server):
    body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 20, "ignore_eos": True}, "stream": True, "rid": "fault-sample-stream"}
    with httpx.stream("POST", server.base_url + "/generate", json=body, timeout=120) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    err = json.loads(events[-2])["error"]
    assert err["code"] == 500 and err["object"] == "error" and "injected fault" in err["message"], err
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        stats = c.get("/get_server_info").json()["stats"]
    assert stats["num_running"] == 0 and stats["in_flight"] == 0 and stats["kv_invariant_holds"]
