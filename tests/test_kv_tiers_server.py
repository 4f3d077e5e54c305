"""KV tiers through the server: usage, metrics and cache explanations by tier, and a SIGKILL restart."""

from __future__ import annotations

import time

import httpx
from test_kv_tiers import ONE_BLOCK_GB, block_files, conversations

from helpers import ServerProcess

GREEDY = {"max_new_tokens": 4, "temperature": 0.0}


def _generate(base: str, ids: list[int]) -> dict:
    r = httpx.post(f"{base}/generate", json={"input_ids": ids, "sampling_params": GREEDY, "return_cache_info": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _wait_for_files(folder, count: int, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while len(block_files(folder)) < count:
        assert time.monotonic() < deadline, f"{len(block_files(folder))} block files after {timeout} s, wanted {count}"
        time.sleep(0.05)


def test_tiers_show_in_usage_metrics_and_explanations_and_survive_sigkill(tiny_llama, tmp_path):
    args = ("--max-total-tokens", "160", "--kv-cache-dtype", "int8", "--kv-host-cache-gb", str(ONE_BLOCK_GB * 8),
            "--kv-disk-cache-dir", str(tmp_path), "--kv-tier-block-tokens", "32")
    a, b, c = conversations(count=3, length=130, seed=3)
    server = ServerProcess(tiny_llama, *args)
    try:
        base = server.base_url
        for ids in (a, b, c):  # b evicts a, c evicts b: each is demoted to host and written through to disk
            _generate(base, ids)
        _wait_for_files(tmp_path, 8)
        again = _generate(base, a)["meta_info"]
        assert again["cached_tokens_details"]["host"] == 128, again["cached_tokens_details"]
        assert {s["tier"] for s in again["cache_info"]["segments"]} == {"host"}
        usage = httpx.post(f"{base}/v1/completions", json={"model": "m", "prompt": b, "max_tokens": 2, "temperature": 0}, timeout=120).json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens_details"]["host"] == 128, usage
        metrics = httpx.get(f"{base}/metrics", timeout=30).text
        assert 'radixlm_kv_tier_hit_tokens_total{tier="host"} 256.0' in metrics
        assert 'radixlm_kv_tier_demoted_blocks_total{tier="disk"}' in metrics
        server.proc.kill()  # no shutdown: only what was written through survives
        server.proc.wait(timeout=60)
    finally:
        server.stop()
    restarted = ServerProcess(tiny_llama, *args)
    try:
        follow_up = c + [9, 9, 9, 9]
        meta = _generate(restarted.base_url, follow_up)["meta_info"]
        assert meta["cached_tokens_details"]["disk"] == 128, meta["cached_tokens_details"]
        assert {s["tier"] for s in meta["cache_info"]["segments"]} == {"disk"}
    finally:
        restarted.stop()
