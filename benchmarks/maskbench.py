"""MaskBench-style check of the JSON-schema grammar backends on jsonschemabench files.

Each FILE (or every ``*.json`` in a directory argument) holds ``{"schema", "tests": [{"valid",
"data", "description"}, ...]}``. The schema is compiled with the default model's tokenizer; every
test instance, serialized as compact JSON (``separators=(",", ":")``, ``ensure_ascii=False``) and
tokenized without special tokens, is walked token by token: compute the mask (timed: the mask
time), check the token's bit, ``accept`` it. An instance is accepted when every token was allowed
and, at the end, an end token is allowed (or the matcher is terminated). A valid instance is
judged right when accepted, an invalid one when rejected.

    .venv/bin/python benchmarks/maskbench.py [--backend llguidance|outlines] [--timeout 20]
        [--jobs 1] [--verbose] [--mask-times OUT.npz] FILE_OR_DIR...

Output (stdout), one JSON line per file, in argument order::

    {"file", "compiled", "error", "compile_ms", "valid_ok", "valid_total",
     "invalid_rejected", "invalid_total", "format_only_accepted", "warnings", "mask_us_p50", "mask_us_p99"}

then ``{"summary": {"files", "compiled", "passing", "invalid_accepted", "format_only_accepted",
"files_with_ignored_formats", "compile_ms_p50", "compile_ms_p75", "mask_us_p50", "mask_us_p99"}}``.
``passing``: compiled, no error, and every instance judged right. ``invalid_accepted``: invalid
instances accepted, over compiled files. An invalid instance that is valid once ``format`` is an
annotation (jsonschema without a format checker), accepted by a grammar that ignored that format
(and said so in its ``warnings``), counts as ``format_only_accepted`` instead: the JSON Schema
specification makes unknown formats annotations, and so do we.
``compile_ms`` is the time of ``backend.compile`` (also when it refuses; null on a timeout);
the summary's compile percentiles are over compiled files, its mask percentiles over every mask
of every file. A file that did not compile has ``valid_ok = invalid_rejected = 0``.

Each file runs in a worker process (the tokenizer and backend are loaded once per worker);
a file that takes longer than ``--timeout`` seconds kills its worker (outlines-core's compile
threads cannot be stopped otherwise) and is reported with ``compiled: false`` and a timed-out
error, or ``compiled: true`` with that error if the time ran out while checking instances.
``--verbose`` writes every misjudged instance, with where it went wrong, to stderr;
``--mask-times OUT.npz`` saves every file's raw mask times (µs, float32, keyed by file name),
for percentiles over other groupings of the files.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import signal
import sys
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path
from typing import Any

import numpy as np

BACKENDS = ("llguidance", "outlines")
STARTUP_TIMEOUT_S = 600.0


# ---------------------------------------------------------------- helpers
def expand_paths(args: list[str]) -> list[Path]:
    """Files named on the command line; a directory stands for its ``*.json`` files, sorted."""
    out: list[Path] = []
    for arg in args:
        p = Path(arg)
        out.extend(sorted(p.glob("*.json")) if p.is_dir() else [p])
    return out


def serialize(data: Any) -> str:
    """An instance as compact JSON, the text the model would have to produce."""
    return json.dumps(data, separators=(",", ":"), ensure_ascii=False)


def percentile(values: np.ndarray | list[float], q: float) -> float | None:
    """The ``q``-th percentile (linear interpolation), rounded; None for no values."""
    if len(values) == 0:
        return None
    return round(float(np.percentile(np.asarray(values, dtype=np.float64), q)), 3)


def make_backend(name: str) -> tuple[Any, Any, set[int], int]:
    """``(backend, tokenizer, end ids, vocab size)`` for the default model."""
    from radixlm.runtime.loader import default_model_path, load_model_config
    from radixlm.runtime.tokenizer import end_token_ids, load_tokenizer

    path = default_model_path()
    tok, cfg = load_tokenizer(path), load_model_config(path)
    end_ids = end_token_ids(tok, cfg.eos_token_ids)
    if name == "llguidance":
        from radixlm.runtime.constrained.llguidance_backend import LLGuidanceBackend as cls
    elif name == "outlines":
        from radixlm.runtime.constrained.outlines_backend import OutlinesBackend as cls
    else:
        raise ValueError(f"unknown backend {name!r}")
    return cls(tok, cfg.vocab_size, end_ids), tok, end_ids, cfg.vocab_size


# ---------------------------------------------------------------- worker side
class Checker:
    """One worker's backend, tokenizer and mask buffer."""

    def __init__(self, backend_name: str) -> None:
        import torch

        from radixlm.runtime.constrained.base import bitmask_width

        torch.set_num_threads(1)
        self.backend, self.tok, end_ids, vocab_size = make_backend(backend_name)
        self.end_ids = sorted(end_ids)
        self.bitmask = torch.zeros((1, bitmask_width(vocab_size)), dtype=torch.int32)
        self.bits = self.bitmask.numpy()

    def allowed(self, token: int) -> bool:
        """Whether ``token``'s bit is set in the current mask."""
        return bool((int(self.bits[0, token >> 5]) >> (token & 31)) & 1)

    def fill(self, matcher, times: list[float]) -> None:
        """Compute the next mask into the buffer, appending its time (µs) to ``times``."""
        self.bits[0].fill(0)
        t = time.perf_counter_ns()
        matcher.fill_bitmask(self.bitmask, 0)
        times.append((time.perf_counter_ns() - t) / 1000.0)

    def walk(self, compiled, text: str, times: list[float]) -> tuple[bool, str]:
        """Walk ``text`` token by token; ``(accepted, where it stopped or '')``."""
        tokens = self.tok.encode(text, add_special_tokens=False)
        m = compiled.matcher()
        for i, t in enumerate(tokens):
            self.fill(m, times)
            if not self.allowed(t):
                before = self.tok.decode(tokens[:i])[-60:]
                return False, f"token {i} {self.tok.decode([t])!r} masked after {before!r}"
            if not m.accept(t):
                return False, f"token {i} {self.tok.decode([t])!r} allowed by the mask but refused by accept()"
        if m.is_terminated():
            return True, ""
        self.fill(m, times)
        if any(self.allowed(e) for e in self.end_ids):
            return True, ""
        return False, "end of sequence not allowed at the end"

    def run(self, path: Path, conn: Connection) -> None:
        """Check one file, streaming ``loaded``, ``compiled``, ``inst`` and ``done`` messages to ``conn``."""
        from radixlm.runtime.constrained.base import GrammarError

        try:
            doc = json.loads(path.read_text())
            schema, tests = doc["schema"], doc.get("tests", [])
        except Exception as exc:
            conn.send(("compiled", False, f"cannot read file: {exc}", None))
            conn.send(("done",))
            return
        n_valid = sum(1 for t in tests if t.get("valid"))
        conn.send(("loaded", n_valid, len(tests) - n_valid))
        t0 = time.perf_counter()
        try:
            compiled, error = self.backend.compile("json_schema", json.dumps(schema)), None
        except GrammarError as exc:
            compiled, error = None, str(exc)
        except Exception as exc:  # a backend bug: report it, keep the worker
            compiled, error = None, f"{type(exc).__name__}: {exc}"
        compile_ms = (time.perf_counter() - t0) * 1000.0
        conn.send(("compiled", compiled is not None, error, compile_ms, list(getattr(compiled, "warnings", ()))))
        if compiled is not None:
            for test in tests:
                times: list[float] = []
                try:
                    accepted, where = self.walk(compiled, serialize(test["data"]), times)
                except Exception as exc:
                    accepted, where = False, f"error while walking: {type(exc).__name__}: {exc}"
                times_bytes = np.asarray(times, dtype=np.float32).tobytes()
                by_format = accepted and not test.get("valid") and valid_without_formats(schema, test["data"])
                conn.send(("inst", bool(test.get("valid")), accepted, where, test.get("description", ""), times_bytes, by_format))
        conn.send(("done",))


def valid_without_formats(schema, data) -> bool:
    """True when ``data`` is valid once ``format`` is an annotation (jsonschema's default)."""
    import jsonschema

    try:
        return jsonschema.validators.validator_for(schema)(schema).is_valid(data)
    except Exception:  # a schema jsonschema cannot read: count the verdict as wrong
        return False


def worker_main(conn: Connection, backend_name: str) -> None:
    """Worker process: load once, then check each path received until ``None``."""
    checker = Checker(backend_name)
    conn.send(("ready",))
    while True:
        path = conn.recv()
        if path is None:
            return
        checker.run(Path(path), conn)


# ---------------------------------------------------------------- parent side
class FileResult:
    """What the parent has heard about one file so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.compiled: bool | None = None
        self.error: str | None = None
        self.compile_ms: float | None = None
        self.valid_ok = self.valid_total = self.invalid_rejected = self.invalid_total = 0
        self.invalid_accepted = 0
        self.format_only_accepted = 0  # of those: invalid only by a format the grammar ignores
        self.warnings: list[str] = []
        self.mask_us: list[np.ndarray] = []
        self.misjudged: list[str] = []

    def on_message(self, msg: tuple) -> bool:
        """Fold one worker message in; True when the file is done."""
        kind = msg[0]
        if kind == "loaded":
            _, self.valid_total, self.invalid_total = msg
        elif kind == "compiled":
            _, self.compiled, self.error, self.compile_ms, self.warnings = msg
        elif kind == "inst":
            _, valid, accepted, where, desc, times, by_format = msg
            self.mask_us.append(np.frombuffer(times, dtype=np.float32))
            if valid and accepted:
                self.valid_ok += 1
            elif not valid and not accepted:
                self.invalid_rejected += 1
            elif by_format:  # a format is an annotation (schema_rewrite.py): not a wrong verdict
                self.format_only_accepted += 1
                self.misjudged.append(f"invalid only by an ignored format, accepted: {desc!r}: {where}")
            else:
                self.invalid_accepted += not valid
                self.misjudged.append(f"{'valid rejected' if valid else 'INVALID ACCEPTED'}: {desc!r}: {where}")
        return kind == "done"

    def fail(self, error: str) -> None:
        """Record a timeout or crash: keep what was heard, mark the rest unjudged."""
        if self.compiled is None:
            self.compiled = False
        self.error = error

    def times(self) -> np.ndarray:
        """Every mask time of this file (µs)."""
        return np.concatenate(self.mask_us) if self.mask_us else np.zeros(0, dtype=np.float32)

    def passing(self) -> bool:
        """Compiled, no error, every instance judged right."""
        all_right = self.valid_ok == self.valid_total and self.invalid_rejected + self.format_only_accepted == self.invalid_total
        return bool(self.compiled) and self.error is None and all_right

    def line(self) -> dict:
        """The file's output record."""
        t = self.times()
        ok = bool(self.compiled)
        return {
            "file": str(self.path),
            "compiled": ok,
            "error": self.error,
            "compile_ms": None if self.compile_ms is None else round(self.compile_ms, 3),
            "valid_ok": self.valid_ok if ok else 0,
            "valid_total": self.valid_total,
            "invalid_rejected": self.invalid_rejected if ok else 0,
            "invalid_total": self.invalid_total,
            "format_only_accepted": self.format_only_accepted if ok else 0,
            "warnings": self.warnings,
            "mask_us_p50": percentile(t, 50),
            "mask_us_p99": percentile(t, 99),
        }


class Worker:
    """A worker process and its pipe; restarted after a timeout or crash."""

    def __init__(self, backend_name: str) -> None:
        self.backend_name = backend_name
        self.proc: mp.process.BaseProcess | None = None
        self.conn: Connection | None = None
        self.job: FileResult | None = None
        self.deadline = 0.0
        self.start()

    def start(self) -> None:
        """Spawn the process and wait until it has loaded the tokenizer and backend."""
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=worker_main, args=(child, self.backend_name), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(STARTUP_TIMEOUT_S):
            raise RuntimeError("worker did not start")
        if self.conn.recv() != ("ready",):
            raise RuntimeError("worker sent an unexpected first message")

    def submit(self, job: FileResult, timeout: float) -> None:
        """Send a file to check, starting its clock."""
        self.job, self.deadline = job, time.monotonic() + timeout
        self.conn.send(str(job.path))

    def kill(self) -> None:
        """Stop the process now."""
        if self.proc is not None and self.proc.is_alive():
            self.proc.kill()
        if self.proc is not None:
            self.proc.join()
        if self.conn is not None:
            self.conn.close()

    def restart(self) -> None:
        """Kill and start afresh."""
        self.kill()
        self.start()

    def close(self) -> None:
        """Ask an idle process to exit; kill a busy one (or one that does not exit)."""
        if self.job is None:
            try:
                self.conn.send(None)
                self.proc.join(5)
            except (OSError, ValueError):
                pass
        self.kill()


def run_files(paths: list[Path], backend_name: str, jobs: int, timeout: float) -> Iterator[FileResult]:
    """Check every file on ``jobs`` workers; yields results in the order of ``paths``."""
    workers = [Worker(backend_name) for _ in range(max(1, min(jobs, len(paths))))]
    pending = [FileResult(p) for p in paths]
    results: dict[int, FileResult] = {}
    index = {id(r): i for i, r in enumerate(pending)}
    queue = list(reversed(pending))
    next_out = 0
    try:
        while next_out < len(paths):
            for w in workers:
                if w.job is None and queue:
                    w.submit(queue.pop(), timeout)
            busy = [w for w in workers if w.job is not None]
            wait([w.conn for w in busy], timeout=max(0.0, min(w.deadline for w in busy) - time.monotonic()))
            for w in busy:  # poll every pipe: another worker's restart may have taken a while
                done = False
                try:
                    while not done and w.conn.poll():
                        done = w.job.on_message(w.conn.recv())
                except (EOFError, OSError):
                    w.job.fail(f"worker crashed (exit code {w.proc.exitcode if w.proc else None})")
                    done = True
                    w.restart()
                if not done and time.monotonic() > w.deadline:
                    phase = "compiling" if w.job.compiled is None else "checking instances"
                    w.job.fail(f"timed out after {timeout:g} s while {phase}")
                    done = True
                    w.restart()
                if done:
                    results[index[id(w.job)]] = w.job
                    w.job = None
            while next_out in results:
                yield results.pop(next_out)
                next_out += 1
    finally:
        for w in workers:
            w.close()


def summarize(files: list[FileResult], mask_times: list[np.ndarray]) -> dict:
    """The summary record over all files."""
    compile_ms = [f.compile_ms for f in files if f.compiled and f.compile_ms is not None]
    times = np.concatenate(mask_times) if mask_times else np.zeros(0)
    return {
        "files": len(files),
        "compiled": sum(1 for f in files if f.compiled),
        "passing": sum(1 for f in files if f.passing()),
        "invalid_accepted": sum(f.invalid_accepted for f in files if f.compiled),
        "format_only_accepted": sum(f.format_only_accepted for f in files if f.compiled),
        "files_with_ignored_formats": sum(1 for f in files if f.compiled and f.warnings),
        "compile_ms_p50": percentile(compile_ms, 50),
        "compile_ms_p75": percentile(compile_ms, 75),
        "mask_us_p50": percentile(times, 50),
        "mask_us_p99": percentile(times, 99),
    }


def main(argv: list[str] | None = None) -> int:
    """Parse arguments, check the files, print one line per file and the summary."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", metavar="FILE", help="jsonschemabench files or directories of them")
    ap.add_argument("--backend", choices=BACKENDS, default="llguidance")
    ap.add_argument("--timeout", type=float, default=20.0, help="seconds per file (default 20)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes (default 1)")
    ap.add_argument("--verbose", action="store_true", help="print misjudged instances to stderr")
    ap.add_argument("--mask-times", metavar="OUT.npz", help="save each file's raw mask times (µs) here")
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the cleanup that kills workers
    paths = expand_paths(args.files)
    if not paths:
        ap.error("no files found")
    done: list[FileResult] = []
    mask_times: list[np.ndarray] = []
    for res in run_files(paths, args.backend, args.jobs, args.timeout):
        print(json.dumps(res.line(), ensure_ascii=False), flush=True)
        if args.verbose:
            for note in res.misjudged:
                print(f"{res.path.name}: {note}", file=sys.stderr, flush=True)
        mask_times.append(res.times())
        done.append(res)
    print(json.dumps({"summary": summarize(done, mask_times)}), flush=True)
    if args.mask_times:
        np.savez_compressed(args.mask_times, **{r.path.name: t for r, t in zip(done, mask_times)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
