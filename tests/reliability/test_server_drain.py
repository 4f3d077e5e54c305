"""SIGTERM drains (issue 10): new requests get 503 (not a refused connection) while running ones
go on; a stream still running when --drain-timeout passes ends with an error event, then [DONE]."""

from __future__ import annotations

import json
import signal
import threading
import time

import httpx

from helpers import ServerProcess


def test_sigterm_answers_503_during_the_drain_and_ends_late_streams_with_an_error_event(tiny_llama):
    srv = ServerProcess(tiny_llama, "--max-total-tokens", "4096", "--drain-timeout", "3")
    events: list[str] = []
    started = threading.Event()

    def read_stream() -> None:
        body = {"text": "Once upon a time", "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}, "stream": True}
        with httpx.stream("POST", srv.base_url + "/generate", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[6:])
                    started.set()

    reader = threading.Thread(target=read_stream)
    reader.start()
    try:
        assert started.wait(120), "the stream did not start"
        t0 = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 60
        refused = None
        while refused is None and time.monotonic() < deadline:
            r = httpx.post(srv.base_url + "/generate", json={"text": "late", "sampling_params": {"max_new_tokens": 1}}, timeout=60)
            if r.status_code == 503:
                refused = r
        assert refused is not None and refused.json()["object"] == "error" and "shutting down" in refused.json()["message"]
        assert time.monotonic() - t0 < 3, "the 503 came after the drain timeout: nothing was tested"
        reader.join(120)
        assert srv.proc.wait(timeout=60) == 0
    finally:
        srv.stop()
    assert events[-1] == "[DONE]", events[-3:]
    err = json.loads(events[-2])["error"]
    assert err["code"] == 503 and "drain" in err["message"]
    assert all("error" not in json.loads(e) for e in events[:-2])
