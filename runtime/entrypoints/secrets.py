"""The server's keys: taken from a flag or the environment, checked, and handed to child
processes through their environment, never through a command line (``/proc/PID/cmdline`` is
readable by every local user; ``/proc/PID/environ`` only by the same user)."""

from __future__ import annotations

import os
from collections.abc import Mapping

API_KEY_ENV = "RADIXLM_API_KEY"
ADMIN_KEY_ENV = "RADIXLM_ADMIN_API_KEY"


def resolve_key(flag_value: str | None, env_name: str, option: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The key given by ``option`` or, when the flag is absent, by ``env_name``; None when neither.

    An empty or blank key is refused (ValueError naming the option) rather than read as "no key":
    a script that expands an unset variable into ``--api-key ""`` must not silently serve open.
    """
    environ = os.environ if environ is None else environ
    value = flag_value if flag_value is not None else environ.get(env_name)
    if value is None:
        return None
    source = option if flag_value is not None else f"${env_name}"
    if not value.strip():
        raise ValueError(f"{source} is empty: an empty key would turn authentication off; leave {option} and ${env_name} unset to serve without a key")
    if any(c.isspace() or not c.isprintable() for c in value) or not value.isascii():
        raise ValueError(f"{source} must be printable ASCII without spaces (it travels in an HTTP header)")
    return value


def command_keys(ns: object) -> tuple[str | None, str | None]:
    """The API key and the admin key of a ``radixlm serve`` or ``router`` command line: each its
    flag, else its environment variable (``resolve_key``)."""
    api_key = resolve_key(getattr(ns, "api_key", None), API_KEY_ENV, "--api-key")
    return api_key, resolve_key(getattr(ns, "admin_api_key", None), ADMIN_KEY_ENV, "--admin-api-key")


def child_environ(api_key: str | None, admin_key: str | None = None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """An environment for a child ``radixlm`` process carrying these keys (and no others)."""
    env = dict(os.environ if base is None else base)
    for name, value in ((API_KEY_ENV, api_key), (ADMIN_KEY_ENV, admin_key)):
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env
