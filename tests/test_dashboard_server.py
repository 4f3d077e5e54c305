"""GET /dashboard and /dashboard/state on a real server: consistency, queues, bad input, API key."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from helpers import ADMIN_KEY, API_KEY

LONG = {"max_new_tokens": 400, "temperature": 0.8, "ignore_eos": True}


def _wait_for(fetch, ok, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = fetch()
        if ok(value):
            return value
        time.sleep(0.1)
    raise AssertionError(f"condition not reached; last value: {value}")


def test_dashboard_page_is_served_self_contained(tiny_client):
    r = tiny_client.get("/dashboard")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    for element in ('id="tree"', 'id="running"', 'id="waiting"', 'id="kv-chart"', "dashboard/state"):
        assert element in r.text
    assert "http://" not in r.text.replace("http://www.w3.org/2000/svg", "") and "https://" not in r.text, "no CDN"


def test_dashboard_state_tree_is_consistent_with_the_servers_integrity_check(tiny_client):
    prompts = ["The quick brown fox jumps", "The quick brown fox runs", "Radix trees share prefixes"]
    for p in prompts:
        assert tiny_client.post("/generate", json={"text": p, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}).status_code == 200
    state = tiny_client.get("/dashboard/state").json()
    stats = tiny_client.get("/get_server_info").json()["stats"]
    assert stats["kv_invariant_holds"]
    tree = state["tree"]
    assert tree["complete"] and tree["nodes"][0]["size"] == tree["total_tokens"] == stats["tree_slots"] > 0
    assert sum(n["len"] for n in tree["nodes"]) == stats["tree_slots"]
    assert all(n["lock"] == 0 for n in tree["nodes"]) and tree["protected"] == 0, "nothing runs: nothing locked"
    # no admin key on this server: nobody may read token text through the dashboard
    assert state["redacted"] and not any("text" in n or "head" in n for n in tree["nodes"])
    assert all(n["age_s"] is None or n["age_s"] >= 0 for n in tree["nodes"])
    assert state["counters"]["output_tokens"] >= 12 and state["history"], "history is recorded server-side"


def test_dashboard_state_shows_running_requests_with_hit_progress_and_constraint(tiny_client, tiny_server):
    tiny_client.post("/generate", json={"text": "Question: what is two plus two?", "sampling_params": {"max_new_tokens": 1}})

    def send(sp):
        with httpx.Client(base_url=tiny_server.base_url, timeout=300) as c:
            c.post("/generate", json={"text": "Question: what is two plus two? Answer", "sampling_params": sp})

    # the regex cannot end before 1000 characters, so the grammar never ends the request early
    # (with "{1,400}" the random model may pick EOS after a few tokens and finish before a poll)
    threads = [threading.Thread(target=send, args=(sp,)) for sp in (LONG, {**LONG, "regex": "[a-z ]{1000}"})]
    for t in threads:
        t.start()
    try:
        state = _wait_for(lambda: tiny_client.get("/dashboard/state").json(), lambda s: len(s["queues"]["running"]) == 2 and all(r["out"] > 0 for r in s["queues"]["running"]))
        rows = state["queues"]["running"]
        assert sorted(str(r["constraint"]) for r in rows) == ["None", "regex"]
        assert all(r["hit"] > 0 and r["max"] == 400 and r["phase"] == "decode" for r in rows)
        locked = [n for n in state["tree"]["nodes"] if n.get("lock")]
        assert locked and sum(n["len"] for n in locked) == state["tree"]["protected"]
        later = _wait_for(lambda: tiny_client.get("/dashboard/state").json(), lambda s: s["counters"]["output_tokens"] > state["counters"]["output_tokens"])
        assert later["now"] > state["now"]
    finally:
        for t in threads:
            t.join(timeout=300)


@pytest.mark.parametrize(("query", "param"), [("max_nodes=0", "max_nodes"), ("max_nodes=abc", "max_nodes"), ("max_nodes=999999", "max_nodes"), ("since=nan", "since"), ("since=x", "since")])
def test_dashboard_state_rejects_bad_query_naming_the_field(tiny_client, query, param):
    r = tiny_client.get("/dashboard/state?" + query)
    assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["param"] == param


def test_dashboard_routes_require_the_admin_key_when_one_is_set(keyed_server):
    srv = keyed_server
    for path in ("/dashboard", "/dashboard/state"):
        assert httpx.get(srv.base_url + path).status_code == 401, path
        assert httpx.get(srv.base_url + path, headers={"Authorization": "Bearer wrong"}).status_code == 401, path
        assert httpx.get(srv.base_url + path, headers={"Authorization": f"Bearer {API_KEY}"}).status_code == 403, path
        assert httpx.get(srv.base_url + path, headers={"Authorization": f"Bearer {ADMIN_KEY}"}).status_code == 200, path


def test_dashboard_shows_token_text_to_the_admin_only(keyed_server):
    admin, user = ({"Authorization": f"Bearer {k}"} for k in (ADMIN_KEY, API_KEY))
    r = httpx.post(keyed_server.base_url + "/generate", json={"text": "Admin sees this prefix", "sampling_params": {"max_new_tokens": 2}}, headers=user, timeout=120)
    assert r.status_code == 200
    state = httpx.get(keyed_server.base_url + "/dashboard/state", headers=admin).json()
    nodes = {n["id"]: n for n in state["tree"]["nodes"]}

    def path_text(node: dict) -> str:  # other prompts may share the first tokens: read the whole path
        return (path_text(nodes[node["parent"]]) if node["parent"] is not None else "") + node.get("text", "")

    assert not state.get("redacted") and any("Admin sees this prefix" in path_text(n) for n in nodes.values())


def test_dashboard_login_sets_an_expiring_derived_token_not_the_key(keyed_server):
    srv = keyed_server
    assert httpx.get(srv.base_url + "/dashboard?key=wrong").status_code == 401
    login = httpx.get(srv.base_url + f"/dashboard?key={ADMIN_KEY}")
    assert login.status_code == 303 and login.headers["location"] == "/dashboard"
    cookie = login.headers["set-cookie"]
    assert "HttpOnly" in cookie and "Max-Age=" in cookie and "SameSite=Strict" in cookie
    assert ADMIN_KEY not in cookie and API_KEY not in cookie, "the cookie must never carry a key"
    with httpx.Client(base_url=srv.base_url, cookies=login.cookies) as browser:
        assert browser.get("/dashboard").status_code == 200
        assert browser.get("/dashboard/state").status_code == 200
        assert browser.get("/get_server_info").status_code == 401, "the token opens the dashboard's routes only"
    token = login.cookies["radixlm_dashboard"]
    level, expiry, mac = token.split(".")
    forged = f"{level}.{int(expiry) + 10**6}.{mac}"  # a longer life under the same MAC
    assert httpx.get(srv.base_url + "/dashboard/state", cookies={"radixlm_dashboard": forged}).status_code == 401
    assert httpx.get(srv.base_url + "/dashboard/state", cookies={"radixlm_api_key": ADMIN_KEY}).status_code == 401, "the old raw-key cookie is gone"
    # a user-level token (from the API key) does not open a dashboard that needs the admin key
    user = httpx.get(srv.base_url + f"/dashboard?key={API_KEY}")
    assert user.status_code == 303 and API_KEY not in user.headers["set-cookie"]
    assert httpx.get(srv.base_url + "/dashboard/state", cookies=user.cookies).status_code == 403
