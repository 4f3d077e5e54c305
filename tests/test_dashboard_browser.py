"""The dashboard in a real headless Chromium against a server under load: it draws and it updates.

Skipped (with the reason) where no chromium binary exists; under CI=true that is a failure.
``make setup`` installs Debian's chromium where apt-get can.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest

BROWSERS = ("chromium", "chromium-browser", "google-chrome", "chrome")


def _browser() -> str:
    for name in BROWSERS:
        path = shutil.which(name)
        if path:
            return path
    reason = "no chromium binary on PATH (install Debian's chromium package; `make setup` does where apt-get can)"
    if os.environ.get("CI") == "true":
        pytest.fail(reason + ": CI must run the browser test")
    pytest.skip(reason)


def _run_browser(binary: str, profile: str, url: str, *mode: str) -> str:
    cmd = [binary, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", f"--user-data-dir={profile}", "--window-size=1400,1000", "--virtual-time-budget=3000", *mode, url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True).stdout


def _view(dom: str) -> dict:
    running = re.search(r'<table id="running">(.*?)</table>', dom, re.S)
    out = re.search(r'id="stat-out">(\d+)<', dom)
    return {
        "polls": int(re.search(r'data-polls="(\d+)"', dom).group(1)),
        "tree_nodes": len(re.findall(r'<rect [^>]*class="node"', dom)),
        "running_rows": re.findall(r'<tr data-rid="([^"]*)"', running.group(1)) if running else [],
        "progress": re.findall(r'<td class="progress">.*?(\d+ / \d+)</td>', running.group(1), re.S) if running else [],
        "output_tokens": int(out.group(1)) if out else None,
    }


def _until(fetch, ok, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    value = None
    while time.monotonic() < deadline:
        value = fetch()
        if ok(value):
            return value
    raise AssertionError(f"condition not reached; last value: {value}")


def test_dashboard_in_headless_chromium_draws_tree_and_queues_and_updates_under_load(tiny_server, tmp_path):
    binary = _browser()
    srv = tiny_server
    stop = threading.Event()

    def load(i: int) -> None:
        sp = {"max_new_tokens": 300, "temperature": 0.8, "ignore_eos": True, **({"regex": "[a-z ]{1,300}"} if i == 3 else {})}
        with httpx.Client(base_url=srv.base_url, timeout=300) as c:
            while not stop.is_set():
                c.post("/generate", json={"text": f"Radix trees share prefixes; request {i}", "sampling_params": sp})

    workers = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(4)]
    for w in workers:
        w.start()
    url, profile = srv.base_url + "/dashboard", str(tmp_path / "profile")
    try:
        first = _until(lambda: _view(_run_browser(binary, profile, url, "--dump-dom")), lambda v: v["polls"] >= 2 and v["tree_nodes"] > 0 and v["running_rows"] and v["progress"])
        second = _until(lambda: _view(_run_browser(binary, profile, url, "--dump-dom")), lambda v: v["running_rows"] and v["output_tokens"] > first["output_tokens"])
        assert second["output_tokens"] > first["output_tokens"] and second["tree_nodes"] > 0
        assert (second["running_rows"], second["progress"]) != (first["running_rows"], first["progress"]), "the queue view is live"
        shot = tmp_path / "dashboard.png"
        _run_browser(binary, profile, url, f"--screenshot={shot}")
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    finally:
        stop.set()
        for w in workers:
            w.join(timeout=300)
