"""Runtime: start ``radixlm serve`` as a child process on a free port and use it as a backend."""

from __future__ import annotations

import atexit
import dataclasses
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from radixlm.lang.backend.base import BackendError
from radixlm.lang.backend.endpoint import RuntimeEndpoint
from radixlm.runtime.server_args import ServerArgs

_SERVE_OPTIONS = {"max_queued_requests", "served_model_name"}


class Runtime(RuntimeEndpoint):
    """A ``radixlm serve`` child process (any ServerArgs as keywords), stopped by ``shutdown`` or at exit."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        api_key: str | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        startup_timeout: float = 300.0,
        log_file: str | None = None,
        **server_args: Any,
    ) -> None:
        known = {f.name for f in dataclasses.fields(ServerArgs)} | _SERVE_OPTIONS
        unknown = sorted(set(server_args) - known)
        if unknown:
            raise ValueError(f"unknown server argument {unknown[0]!r}")
        self.port = port or _free_port(host)
        self.url = f"http://{host}:{self.port}"
        if model_path is not None and os.path.exists(model_path):
            model_path = os.path.abspath(model_path)
        options: dict[str, Any] = {"model_path": model_path, "host": host, "port": self.port, "api_key": api_key, **server_args}
        self.log_path = log_file or tempfile.mkstemp(prefix=f"radixlm-runtime-{self.port}-", suffix=".log")[1]
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen(_command(options), stdout=self._log, stderr=subprocess.STDOUT, cwd=tempfile.gettempdir())
        atexit.register(self.shutdown)
        try:
            self._wait_healthy(startup_timeout)
        except BaseException:
            self.shutdown()
            raise
        super().__init__(self.url, api_key=api_key)

    @property
    def endpoint(self) -> RuntimeEndpoint:
        """This runtime as an endpoint (SGLang's ``Runtime.endpoint``)."""
        return self

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendError(f"radixlm serve exited with status {self.process.returncode}:\n{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise BackendError(f"radixlm serve did not become healthy in {timeout:g} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 40) -> str:
        """The last lines the server printed."""
        self._log.flush()
        return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-lines:])

    def shutdown(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 30 s) and close the connections."""
        atexit.unregister(self.shutdown)
        if hasattr(self, "client"):
            super().shutdown()
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _command(options: dict[str, Any]) -> list[str]:
    script = Path(sys.executable).parent / "radixlm"
    cmd = [str(script), "serve"] if script.exists() else [sys.executable, "-m", "radixlm", "serve"]
    for key, value in options.items():
        if value is None or value is False:
            continue
        cmd.append("--" + key.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd
