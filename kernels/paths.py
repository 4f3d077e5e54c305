"""Where radixlm keeps what it derives on disk (compiled kernels, converted tokenizers and weights).

It lives on the lowest floor because the kernels' build needs it; ``runtime.disk_cache`` builds
on it.

What is read back from there runs (a compiled extension is loaded, weights and tokenizers are
trusted), so the folder must be ours alone: it is created 0700 (one of ours found readable by
others is narrowed to 0700), and one owned by another user or writable by anyone else is refused
(UnsafeCacheDir, naming the folder) rather than used.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


class UnsafeCacheDir(ValueError):
    """The cache folder is another user's, or others may write into it (a setup error: the
    command line reports it as one)."""


def cache_root() -> Path:
    """The cache folder's path (``$RADIXLM_CACHE_DIR`` or ``$XDG_CACHE_HOME/radixlm`` or
    ``~/.cache/radixlm``), neither created nor checked."""
    root = os.environ.get("RADIXLM_CACHE_DIR")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "radixlm"


def cache_dir() -> Path:
    """Where radixlm keeps derived files (see ``cache_root``): created 0700 when missing, narrowed
    to 0700 when others may read it; UnsafeCacheDir when it belongs to another user or others may
    write into it."""
    root = cache_root()
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        root.mkdir(mode=0o700)  # a umask only takes bits away
    except FileExistsError:
        pass
    except OSError:  # it cannot be made (a read-only home): writing into it fails later, as it did
        if not os.path.exists(root):
            return root
    mode = check_private(root)
    if mode & 0o077:
        try:
            os.chmod(root, 0o700)
        except OSError:  # a read-only file system: nobody writes there either
            pass
    return root


def check_private(folder: Path) -> int:
    """The permission bits of ``folder``; UnsafeCacheDir naming it unless it is a folder of this
    user that nobody else may write to."""
    try:
        st = os.stat(folder)  # through a symlink: what the files land in is what counts
    except OSError as exc:
        raise UnsafeCacheDir(f"the radixlm cache {folder} cannot be checked ({exc.strerror}); remove it or set RADIXLM_CACHE_DIR to another path") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeCacheDir(f"the radixlm cache {folder} is not a folder; remove it or set RADIXLM_CACHE_DIR to another path")
    if not hasattr(os, "geteuid"):  # not POSIX: no owner and mode bits to judge by
        return 0
    uid = os.geteuid()
    if st.st_uid != uid:
        raise UnsafeCacheDir(f"the radixlm cache {folder} belongs to uid {st.st_uid}, not to this user (uid {uid}): what it holds is loaded and run, so it is refused; set RADIXLM_CACHE_DIR to a folder of yours")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise UnsafeCacheDir(f"the radixlm cache {folder} may be written by others (mode {stat.S_IMODE(st.st_mode):04o}): what it holds is loaded and run, so it is refused; check its contents, then `chmod 700 {folder}`, or set RADIXLM_CACHE_DIR to another path")
    return stat.S_IMODE(st.st_mode)
