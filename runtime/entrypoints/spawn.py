"""How radixlm starts a ``radixlm serve`` child: its command, its working folder, and the
listening socket it serves on, bound here first and handed down (``--listen-fd``).

A port found free and closed again can be taken by another local user before the child binds
it, who then answers its health checks and receives its requests (and their keys). A socket
bound and listening in the parent is never free in between. The keys travel in the child's
environment (``radixlm.runtime.entrypoints.secrets.child_environ``), never on its command line.
"""

from __future__ import annotations

import socket
import sys

CHILD_CWD = "/"  # owned by root: nothing in it shadows a module or a model name (unlike /tmp)
BACKLOG = 2048  # uvicorn's own default


def radixlm_command() -> list[str]:
    """``python -P -m radixlm``: the working folder does not go on ``sys.path`` (a ``json.py`` or
    ``radixlm.py`` planted there would run otherwise, and a repository root's ``kernels/`` and
    ``runtime/`` would shadow installed packages)."""
    if sys.version_info >= (3, 11):
        return [sys.executable, "-P", "-m", "radixlm"]
    return [sys.executable, "-c", "import sys; sys.path.pop(0); from radixlm.runtime.entrypoints.cli.main import main; main()"]


def listening_socket(host: str = "127.0.0.1", port: int = 0) -> socket.socket:
    """A TCP socket bound to ``host:port`` (0: a port the system picks) and listening, for a
    child to inherit (``Popen(pass_fds=[sock.fileno()])``, ``--listen-fd``)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        if sys.platform != "win32":  # as uvicorn does: a restart may bind a port in TIME_WAIT
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
    except OSError as exc:
        sock.close()
        raise OSError(exc.errno, f"cannot listen on {host}:{port}: {exc.strerror}") from exc
    except BaseException:
        sock.close()
        raise
    return sock


def bound_port(sock: socket.socket) -> int:
    """The port ``sock`` is bound to."""
    return sock.getsockname()[1]
