"""``radixlm serve --dp-size N``: N engine servers (child processes on loopback ports) behind the
router, which serves on --host/--port in this process.

Each worker serves on a socket this process bound and put in listen state first (``--listen-fd``):
no other local user can take its port between a check and the worker's bind. The keys reach
the workers through their environment, never their command lines (readable by every local user).

SIGTERM or SIGINT: the router refuses new requests (503) while every worker drains with its own
--drain-timeout; once all have exited the router stops and the command exits 0, or 1 if a
worker died on its own (which also shuts the others down, so a supervisor restarts the group).
A worker that fails to start stops the others and the command exits 1 with its output.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import httpx
import uvicorn

from radixlm.runtime.entrypoints.router.app import create_router_app
from radixlm.runtime.entrypoints.router.config import RouterConfig
from radixlm.runtime.entrypoints.secrets import child_environ, command_keys
from radixlm.runtime.entrypoints.spawn import bound_port, listening_socket, radixlm_command

logger = logging.getLogger(__name__)
# not passed on: the launcher's own, or given otherwise (the keys by environment, the socket by fd)
_NOT_PASSED = {"dp_size", "router_policy", "host", "port", "num_threads", "help", "command", "api_key", "admin_api_key", "listen_fd"}


@dataclass
class WorkerProcess:
    """One ``radixlm serve`` child: its index, port, process and its last lines of output."""

    index: int
    port: int
    proc: subprocess.Popen
    tail: deque = field(default_factory=lambda: deque(maxlen=40))

    @property
    def url(self) -> str:
        """Where it serves."""
        return f"http://127.0.0.1:{self.port}"

    def output(self) -> str:
        """Its last lines of output."""
        return "".join(self.tail)


class StartupFailed(RuntimeError):
    """A worker exited, or never became healthy, before the router could start."""


def passed_options(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> list[str]:
    """The command-line options of ``ns`` that differ from their defaults, as arguments again
    (what every worker gets besides its own --listen-fd, --port, --host and --num-threads; never
    the keys, which go by environment)."""
    out: list[str] = []
    for action in parser._actions:
        if not action.option_strings or action.dest in _NOT_PASSED:
            continue
        value = getattr(ns, action.dest, action.default)
        if value == action.default:
            continue
        flag = max(action.option_strings, key=len)
        if isinstance(action, argparse._StoreTrueAction):
            out.append(flag)
        else:
            out += [flag, str(value)]
    return out


def _cuda_devices(device: str) -> list[str] | None:
    """The visible CUDA devices when workers run on CUDA, else None (torch only if needed)."""
    if device == "cpu" or (device == "auto" and not os.path.exists("/dev/nvidiactl")):
        return None
    import torch

    if not torch.cuda.is_available():
        if device == "auto":
            return None
        raise ValueError("--device cuda but CUDA is not available")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(torch.cuda.device_count())]


def _die_with_parent():
    """A preexec_fn that asks Linux to SIGTERM the child when the launcher dies (even killed);
    None elsewhere. libc is looked up here, in the parent: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    pr_set_pdeathsig = 1
    return lambda: prctl(pr_set_pdeathsig, signal.SIGTERM)


def start_workers(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> list[WorkerProcess]:
    """Start ``ns.dp_size`` workers, each on its own socket bound here, with its threads and (on
    CUDA) devices, and the keys in its environment."""
    n, tp = ns.dp_size, getattr(ns, "tp_size", 1) or 1
    threads = ns.num_threads if ns.num_threads is not None else max(1, (os.cpu_count() or 1) // (n * tp))
    devices = _cuda_devices(getattr(ns, "device", "auto"))
    if devices is not None and len(devices) < n * tp:
        raise ValueError(f"--dp-size {n} x --tp-size {tp} needs {n * tp} GPUs, {len(devices)} visible")
    common = passed_options(ns, parser)
    api_key, admin_key = command_keys(ns)
    preexec = _die_with_parent()
    workers: list[WorkerProcess] = []
    try:
        for i in range(n):
            env = child_environ(api_key, admin_key)
            if devices is not None:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(devices[i * tp : (i + 1) * tp])
            with listening_socket("127.0.0.1") as sock:  # the child holds its own copy once started
                port, fd = bound_port(sock), sock.fileno()
                cmd = [*radixlm_command(), "serve", *common, "--listen-fd", str(fd), "--host", "127.0.0.1", "--port", str(port), "--num-threads", str(threads)]
                proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, text=True, errors="replace", preexec_fn=preexec, pass_fds=[fd])
            w = WorkerProcess(i, port, proc)
            threading.Thread(target=_pump, args=(w,), name=f"radixlm-worker-{i}-log", daemon=True).start()
            workers.append(w)
    except BaseException:
        stop_workers(workers, timeout=10)
        raise
    return workers


def _pump(w: WorkerProcess) -> None:
    """Copy a worker's output to our stderr, prefixed, keeping its last lines."""
    assert w.proc.stdout is not None
    for line in w.proc.stdout:
        w.tail.append(line)
        sys.stderr.write(f"[worker {w.index}] {line}")
        sys.stderr.flush()


def wait_healthy(workers: list[WorkerProcess], timeout: float | None = None) -> None:
    """Block until every worker's /health answers 200; StartupFailed if one exits or time runs out."""
    deadline = None if timeout is None else time.monotonic() + timeout
    pending = list(workers)
    with httpx.Client(timeout=2) as client:
        while pending:
            for w in list(pending):
                if w.proc.poll() is not None:
                    time.sleep(0.2)  # let its last lines arrive
                    raise StartupFailed(f"worker {w.index} exited with status {w.proc.returncode}:\n{w.output()}")
                try:
                    if client.get(w.url + "/health").status_code == 200:
                        pending.remove(w)
                except httpx.HTTPError:
                    pass
            if deadline is not None and time.monotonic() > deadline:
                raise StartupFailed(f"worker {pending[0].index} did not become healthy in {timeout} s:\n{pending[0].output()}")
            if pending:
                time.sleep(0.3)


def stop_workers(workers: list[WorkerProcess], timeout: float) -> None:
    """SIGTERM every live worker, wait up to ``timeout`` s, then SIGKILL what is left."""
    for w in workers:
        if w.proc.poll() is None:
            w.proc.terminate()
    deadline = time.monotonic() + timeout
    for w in workers:
        try:
            w.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            w.proc.kill()
            w.proc.wait()


def run_dp(ns: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Start the workers, then serve the router until SIGTERM/SIGINT; the exit status."""
    stop = threading.Event()
    # ours until uvicorn installs its own (and again after it ends): a signal never kills this
    # process while its workers run
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    workers = start_workers(ns, parser)
    try:
        _wait_or_stop(workers, stop)
    except StartupFailed as exc:
        print(f"radixlm: error: {exc}", file=sys.stderr, flush=True)
        stop_workers(workers, timeout=10)
        return 1
    except BaseException:
        stop_workers(workers, timeout=10)
        raise
    if stop.is_set():
        stop_workers(workers, timeout=max(ns.drain_timeout + 10, 10))
        return 0
    api_key, admin_key = command_keys(ns)
    config = RouterConfig(worker_urls=[w.url for w in workers], policy=ns.router_policy, api_key=api_key, admin_api_key=admin_key, allowed_hosts=list(ns.allowed_hosts), allowed_origins=list(ns.allowed_origins))
    app = create_router_app(config)
    group = _Group(workers, app.state.router, stop)
    server = _RouterServer(uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=5), group)
    group.server = server
    threading.Thread(target=group.watch, name="radixlm-dp-watch", daemon=True).start()
    print(f"radixlm router on http://{ns.host}:{ns.port} over {len(workers)} workers: {', '.join(w.url for w in workers)}", flush=True)
    try:
        server.run()
    finally:
        if not group.all_exited():  # the router stopped for another reason (its port taken)
            group.shutdown()
        stop_workers(workers, timeout=max(ns.drain_timeout + 10, 10))
    return 1 if group.died or any(w.proc.returncode != 0 for w in workers) else 0


def _wait_or_stop(workers: list[WorkerProcess], stop: threading.Event) -> None:
    """wait_healthy, in a thread, so that a signal during start-up ends the wait at once."""
    result: list[BaseException | None] = []

    def wait() -> None:
        try:
            wait_healthy(workers)
            result.append(None)
        except BaseException as exc:
            result.append(exc)
        stop_waiting.set()

    stop_waiting = threading.Event()
    threading.Thread(target=wait, name="radixlm-dp-start", daemon=True).start()
    while not stop_waiting.wait(0.2):
        if stop.is_set():
            return
    if result and result[0] is not None:
        raise result[0]


class _Group:
    """The workers and the router's state: starts the shutdown, watches the processes."""

    def __init__(self, workers: list[WorkerProcess], state, stop: threading.Event) -> None:
        self.workers, self.state, self.stop = workers, state, stop  # stop: a signal came outside uvicorn
        self.server: _RouterServer | None = None
        self.stopping = False
        self.died = False
        self._lock = threading.Lock()

    def shutdown(self, force: bool = False) -> None:
        """Refuse new requests and SIGTERM the workers (SIGKILL when ``force``)."""
        with self._lock:
            self.state.shutting_down = True
            first = not self.stopping
            self.stopping = True
        for w in self.workers:
            if w.proc.poll() is None:
                if force:
                    w.proc.kill()
                elif first:
                    w.proc.terminate()

    def all_exited(self) -> bool:
        """Whether every worker has exited."""
        return all(w.proc.poll() is not None for w in self.workers)

    def watch(self) -> None:
        """A worker that exits on its own (or a signal before uvicorn took them) stops the group;
        once every worker has exited, stop the router."""
        while not self.all_exited():
            if self.stop.is_set() and not self.stopping:
                self.shutdown()
            for w in self.workers:
                if w.proc.poll() is not None and not self.stopping:
                    logger.critical("worker %d exited on its own with status %s; shutting the group down", w.index, w.proc.returncode)
                    self.died = True
                    self.shutdown()
            time.sleep(0.2)
        if self.server is not None:
            self.server.should_exit = True


class _RouterServer(uvicorn.Server):
    """uvicorn's server, whose signals start the group's shutdown instead of stopping at once."""

    def __init__(self, config: uvicorn.Config, group: _Group) -> None:
        super().__init__(config)
        self.group = group

    def handle_exit(self, sig: int, frame: object) -> None:
        # not appended to uvicorn's captured signals: it would raise it again at the end; the
        # router stops when the watcher sees every worker gone (a second SIGINT kills them)
        self.group.shutdown(force=self.group.stopping and sig == signal.SIGINT)
