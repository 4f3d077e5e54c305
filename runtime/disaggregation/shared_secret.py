"""The secret both sides of a prefill/decode pair sign their store records with."""

from __future__ import annotations

import os

from radixlm.kernels.paths import cache_dir
from radixlm.runtime.disaggregation.addressing import is_loopback
from radixlm.runtime.distributed.store import read_secret_file, shared_secret_file
from radixlm.runtime.server_args import parse_bootstrap

SECRET_ENV = "RADIXLM_KV_SECRET"  # the pair's shared secret itself
SECRET_FILE_ENV = "RADIXLM_KV_SECRET_FILE"  # or a file holding it (like --disaggregation-secret-file)
DEFAULT_SECRET_FILE = "pd-secret"  # under the cache folder: loopback pairs of one user share it


def link_secret(bootstrap: str, secret_file: str | None = None) -> bytes:
    """The secret that signs a pair's records: ``$RADIXLM_KV_SECRET``, else the file named by
    ``secret_file`` (or ``$RADIXLM_KV_SECRET_FILE``; mode 600), else, for a loopback bootstrap only,
    a random one in ``<cache>/pd-secret`` created by whichever side starts first (readable by this
    user only, so a pair on one machine under one user just works). A bootstrap beyond loopback
    without a secret is refused: its store would take records from anyone who reaches it."""
    host, _ = parse_bootstrap(bootstrap)
    value = os.environ.get(SECRET_ENV)
    if value:
        if len(value.encode()) < 16:
            raise ValueError(f"{SECRET_ENV} must hold at least 16 bytes, got {len(value.encode())}")
        return value.encode()
    secret_file = secret_file or os.environ.get(SECRET_FILE_ENV)
    if secret_file:
        return read_secret_file(secret_file, "disaggregation_secret_file")
    if is_loopback(host):
        return shared_secret_file(cache_dir() / DEFAULT_SECRET_FILE, "the default KV link secret")
    raise ValueError(
        f"disaggregation_bootstrap {host} is not a loopback address: the KV link then needs a secret shared by both workers; "
        f"set {SECRET_ENV} in both workers' environment, or give both --disaggregation-secret-file (a file of mode 600)"
    )
