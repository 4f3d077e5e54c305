"""A tensor-parallel process group on torch.distributed (gloo on CPU, NCCL on CUDA).

The group is built from its own ``TCPStore`` and process-group object rather than from
``torch.distributed``'s process-wide default group, so one process can hold several engines (and
tests can start and stop them) without global state. Rank 0 hosts the store on a free loopback
port (bound there itself: a plain TCPStore server listens on every interface) and hands the port
and a fresh secret to the workers it starts, through their spawn arguments, never their command
line; every store record, the gloo/NCCL rendezvous included, is signed with that secret.
"""

from __future__ import annotations

import datetime
import time

import torch
import torch.distributed as dist

from radixlm.runtime.distributed.store import SignedStore, listening_store, new_secret

LOOPBACK = "127.0.0.1"
IDLE_WAIT = datetime.timedelta(days=365)


def open_store(size: int, timeout_s: float, secret: bytes | None = None) -> SignedStore:
    """Rank 0's rendezvous store on a free loopback port (``store.port``), signing with ``secret``
    (a fresh one by default: hand ``store.secret`` to the workers)."""
    return SignedStore(listening_store(LOOPBACK, 0, size, timeout_s), secret or new_secret())


def join_store(port: int, size: int, timeout_s: float, secret: bytes) -> SignedStore:
    """A worker's client of rank 0's store, signing with the group's secret."""
    return SignedStore(dist.TCPStore(LOOPBACK, port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)), secret)


class TPGroup:
    """The collectives a tensor-parallel model needs, with the time spent in them."""

    def __init__(self, store: SignedStore, rank: int, size: int, device: torch.device, timeout_s: float) -> None:
        timeout = datetime.timedelta(seconds=timeout_s)
        self.store, self.rank, self.size, self.device = store, rank, size, device
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = timeout
            self.pg = dist.ProcessGroupNCCL(store, rank, size, opts)
        else:
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(store, rank, size, opts)
        self.reduce_seconds = 0.0  # all-reduces and the logits gather
        self.reduce_calls = 0
        self.broadcast_seconds = 0.0  # the batch plans

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum ``x`` over the ranks, in place; returns it."""
        t0 = time.perf_counter()
        x = x.contiguous()
        self.pg.allreduce([x]).wait()
        self.reduce_seconds += time.perf_counter() - t0
        self.reduce_calls += 1
        return x

    def broadcast(self, x: torch.Tensor, idle: bool = False) -> torch.Tensor:
        """Rank 0's ``x`` on every rank, in place; returns it.

        ``idle``: a worker waiting for rank 0's next step, which may come after any pause, so
        this one wait has no timeout (a dead rank 0 still ends it: its connection closes)."""
        opts = dist.BroadcastOptions()
        if idle:
            opts.timeout = IDLE_WAIT
        t0 = time.perf_counter()
        self.pg.broadcast([x], opts).wait()
        self.broadcast_seconds += time.perf_counter() - t0
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_per_rank: int, vocab_size: int) -> torch.Tensor:
        """The full ``[n, vocab]`` logits from every rank's ``[n, vocab slice]``.

        Slices are padded to one width (the last rank's may be shorter) for the gather."""
        pad = vocab_per_rank - local.shape[1]
        if pad:
            local = torch.nn.functional.pad(local, (0, pad))
        parts = [torch.empty_like(local) for _ in range(self.size)]
        t0 = time.perf_counter()
        self.pg.allgather([parts], [local.contiguous()]).wait()
        self.reduce_seconds += time.perf_counter() - t0
        return torch.cat(parts, dim=1)[:, :vocab_size]

    def close(self) -> None:
        """Release the process group's connections."""
        try:
            self.pg.shutdown()
        except Exception:  # already broken: its peers are gone
            pass
