"""Runtime: ``radixlm serve`` as a child process, used as a backend and stopped cleanly."""

from __future__ import annotations

import pytest

import radixlm as sgl


def test_runtime_starts_a_server_runs_programs_and_stops(tiny_llama):
    runtime = sgl.Runtime(model_path=tiny_llama, api_key="secret", max_total_tokens=4096)
    try:
        @sgl.function
        def hello(s):
            s += sgl.user("Hello") + sgl.assistant(sgl.gen("reply", max_tokens=4))

        state = hello.run(backend=runtime, temperature=0)
        assert state.error() is None and state.messages()[-1]["content"] == state["reply"]
        assert runtime.get_server_info()["max_total_tokens"] == 4096  # server arguments reach the server
        anonymous = sgl.RuntimeEndpoint(runtime.url)
        with pytest.raises(sgl.BackendError, match="401"):
            anonymous.tokenize(["x"])
        anonymous.shutdown()
    finally:
        runtime.shutdown()
    assert runtime.process.poll() is not None
    runtime.shutdown()  # idempotent


def test_runtime_reports_a_server_that_cannot_start(tmp_path):
    with pytest.raises(sgl.BackendError, match="radixlm serve exited"):
        sgl.Runtime(model_path=str(tmp_path / "missing"), startup_timeout=120)
    with pytest.raises(ValueError, match="unknown server argument 'bogus'"):
        sgl.Runtime(bogus=1)
