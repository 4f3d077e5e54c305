"""Issue 32 on a real server: counts checked before anything is built, the tenant boundary (no
tenant reads or aborts another's requests), cross-site and rebinding refusals, the admin key,
draining health, quiet disconnects, and keys kept off command lines and out of logs."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest

from helpers import ADMIN_KEY, API_KEY, wait_until

SECRET_A = "Tenant A's secret memo about the merger"
LONG = {"max_new_tokens": 3000, "ignore_eos": True}


def _rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


def _stats(client: httpx.Client) -> dict:
    return client.get("/get_server_info").json()["stats"]


# ------------------------------------------------------------------ counts
@pytest.mark.parametrize("n", [2**63, 9223372036854775808, 3_000_000])
def test_a_huge_n_is_a_400_before_anything_is_built_and_rss_stays_put(tiny_client, tiny_server, n):
    before = _rss_kib(tiny_server.proc.pid)
    r = tiny_client.post("/generate", json={"text": "x", "sampling_params": {"n": n, "max_new_tokens": 1}})
    assert r.status_code == 400 and r.json()["param"] == "n", r.text
    assert tiny_client.get("/health").status_code == 200
    assert _rss_kib(tiny_server.proc.pid) - before < 50 * 1024, "a refused n must not allocate"


def test_n_is_checked_before_any_per_sample_copy_is_made(tiny_llama, monkeypatch):
    import asyncio

    from radixlm.runtime.engine import Engine
    from radixlm.runtime.entrypoints.http import server

    built: list[object] = []
    real = server.per_sample_params
    monkeypatch.setattr(server, "per_sample_params", lambda sp: built.append(sp) or real(sp))
    eng = Engine(model_path=tiny_llama, max_total_tokens=1024)
    try:
        app = server.create_app(eng, max_queued_requests=4)

        async def call(n: int) -> httpx.Response:
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1", timeout=60) as c:
                return await c.post("/generate", json={"text": ["x", "y"], "sampling_params": {"n": n, "max_new_tokens": 1}})

        for n in (3_000_000, 2**63, 100):  # 2 prompts x 100 is over the 4 + 128 the server holds
            r = asyncio.run(call(n))
            assert r.status_code == 400 and r.json()["param"] == "n", r.text
        assert built == [], "copies were being made for a count that can never be admitted"
    finally:
        eng.shutdown()


def test_batch_counts_are_refused_before_tokenizing(tiny_client):
    r = tiny_client.post("/v1/completions", json={"prompt": ["x"] * 20_000, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["param"] == "prompt"
    r = tiny_client.post("/generate", json={"text": ["x"] * 3, "sampling_params": [{"n": 1000}, {"n": 1000}, {"n": 1}]})
    assert r.status_code == 400 and r.json()["param"] == "n"
    r = tiny_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}] * 5000})
    assert r.status_code == 400 and r.json()["param"].startswith("messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    r = tiny_client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "x"}], "tools": [tool] * 600})
    assert r.status_code == 400 and r.json()["param"].startswith("tools")
    r = tiny_client.post("/tokenize", json={"prompt": ["x"] * 20_000})
    assert r.status_code == 400 and r.json()["param"] == "prompt"


# ------------------------------------------------------------------ tenants
def _start_long(base_url: str, body: dict, result: list) -> threading.Thread:
    def run() -> None:
        with httpx.Client(base_url=base_url, timeout=300) as c:
            result.append(c.post("/generate", json=body))

    t = threading.Thread(target=run)
    t.start()
    return t


def test_tenant_b_cannot_abort_tenant_a_nor_take_its_rid(tiny_client, tiny_server):
    got: list[httpx.Response] = []
    a = _start_long(tiny_server.base_url, {"text": SECRET_A, "rid": "shared-rid", "cache_salt": "salt-A", "sampling_params": {"max_new_tokens": 40, "ignore_eos": True}}, got)
    try:
        wait_until(lambda: _stats(tiny_client)["num_running"] >= 1, 60, "tenant A's request to run")
        # B (another salt) and an unsalted caller try to abort A's rid: nothing is aborted
        for body in ({"rid": "shared-rid", "cache_salt": "salt-B"}, {"rid": "shared-rid"}):
            r = tiny_client.post("/abort_request", json=body)
            assert r.status_code == 200 and r.json()["aborted"] is False, (body, r.text)
        # B may use the same rid at the same time: rids are per tenant
        b = tiny_client.post("/generate", json={"text": "B's own", "rid": "shared-rid", "cache_salt": "salt-B", "sampling_params": {"max_new_tokens": 2}})
        assert b.status_code == 200, b.text
    finally:
        a.join(300)
    assert got[0].status_code == 200 and got[0].json()["meta_info"]["finish_reason"]["type"] == "length", got[0].text


def test_tenant_a_aborts_its_own_request_with_its_salt(tiny_client, tiny_server):
    got: list[httpx.Response] = []
    a = _start_long(tiny_server.base_url, {"text": "abort me", "rid": "mine", "cache_salt": "salt-A2", "sampling_params": LONG}, got)
    try:
        wait_until(lambda: _stats(tiny_client)["num_running"] >= 1, 60, "the request to run")
        r = tiny_client.post("/abort_request", json={"rid": "mine", "cache_salt": "salt-A2"})
        assert r.json()["aborted"] is True
    finally:
        a.join(300)
    assert got[0].json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_no_route_shows_tenant_b_the_text_or_rids_of_tenant_a(tiny_client):
    r = tiny_client.post("/generate", json={"text": SECRET_A, "rid": "rid-of-A", "cache_salt": "salt-A3", "prompt_cache_key": "A-session", "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200
    leaks = ("secret memo", "merger", "rid-of-A", "A-session")
    # tenant B: the dashboard, its own explanations, and an explanation of a request that
    # shares A's first tokens (which once compared itself against other salts' root edges)
    b = tiny_client.post("/generate", json={"text": "Tenant A's secret", "cache_salt": "salt-B3", "return_cache_info": True, "sampling_params": {"max_new_tokens": 2}})
    plain = tiny_client.post("/generate", json={"text": "Tenant A's secret", "return_cache_info": True, "sampling_params": {"max_new_tokens": 2}})
    views = [
        b.text,
        plain.text,
        tiny_client.get("/dashboard/state").text,
        tiny_client.get("/cache_explanations?last=1000", headers={"X-Cache-Salt": "salt-B3"}).text,
        tiny_client.get("/cache_explanations?last=1000").text,
        tiny_client.get("/get_server_info").text,
    ]
    for view in views:
        for leak in leaks:
            assert leak not in view, (leak, view[:400])
    assert b.json()["meta_info"]["cache_info"]["miss"]["reason"] == "new_text", "another tenant's cached prefix must not be named"
    own = tiny_client.get("/cache_explanations?last=1000", headers={"X-Cache-Salt": "salt-A3"}).json()
    assert own["redacted"] and own["data"] and all("rid" not in item for item in own["data"]), "a tenant sees counts of its own"


def test_the_admin_sees_every_tenant_and_alone_flushes(keyed_server):
    user, admin = ({"Authorization": f"Bearer {k}"} for k in (API_KEY, ADMIN_KEY))
    with httpx.Client(base_url=keyed_server.base_url, timeout=120) as c:
        r = c.post("/generate", json={"text": SECRET_A, "rid": "admin-sees", "cache_salt": "salt-A4", "sampling_params": {"max_new_tokens": 2}}, headers=user)
        assert r.status_code == 200
        everything = c.get("/cache_explanations?last=1000", headers=admin).json()
        assert not everything["redacted"] and any(item["rid"] == "admin-sees" for item in everything["data"])
        info = c.get("/get_server_info", headers=user).json()
        assert "/" not in info["model_path"], "file paths are the admin's to see"
        assert "/" in c.get("/get_server_info", headers=admin).json()["model_path"]
        r = c.post("/flush_cache", headers=user)
        assert r.status_code == 403 and "admin" in r.json()["message"]
        assert c.post("/flush_cache", headers=admin).status_code == 200


# ------------------------------------------------------------------ browsers
def test_a_cross_site_simple_request_is_refused_before_it_starts_work(tiny_client):
    before = _stats(tiny_client)["forward_passes"]
    body = '{"text": "x", "sampling_params": {"max_new_tokens": 1}}'
    for ctype in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
        r = tiny_client.post("/generate", content=body, headers={"content-type": ctype})
        assert r.status_code == 415 and r.json()["object"] == "error", (ctype, r.text)
    r = tiny_client.post("/generate", content=body)  # no Content-Type at all
    assert r.status_code == 415
    for path in ("/flush_cache", "/abort_request"):  # body-less, from a foreign page
        r = tiny_client.post(path, headers={"origin": "https://evil.example"})
        assert r.status_code == 403 and "origin" in r.json()["message"], path
    r = tiny_client.post("/generate", content=body, headers={"content-type": "application/json", "origin": "https://evil.example"})
    assert r.status_code == 403
    assert _stats(tiny_client)["forward_passes"] == before, "nothing refused may have run"
    ok = tiny_client.post("/generate", content=body, headers={"content-type": "application/json; charset=utf-8"})
    assert ok.status_code == 200 and "access-control-allow-origin" not in ok.headers


def test_a_foreign_host_header_is_refused_and_ip_or_localhost_pass(tiny_client, tiny_server):
    r = tiny_client.get("/dashboard/state", headers={"host": f"rebind.evil.example:{tiny_server.port}"})
    assert r.status_code == 403 and "--allowed-hosts" in r.json()["message"]
    for host in (f"127.0.0.1:{tiny_server.port}", f"localhost:{tiny_server.port}", "[::1]", "10.1.2.3:8000"):
        assert tiny_client.get("/v1/models", headers={"host": host}).status_code == 200, host


# ------------------------------------------------------------------ lifecycle
def test_non_streaming_disconnect_logs_no_traceback(tiny_client, tiny_server):
    start = len(tiny_server.output())
    with httpx.Client(base_url=tiny_server.base_url, timeout=0.5) as c2:
        with pytest.raises(httpx.ReadTimeout):
            c2.post("/generate", json={"text": "bye", "sampling_params": LONG})
    wait_until(lambda: _stats(tiny_client)["num_running"] == 0, 120, "the abandoned request to be aborted")
    new = tiny_server.output()[start:]
    assert "Traceback" not in new and "Exception in ASGI" not in new, new[-2000:]


def test_server_info_runs_the_full_kv_check_only_when_idle(tiny_client, tiny_server):
    got: list[httpx.Response] = []
    t = _start_long(tiny_server.base_url, {"text": "busy", "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}}, got)
    try:
        wait_until(lambda: _stats(tiny_client)["num_running"] >= 1, 60, "a running request")
        assert _stats(tiny_client)["kv_invariant_holds"] is None, "no pool walk while decoding"
    finally:
        t.join(300)
    wait_until(lambda: _stats(tiny_client)["kv_invariant_holds"] is True, 60, "the check once idle")


def test_empty_or_blank_api_key_is_refused_not_read_as_no_key(tiny_llama):
    exe = str(Path(sys.executable).parent / "radixlm")
    for args, env in (((exe, "serve", "--model-path", tiny_llama, "--api-key", ""), {}), ((exe, "serve", "--model-path", tiny_llama), {"RADIXLM_API_KEY": "  "})):
        out = subprocess.run(args, capture_output=True, text=True, timeout=120, env={**os.environ, **env}, stdin=subprocess.DEVNULL)
        assert out.returncode == 2 and "empty" in out.stderr, out.stderr


def test_keys_from_the_environment_guard_the_server_and_stay_off_its_argv(keyed_server):
    cmdline = Path(f"/proc/{keyed_server.proc.pid}/cmdline").read_bytes()
    assert ADMIN_KEY.encode() not in cmdline and API_KEY.encode() not in cmdline
    assert httpx.get(keyed_server.base_url + "/v1/models").status_code == 401
    assert httpx.get(keyed_server.base_url + "/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 200
    r = httpx.get(keyed_server.base_url + "/dashboard/state", headers={"Authorization": f"Bearer {ADMIN_KEY}"})
    assert r.status_code == 200


def test_access_log_masks_the_dashboard_login_key():
    from radixlm.runtime.entrypoints.http.guard import RedactKeyFilter

    record = logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5", "GET", "/dashboard?key=hunter2&x=1", "1.1", 303), None)
    RedactKeyFilter().filter(record)
    assert "hunter2" not in record.getMessage() and "key=***" in record.getMessage()


def test_health_turns_503_while_draining(tiny_llama):
    from helpers import ServerProcess

    srv = ServerProcess(tiny_llama, "--max-total-tokens", "1024", "--drain-timeout", "30")
    got: list[httpx.Response] = []
    try:
        t = _start_long(srv.base_url, {"text": "keep me", "sampling_params": {"max_new_tokens": 400, "ignore_eos": True}}, got)
        with httpx.Client(base_url=srv.base_url, timeout=30) as c:
            wait_until(lambda: c.get("/get_server_info").json()["stats"]["num_running"] >= 1, 60, "a running request")
            srv.proc.terminate()  # SIGTERM: drain
            deadline = time.monotonic() + 60
            codes = []
            while time.monotonic() < deadline and srv.proc.poll() is None:
                try:
                    codes.append(c.get("/health").status_code)
                except httpx.HTTPError:
                    break
                if codes[-1] == 503:
                    break
                time.sleep(0.05)
            assert 503 in codes, codes
        t.join(300)
        assert got and got[0].status_code == 200, "the running request finishes while draining"
    finally:
        srv.stop()


@pytest.mark.parametrize("choice", ["auto", "required"])
@pytest.mark.parametrize("params", [{"type": "strnig"}, {"$ref": "#/nope"}, {"type": "object", "properties": {"a": {"type": "string", "pattern": "(unclosed"}}}])
def test_a_bad_tool_schema_is_a_400_naming_tools_without_our_internal_grammar(tiny_client, choice, params):
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "tool_choice": choice, "tools": [{"type": "function", "function": {"name": "f", "parameters": params}}]}
    err = tiny_client.post("/v1/chat/completions", json=body).json()
    assert err["code"] == 400 and err["param"] == "tools", err
    assert err["message"].startswith("tools: ") and "%json" not in err["message"] and "<tool_call>" not in err["message"], err["message"]
