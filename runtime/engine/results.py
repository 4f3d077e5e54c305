"""What callers get back: a request's outputs as dicts, awaited whole or streamed, sync or async."""

from __future__ import annotations

import asyncio
import queue
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

from radixlm.runtime.engine.loop import EngineLoop
from radixlm.runtime.request import ReqOutput


def to_dict(out: ReqOutput) -> dict[str, Any]:
    """The caller's form of one output: text, output ids and meta info."""
    return {"text": out.text, "output_ids": out.output_ids, "meta_info": out.meta_info}


def async_sink(loop: asyncio.AbstractEventLoop, q: asyncio.Queue) -> Callable[[ReqOutput], None]:
    """A sink that feeds ``q`` on ``loop`` from the engine thread (dropping outputs once the loop is closed)."""

    def put(out: ReqOutput) -> None:
        try:
            loop.call_soon_threadsafe(q.put_nowait, out)
        except RuntimeError:  # the caller's event loop is closed: nobody is listening
            pass

    return put


def wait_final(q: queue.Queue, engine: EngineLoop) -> ReqOutput:
    """Block until the final output arrives on ``q`` (EngineError if the engine loop ends first)."""
    while True:
        try:
            out = q.get(timeout=1.0)
        except queue.Empty:
            engine.check_running()
            continue
        if out.finished:
            return out


def stream_sync(q: queue.Queue, engine: EngineLoop, cancel: Callable[[], None]) -> Iterator[dict[str, Any]]:
    """Yield each output on ``q`` as a dict until the final one; ``cancel`` runs when the stream closes."""
    try:
        while True:
            try:
                out = q.get(timeout=1.0)
            except queue.Empty:
                engine.check_running()
                continue
            yield to_dict(out)
            if out.finished:
                return
    finally:
        cancel()


async def await_final(q: asyncio.Queue) -> ReqOutput:
    """The final output that arrives on ``q``."""
    while True:
        out = await q.get()
        if out.finished:
            return out


async def stream_async(q: asyncio.Queue, cancel: Callable[[], None]) -> AsyncIterator[dict[str, Any]]:
    """Yield each output on ``q`` as a dict until the final one; ``cancel`` runs if the stream closes before it."""
    finished = False
    try:
        while True:
            out = await q.get()
            yield to_dict(out)
            if out.finished:
                finished = True
                return
    finally:
        if not finished:
            cancel()
