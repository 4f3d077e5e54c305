"""Cache explanations and cache control over HTTP: /generate, the OpenAI routes (extra_body,
cache_control), GET /cache_explanations behind the API key, the metrics, and explain-cache."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from helpers import ADMIN_KEY
from helpers import API_KEY as KEY

PREFIX = list(range(300, 340))
GREEDY = {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server  # the session's shared server with --api-key KEY (its clean exit is checked at the end)


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server.base_url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        yield c


def _generate(client, ids, **extra) -> dict:
    r = client.post("/generate", json={"input_ids": ids, "sampling_params": GREEDY, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_returns_cache_info_naming_the_program_that_computed_the_prefix(client):
    a = _generate(client, PREFIX + [1, 2], program="few_shot", prompt_cache_key="s1", return_cache_info=True)
    b = _generate(client, PREFIX + [3, 4], return_cache_info=True)
    assert "cache_info" in a["meta_info"]
    (seg,) = b["meta_info"]["cache_info"]["segments"]
    assert (seg["start"], seg["end"], seg["origin_rid"]) == (0, 40, a["meta_info"]["id"])
    assert seg["program"] == "few_shot" and seg["prompt_cache_key"] == "s1" and seg["reuse_count"] == 1
    plain = _generate(client, PREFIX + [5])
    assert "cache_info" not in plain["meta_info"]


def test_openai_routes_take_return_cache_info_and_prompt_cache_key_in_extra_body(server):
    oai = openai.OpenAI(base_url=server.base_url + "/v1", api_key=KEY)
    messages = [{"role": "system", "content": "You answer in one word. " * 8, "cache_control": {"type": "ephemeral", "ttl": 600}}, {"role": "user", "content": "Hi"}]
    extra = {"return_cache_info": True, "prompt_cache_key": "chat-1"}
    oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra)
    messages[1]["content"] = "Hello there"
    second = oai.chat.completions.create(model="tiny", messages=messages, max_tokens=2, temperature=0, extra_body=extra)
    info = second.choices[0].model_extra["cache_info"]
    # the template's opening may be cached by an earlier test's chat: the system prompt's own segment is last
    assert info["cached_tokens"] > 0 and info["segments"][-1]["prompt_cache_key"] == "chat-1"
    comp = oai.completions.create(model="tiny", prompt=PREFIX, max_tokens=2, temperature=0, extra_body={"return_cache_info": True})
    assert comp.choices[0].model_extra["cache_info"]["prompt_tokens"] == 40


def test_retention_hits_show_in_metrics_and_stats(client):
    _generate(client, PREFIX + [9, 9], cache_ttl=600)
    before = client.get("/get_server_info").json()["stats"]["retention_hits"]
    _generate(client, PREFIX + [9, 9, 9])
    stats = client.get("/get_server_info").json()["stats"]
    assert stats["retention_hits"] == before + 1 and stats["kv_invariant_holds"]
    metrics = client.get("/metrics").text
    line = next(x for x in metrics.splitlines() if x.startswith("radixlm_cache_retention_hits_total"))
    assert float(line.split()[-1]) >= 1
    assert "radixlm_cache_evictions_despite_hint_total" in metrics


@pytest.mark.parametrize(
    "route, body, field",
    [
        ("/generate", {"input_ids": [1, 2], "cache_ttl": -5}, "cache_ttl"),
        ("/generate", {"input_ids": [1, 2], "return_cache_info": "yes"}, "return_cache_info"),
        ("/generate", {"input_ids": [1, 2], "program": ""}, "program"),
        ("/v1/completions", {"prompt": "hi", "prompt_cache_key": ""}, "prompt_cache_key"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "forever"}}]}, "cache_control"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi", "cache_control": {"type": "ephemeral", "ttl": 0}}]}, "cache_control"),
    ],
)
def test_bad_cache_fields_are_400_naming_the_field(client, route, body, field):
    r = client.post(route, json=body)
    assert r.status_code == 400, r.text
    assert field in (r.json()["param"] or "") and r.json()["object"] == "error"


def test_cache_explanations_route_needs_the_api_key_and_validates_last(server, client):
    assert httpx.get(server.base_url + "/cache_explanations").status_code == 401
    assert client.get("/cache_explanations", params={"last": "x"}).json()["param"] == "last"
    _generate(client, PREFIX + [7])
    data = client.get("/cache_explanations", params={"last": 2}).json()["data"]
    assert len(data) == 2 and data[-1]["cached_tokens"] == 40


def test_explain_cache_cli_prints_the_origin_and_the_stop(server, client):
    _generate(client, PREFIX + [8, 8], program="cli_prog")
    rid = _generate(client, PREFIX + [8, 8, 8])["meta_info"]["id"]
    cli = Path(sys.executable).parent / "radixlm"
    # the admin key, from the environment (never on the command line): rids and labels shown
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXLM_")}
    run = subprocess.run([str(cli), "explain-cache", "--base-url", server.base_url, "--last", "1"], capture_output=True, text=True, timeout=120, env={**env, "RADIXLM_ADMIN_API_KEY": ADMIN_KEY})
    assert run.returncode == 0, run.stderr
    assert f"request {rid}" in run.stdout and "program cli_prog" in run.stdout and "match stopped at token" in run.stdout
    # the API key alone: the caller's tenant only, as counts
    user = subprocess.run([str(cli), "explain-cache", "--base-url", server.base_url, "--last", "1"], capture_output=True, text=True, timeout=120, env={**env, "RADIXLM_API_KEY": KEY})
    assert user.returncode == 0 and rid not in user.stdout and "(hidden)" in user.stdout and "match stopped at token" in user.stdout, user.stdout
    refused = subprocess.run([str(cli), "explain-cache", "--base-url", server.base_url], capture_output=True, text=True, timeout=120, env=env)
    assert refused.returncode == 1 and "401" in refused.stderr
