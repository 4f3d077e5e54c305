"""What the HTTP path costs: the same shared-prefix chat requests in process (Engine.async_generate,
streamed) and through `radixlm serve` (OpenAI client, streamed and not), side by side in one run.

Each request is the serving benchmark's (one ~190-token system prompt, a distinct question),
greedy, a fixed number of output tokens (ignore_eos), at a fixed concurrency.

    .venv/bin/python benchmarks/http_overhead.py [--requests 64] [--concurrency 32] [--out benchmarks/results/http_overhead.md]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import torch

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402
from workloads import SYSTEM_PROMPT, chat_questions  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}]


async def in_process(args) -> float:
    """Output tok/s of the requests streamed from an in-process engine."""
    import radixlm

    engine = radixlm.Engine(quantization=args.quantization, num_threads=args.threads)
    try:
        tok = engine.tokenizer
        prompts = [tok.apply_chat_template(messages(q), tokenize=False, add_generation_prompt=True) for q in chat_questions(args.requests)]
        params = {"max_new_tokens": args.tokens, "temperature": 0, "ignore_eos": True}
        await engine.async_generate(prompts[0], {**params, "max_new_tokens": 4})  # warm up, cache the prefix
        gate = asyncio.Semaphore(args.concurrency)

        async def one(prompt: str) -> int:
            async with gate:
                n = 0
                async for out in await engine.async_generate(prompt, params, stream=True):
                    n = out["meta_info"]["completion_tokens"]
                return n

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(p) for p in prompts))
        return sum(counts) / (time.perf_counter() - t)
    finally:
        engine.shutdown()


async def over_http(base_url: str, args, stream: bool) -> float:
    """Output tok/s of the requests through the server's chat route."""
    client = openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=600)
    kw = dict(model="default", max_tokens=args.tokens, temperature=0, extra_body={"ignore_eos": True})
    await client.chat.completions.create(messages=messages("warm up"), **{**kw, "max_tokens": 4})
    gate = asyncio.Semaphore(args.concurrency)

    async def one(question: str) -> int:
        async with gate:
            if not stream:
                res = await client.chat.completions.create(messages=messages(question), **kw)
                return res.usage.completion_tokens
            n = 0
            async for chunk in await client.chat.completions.create(messages=messages(question), stream=True, stream_options={"include_usage": True}, **kw):
                if chunk.usage is not None:
                    n = chunk.usage.completion_tokens
            return n

    t = time.perf_counter()
    counts = await asyncio.gather(*(one(q) for q in chat_questions(args.requests)))
    await client.close()
    return sum(counts) / (time.perf_counter() - t)


async def raw_sse(base_url: str, args) -> float:
    """Output tok/s of streamed requests read as raw SSE lines (no client-side parsing but the
    last chunk's usage), to tell the server's cost from the OpenAI client's."""
    import json

    body = dict(model="default", max_tokens=args.tokens, temperature=0, ignore_eos=True, stream=True, stream_options={"include_usage": True})
    gate = asyncio.Semaphore(args.concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=httpx.Limits(max_connections=args.concurrency + 4)) as client:

        async def one(question: str) -> int:
            async with gate:
                last = ""
                async with client.stream("POST", "/v1/chat/completions", json={**body, "messages": messages(question)}) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data: {"):
                            last = line
                return json.loads(last[6:])["usage"]["completion_tokens"]

        t = time.perf_counter()
        counts = await asyncio.gather(*(one(q) for q in chat_questions(args.requests)))
        return sum(counts) / (time.perf_counter() - t)


def start_server(args) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [str(Path(sys.executable).parent / "radixlm"), "serve", "--port", str(port), "--num-threads", str(args.threads), "--log-level", "warning"]
    if args.quantization:
        cmd += ["--quantization", args.quantization]
    proc = subprocess.Popen(cmd, cwd="/", env={**os.environ, "PYTHONSAFEPATH": "1"}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise RuntimeError("the server did not become healthy")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default="int4_bf16")
    ap.add_argument("--out", default="benchmarks/results/http_overhead.md")
    args = ap.parse_args(argv)
    local = asyncio.run(in_process(args))
    proc, base = start_server(args)
    try:
        streamed = asyncio.run(over_http(base, args, stream=True))
        raw = asyncio.run(raw_sse(base, args))
        whole = asyncio.run(over_http(base, args, stream=False))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    lines = [
        "# The HTTP path's cost",
        "",
        f"Command: `benchmarks/http_overhead.py --requests {args.requests} --concurrency {args.concurrency} --tokens {args.tokens} --quantization {args.quantization}`; "
        f"date {datetime.date.today()}; SmolLM2-135M-Instruct, {args.threads} threads, CPU capability {torch.backends.cpu.get_cpu_capability()}; "
        "the server and the client on the same 2 cores.",
        "",
        "| path | output tok/s | vs in process |",
        "|---|---:|---:|",
        f"| in process, streamed (Engine.async_generate) | {local:.1f} | 1.00 |",
        f"| HTTP chat, streamed (SSE), OpenAI client | {streamed:.1f} | {streamed / local:.2f} |",
        f"| HTTP chat, streamed (SSE), raw lines (httpx) | {raw:.1f} | {raw / local:.2f} |",
        f"| HTTP chat, not streamed | {whole:.1f} | {whole / local:.2f} |",
    ]
    write("\n".join(lines) + "\n", args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
