"""What another local user can see or take: keys on command lines (``/proc/PID/cmdline`` is
world-readable), a child's port between a free-port check and its bind, modules planted where a
child ``python -m radixlm`` starts, and a cache folder others may write into."""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import socket
import stat
import subprocess
from pathlib import Path

import httpx
import pytest

from radixlm.kernels.paths import UnsafeCacheDir, cache_dir
from radixlm.runtime.entrypoints.secrets import ADMIN_KEY_ENV, API_KEY_ENV

KEY, ADMIN_KEY = "local-user-exposure-key", "local-user-exposure-admin-key"
linux_only = pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="reads /proc")


def _cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


def _environ(pid: int) -> dict[str, str]:
    pairs = (item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_bytes().decode(errors="replace").split("\0") if "=" in item)
    return dict(pairs)


def _open_files(pid: int) -> set[str]:
    """What the open file descriptors of ``pid`` point to (``socket:[INODE]`` for a socket)."""
    out = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        with contextlib.suppress(OSError):  # closed meanwhile (the listing's own fd)
            out.add(os.readlink(f"/proc/{pid}/fd/{fd}"))
    return out


def _listening_inode(port: int) -> int:
    """The inode of the socket listening on 127.0.0.1:``port`` (from /proc/net/tcp)."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[3] == "0A" and int(fields[1].split(":")[1], 16) == port:
            return int(fields[9])
    raise AssertionError(f"nothing listens on port {port}")


def _recording(monkeypatch: pytest.MonkeyPatch, module: object) -> list[int]:
    """Wrap ``module.listening_socket`` to record the inode of each socket the parent binds."""
    inodes: list[int] = []
    real = module.listening_socket

    def recorded(*args, **kwargs):
        sock = real(*args, **kwargs)
        inodes.append(os.fstat(sock.fileno()).st_ino)
        return sock

    monkeypatch.setattr(module, "listening_socket", recorded)
    return inodes


def _assert_child_holds_no_key_on_argv(pid: int) -> None:
    argv = _cmdline(pid)
    assert not [a for a in argv if KEY in a or ADMIN_KEY in a], f"a key on the child's command line: {argv}"
    assert "--api-key" not in argv and "--admin-api-key" not in argv
    env = _environ(pid)  # readable by this user only
    assert env.get(API_KEY_ENV) == KEY and env.get(ADMIN_KEY_ENV) == ADMIN_KEY


def _assert_key_required(url: str) -> None:
    assert httpx.get(url + "/v1/models", timeout=30).status_code == 401
    assert httpx.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).status_code == 200


# ------------------------------------------------------------ python -P, from a safe folder
def test_the_child_command_imports_nothing_planted_in_its_working_folder(tmp_path: Path):
    from radixlm.runtime.entrypoints.spawn import radixlm_command

    marker = tmp_path / "planted-code-ran"
    for name in ("radixlm.py", "json.py", "argparse.py"):
        (tmp_path / name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    out = subprocess.run([*radixlm_command(), "router", "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert not marker.exists(), f"a module planted in the working folder ran: {marker.read_text()}"
    assert out.returncode == 0 and "--worker-urls" in out.stdout, out.stderr


def test_runtime_and_dp_launcher_share_one_child_command():
    from radixlm.lang.backend import runtime
    from radixlm.runtime.entrypoints.router import launch
    from radixlm.runtime.entrypoints.spawn import radixlm_command

    assert runtime.radixlm_command is radixlm_command and launch.radixlm_command is radixlm_command
    assert runtime._command({"model_path": "m", "port": 5})[: len(radixlm_command()) + 1] == [*radixlm_command(), "serve"]


# ------------------------------------------------------------ keys by environment
def _serve_parser() -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    from radixlm.runtime.entrypoints.cli import main as cli

    parser = argparse.ArgumentParser()
    return parser, cli._serve_parser(parser.add_subparsers(dest="command"))


def test_dp_workers_are_not_given_the_keys_on_their_command_line():
    from radixlm.runtime.entrypoints.router.launch import passed_options

    parser, serve = _serve_parser()
    ns = parser.parse_args(["serve", "--dp-size", "2", "--model-path", "m", "--api-key", KEY, "--admin-api-key", ADMIN_KEY, "--listen-fd", "7"])
    assert passed_options(ns, serve) == ["--model-path", "m"]


def test_dp_workers_and_their_router_take_the_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    from radixlm.runtime.entrypoints.secrets import command_keys

    parser, _ = _serve_parser()
    monkeypatch.setenv(API_KEY_ENV, KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    assert command_keys(parser.parse_args(["serve", "--dp-size", "2"])) == (KEY, ADMIN_KEY)
    assert command_keys(parser.parse_args(["serve", "--dp-size", "2", "--api-key", "flag"])) == ("flag", ADMIN_KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, "")
    with pytest.raises(ValueError, match=ADMIN_KEY_ENV):
        command_keys(parser.parse_args(["serve", "--dp-size", "2"]))


def test_a_child_socket_on_a_taken_port_is_refused_naming_the_address():
    from radixlm.runtime.entrypoints.spawn import bound_port, listening_socket

    with listening_socket() as taken:
        port = bound_port(taken)
        with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{port}") as refused:
            listening_socket("127.0.0.1", port)
        assert refused.value.errno == errno.EADDRINUSE


def test_the_router_takes_its_key_from_the_environment(monkeypatch: pytest.MonkeyPatch):
    from radixlm.runtime.entrypoints.router.cli_args import add_router_args
    from radixlm.runtime.entrypoints.router.run import router_config

    parser = argparse.ArgumentParser()
    add_router_args(parser)
    assert f"${API_KEY_ENV} if set). Prefer the variable" in " ".join(parser.format_help().split())
    argv = ["--worker-urls", "http://127.0.0.1:9"]
    monkeypatch.setenv(API_KEY_ENV, KEY)
    assert router_config(parser.parse_args(argv)).api_key == KEY
    assert router_config(parser.parse_args([*argv, "--api-key", "flag-wins"])).api_key == "flag-wins"
    monkeypatch.setenv(API_KEY_ENV, " ")
    with pytest.raises(ValueError, match=API_KEY_ENV):
        router_config(parser.parse_args(argv))
    monkeypatch.delenv(API_KEY_ENV)
    assert router_config(parser.parse_args(argv)).api_key is None


def test_runtime_refuses_an_empty_key_before_starting_anything():
    import radixlm as sgl

    with pytest.raises(ValueError, match="api_key is empty"):
        sgl.Runtime(model_path="unused", api_key="")


# ------------------------------------------------------------ real children (the tiny model)
@linux_only
def test_a_dp_worker_serves_on_the_socket_the_launcher_bound_and_gets_its_keys_by_environment(tiny_llama, monkeypatch):
    from radixlm.runtime.entrypoints.router import launch

    inodes = _recording(monkeypatch, launch)
    parser, serve = _serve_parser()
    ns = parser.parse_args(["serve", "--model-path", tiny_llama, "--max-total-tokens", "1024", "--num-threads", "1", "--api-key", KEY, "--admin-api-key", ADMIN_KEY])
    workers = launch.start_workers(ns, serve)
    try:
        (w,) = workers
        # the port is never free between the launcher's choice and the worker's serving: a
        # squatter's bind fails now, while the worker is still loading
        with socket.socket() as squatter, pytest.raises(OSError) as refused:
            squatter.bind(("127.0.0.1", w.port))
        assert refused.value.errno == errno.EADDRINUSE
        launch.wait_healthy(workers, timeout=300)
        assert _listening_inode(w.port) == inodes[0], "the worker serves on a socket of its own, not the one the launcher bound"
        assert f"socket:[{inodes[0]}]" not in _open_files(os.getpid()), "the launcher kept its copy"
        _assert_child_holds_no_key_on_argv(w.proc.pid)
        _assert_key_required(w.url)
    finally:
        launch.stop_workers(workers, timeout=60)


@linux_only
def test_a_dsl_runtime_serves_on_the_socket_it_bound_from_a_safe_folder_with_its_keys_by_environment(tiny_llama, tmp_path, monkeypatch):
    import radixlm as sgl
    from radixlm.lang.backend import runtime as runtime_module

    inodes = _recording(monkeypatch, runtime_module)
    marker = tmp_path / "planted-code-ran"
    for name in ("radixlm.py", "json.py"):
        (tmp_path / name).write_text(f"open({str(marker)!r}, 'a').write({name!r})\n")
    monkeypatch.chdir(tmp_path)  # the caller's folder holds planted modules
    rt = sgl.Runtime(model_path=tiny_llama, api_key=KEY, admin_api_key=ADMIN_KEY, max_total_tokens=1024)
    try:
        pid = rt.process.pid
        assert not marker.exists(), f"a module planted in the caller's folder ran: {marker.read_text()}"
        assert os.readlink(f"/proc/{pid}/cwd") == "/", "the server runs from the caller's folder (or /tmp)"
        assert "-P" in _cmdline(pid)[:3]
        assert _listening_inode(rt.port) == inodes[0], "the server serves on a socket of its own, not the one Runtime bound"
        _assert_child_holds_no_key_on_argv(pid)
        _assert_key_required(rt.url)
        assert rt.get_server_info()["max_total_tokens"] == 1024  # the Runtime's own client sends the key
    finally:
        rt.shutdown()


# ------------------------------------------------------------ the cache folder
def test_a_fresh_cache_folder_is_created_private_whatever_the_umask(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "fresh" / "radixlm"))
    old = os.umask(0)
    try:
        root = cache_dir()
    finally:
        os.umask(old)
    assert root == tmp_path / "fresh" / "radixlm" and stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.parametrize("mode", [0o777, 0o775, 0o1777], ids=["0777", "0775", "01777"])
def test_a_cache_folder_others_may_write_into_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: int):
    from radixlm.runtime.disk_cache import entry_for

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, mode)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(shared))
    with pytest.raises(UnsafeCacheDir, match=f"{shared} may be written by others"):
        cache_dir()
    model = tmp_path / "model.gguf"
    model.write_bytes(b"x")
    with pytest.raises(UnsafeCacheDir, match=str(shared)):  # what reads the cache goes through the check
        entry_for(str(model), "tokenizer")
    assert stat.S_IMODE(shared.stat().st_mode) == mode, "a refused folder is left as it was"


def test_a_cache_folder_of_another_user_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(theirs))
    monkeypatch.setattr(os, "geteuid", lambda: theirs.stat().st_uid + 1)
    with pytest.raises(UnsafeCacheDir, match=f"{theirs} belongs to uid"):
        cache_dir()


def test_a_cache_folder_of_ours_readable_by_others_is_narrowed_to_0700(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    ours = tmp_path / "ours"
    ours.mkdir()
    os.chmod(ours, 0o755)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(ours))
    assert cache_dir() == ours and stat.S_IMODE(ours.stat().st_mode) == 0o700


def test_a_cache_path_that_is_not_a_folder_is_refused_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(tmp_path / "afile"))
    (tmp_path / "afile").write_text("")
    with pytest.raises(UnsafeCacheDir, match="afile is not a folder"):
        cache_dir()


def test_what_is_read_from_an_unsafe_cache_folder_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture):
    from radixlm.kernels import cpu_ext
    from radixlm.runtime.layers.cpu_paths import load_or_measure

    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)
    monkeypatch.setenv("RADIXLM_CACHE_DIR", str(shared))
    measured: list[object] = []
    with pytest.raises(UnsafeCacheDir, match=str(shared)):  # the start fails with the folder named
        load_or_measure({(4, 4): 1}, 1, measure_fn=measured.append)
    assert not measured, "timings were measured for a cache that is refused"
    with caplog.at_level("WARNING", logger=cpu_ext.__name__):
        assert cpu_ext._load() is None, "a kernel build was loaded from a folder others may write into"
    assert str(shared) in caplog.text and not list(shared.iterdir())
