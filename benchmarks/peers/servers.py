"""Start and stop the servers compared by benchmarks/compare.py, each on 127.0.0.1, by pid.

radixlm runs from the project's .venv; the peers from the cache folder their install scripts
filled (``PEERS_DIR``, default ``~/.cache/radixlm/peers``).
"""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

PEERS_DIR = Path(os.environ.get("PEERS_DIR", Path.home() / ".cache" / "radixlm" / "peers"))
LLAMA_SERVER = PEERS_DIR / "llama.cpp" / "build" / "bin" / "llama-server"
VLLM_PYTHON = PEERS_DIR / "vllm-venv" / "bin" / "python"
HF_FOLDER = PEERS_DIR / "smollm2-hf"


@dataclass
class Launched:
    """A running server."""

    name: str
    base_url: str
    proc: subprocess.Popen
    log: Path
    config: str
    extra_body: dict = field(default_factory=dict)


def free_port() -> int:
    """An unused loopback port."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def installed() -> list[str]:
    """Names of the systems that can be started here."""
    names = ["radixlm"]
    if LLAMA_SERVER.is_file():
        names.append("llama.cpp")
    if VLLM_PYTHON.is_file() and (HF_FOLDER / "config.json").is_file():
        names.append("vllm")
    return names


def _spawn(name: str, cmd: list[str], env: dict | None, port: int, config: str, health: str, timeout: float, extra_body: dict | None = None) -> Launched:
    log = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-{name}-{port}.log"
    # cwd outside the repository: from its root, ./kernels would shadow the package transformers probes for
    PEERS_DIR.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(cmd, stdout=open(log, "w"), stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, cwd=PEERS_DIR)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = [line for line in log.read_text(errors="replace").splitlines() if line.strip()][-1:]
            raise RuntimeError(f"{name} exited with {proc.returncode} ({tail[0].strip()[:200] if tail else 'no output'}); see {log}")
        try:
            if httpx.get(base + health, timeout=2).status_code == 200:
                return Launched(name, base, proc, log, config, extra_body or {})
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{name} did not become healthy in {timeout:.0f} s; see {log}")


def start(name: str, threads: int = 2, radixlm_args: tuple[str, ...] = ()) -> Launched:
    """Start ``name`` (radixlm, llama.cpp or vllm) with the default SmolLM2 model."""
    port = free_port()
    if name == "radixlm":
        cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--port", str(port), *radixlm_args]
        return _spawn(name, cmd, {"RADIXLM_NUM_THREADS": str(threads)}, port, " ".join(["radixlm serve", *radixlm_args]), "/health", 300)
    if name == "llama.cpp":
        from radixlm.runtime.loader import default_model_path

        args = ["-m", default_model_path(), "-t", str(threads), "-tb", str(threads), "--parallel", "8", "--cont-batching", "-c", "8192", "--cache-prompt", "--port", str(port), "--host", "127.0.0.1"]
        return _spawn(name, [str(LLAMA_SERVER), *args], None, port, "llama-server " + " ".join(args[2:-4]) + " (Q4_1 GGUF)", "/health", 300)
    if name == "vllm":
        args = ["-m", "vllm.entrypoints.openai.api_server", "--model", str(HF_FOLDER), "--served-model-name", "smollm2", "--dtype", "float32", "--enable-prefix-caching", "--max-model-len", "8192", "--port", str(port), "--host", "127.0.0.1"]
        env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "4", "OMP_NUM_THREADS": str(threads)}
        return _spawn(name, [str(VLLM_PYTHON), *args], env, port, "vllm (CPU build) fp32, prefix caching", "/v1/models", 900)
    raise ValueError(f"unknown system {name!r}")


@contextlib.contextmanager
def llama_server_on(model: Path, threads: int, slots: int = 32, context: int = 16384, warmup: bool = True) -> Iterator[Launched]:
    """llama-server on the GGUF file ``model`` (``slots`` parallel sequences sharing ``context``
    tokens) on loopback, yielded once healthy and stopped after."""
    port = free_port()
    args = ["-m", str(model), "-t", str(threads), "-tb", str(threads), "--parallel", str(slots), "-c", str(context), "--port", str(port), "--host", "127.0.0.1"]
    server = _spawn("llama.cpp", [str(LLAMA_SERVER), *args, *([] if warmup else ["--no-warmup"])], None, port, "llama-server " + " ".join(args[2:-4]), "/health", 600)
    try:
        yield server
    finally:
        stop(server)
        server.log.unlink(missing_ok=True)


def stop(server: Launched) -> None:
    """Terminate by pid and wait."""
    if server.proc.poll() is None:
        server.proc.terminate()
        try:
            server.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.proc.kill()
            server.proc.wait()
