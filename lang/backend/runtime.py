"""Runtime: start ``radixlm serve`` as a child process and use it as a backend.

The child serves on a socket bound here first (``--listen-fd``, so no other local user can take
its port before it binds), gets the keys in its environment (never on its command line, which
every local user can read), and runs as ``python -P -m radixlm`` from ``/`` (nothing planted in
the caller's folder or in /tmp is imported, or taken for a model name).
"""

from __future__ import annotations

import atexit
import dataclasses
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from radixlm.lang.backend.base import BackendError
from radixlm.lang.backend.endpoint import RuntimeEndpoint
from radixlm.runtime.entrypoints.secrets import (
    ADMIN_KEY_ENV,
    API_KEY_ENV,
    child_environ,
    resolve_key,
)
from radixlm.runtime.entrypoints.spawn import (
    CHILD_CWD,
    bound_port,
    listening_socket,
    radixlm_command,
)
from radixlm.runtime.server_args import ServerArgs

_SERVE_OPTIONS = {"max_queued_requests", "served_model_name"}
_PATH_OPTIONS = {"tokenizer_path", "speculative_draft_model_path"}


class Runtime(RuntimeEndpoint):
    """A ``radixlm serve`` child process (any ServerArgs as keywords), stopped by ``shutdown`` or at exit."""

    def __init__(
        self,
        model_path: str | None = None,
        *,
        api_key: str | None = None,
        admin_api_key: str | None = None,
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
        # checked here, before anything starts; they go in the child's environment, not its argv
        env = child_environ(resolve_key(api_key, API_KEY_ENV, "api_key", environ={}), resolve_key(admin_api_key, ADMIN_KEY_ENV, "admin_api_key", environ={}))
        # the child runs from CHILD_CWD: a relative path that names something here keeps its meaning
        model_path = _absolute(model_path)
        for name in _PATH_OPTIONS & set(server_args):
            server_args[name] = _absolute(server_args[name])
        with listening_socket(host, port or 0) as sock:  # the child holds its own copy once started
            self.port = bound_port(sock)
            self.url = f"http://{host}:{self.port}"
            options: dict[str, Any] = {"model_path": model_path, "host": host, "port": self.port, **server_args}
            self.log_path = log_file or tempfile.mkstemp(prefix=f"radixlm-runtime-{self.port}-", suffix=".log")[1]
            self._log = open(self.log_path, "w")
            cmd = [*_command(options), "--listen-fd", str(sock.fileno())]
            self.process = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=CHILD_CWD, env=env, pass_fds=[sock.fileno()])
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


def _absolute(path: str | None) -> str | None:
    """``path`` made absolute when it names something from here (a hub id stays as it is)."""
    return os.path.abspath(path) if path is not None and os.path.exists(path) else path


def _command(options: dict[str, Any]) -> list[str]:
    """``radixlm serve`` with ``options`` as flags (the keys are never among them)."""
    cmd = [*radixlm_command(), "serve"]
    for key, value in options.items():
        if value is None or value is False:
            continue
        cmd.append("--" + key.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd
