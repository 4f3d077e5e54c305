"""Screenshot of the cache dashboard under the few-shot workload (benchmarks/results/dashboard.png).

Starts ``radixlm serve`` (the embedded SmolLM2 unless --model-path), sends the few-shot prompts
from 8 concurrent clients (one of them regex-constrained) for --seconds, then has headless
Chromium load /dashboard and save a screenshot while the load still runs.

    python benchmarks/dashboard_screenshot.py [--model-path PATH] [--seconds 40]
"""

from __future__ import annotations

import argparse
import shutil
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from workloads import few_shot_prompts  # noqa: E402


def main() -> int:
    """Run the load, take the screenshot, stop the server."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--seconds", type=float, default=40.0)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "dashboard.png"))
    ns = ap.parse_args()
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    if browser is None:
        raise SystemExit("no chromium binary (apt-get install chromium)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--port", str(port), *(["--model-path", ns.model_path] if ns.model_path else [])]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    stop = threading.Event()
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        prompts = few_shot_prompts(64)

        def client(i: int) -> None:
            sp = {"max_new_tokens": 48, "temperature": 0.7, "ignore_eos": True, **({"regex": "[A-Z][a-z]+( [a-z]+){2,8}\\."} if i == 7 else {})}
            with httpx.Client(base_url=base, timeout=600) as c:
                k = i
                while not stop.is_set():
                    c.post("/generate", json={"text": prompts[k % len(prompts)], "sampling_params": sp})
                    k += 8

        workers = [threading.Thread(target=client, args=(i,), daemon=True) for i in range(8)]
        for w in workers:
            w.start()
        time.sleep(ns.seconds)  # let the history fill (a figure script, not a test)
        subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--window-size=1400,1000",
                        "--virtual-time-budget=3000", f"--screenshot={ns.out}", base + "/dashboard"], check=True, capture_output=True, timeout=120)
        print(f"wrote {ns.out}")
    finally:
        stop.set()
        server.terminate()
        server.wait(timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
