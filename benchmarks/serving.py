"""Serving benchmark over the OpenAI API: TTFT, inter-token latency and throughput by concurrency.

Runs against any OpenAI-compatible server (radixlm, llama.cpp's llama-server, vLLM ...), so peers
are measured with the same script. Each request shares one system prompt (~190 tokens) and asks
a distinct short question; responses are streamed to time the first token and the gaps between
tokens.

    .venv/bin/python benchmarks/serving.py --base-url http://127.0.0.1:30000 [--concurrency 1 8 32]
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import statistics
import sys
import time
from pathlib import Path

import openai

sys.path.insert(0, str(Path(__file__).parent))
from report import write  # noqa: E402
from workloads import SYSTEM_PROMPT, chat_questions  # noqa: E402


async def one_request(client: openai.AsyncOpenAI, model: str, question: str, max_tokens: int) -> dict:
    """Stream one chat completion; returns its timings and token count."""
    start = time.perf_counter()
    stamps: list[float] = []
    usage = None
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": question}],
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
    end = time.perf_counter()
    tokens = usage.completion_tokens if usage else len(stamps)
    cached = getattr(getattr(usage, "prompt_tokens_details", None), "cached_tokens", None) if usage else None
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    return {"ttft": (stamps[0] - start) if stamps else end - start, "gaps": gaps, "tokens": tokens, "latency": end - start, "prompt": usage.prompt_tokens if usage else 0, "cached": cached or 0}


async def run_level(client: openai.AsyncOpenAI, model: str, questions: list[str], concurrency: int, max_tokens: int) -> dict:
    """All questions with at most ``concurrency`` in flight."""
    sem = asyncio.Semaphore(concurrency)

    async def bounded(q: str) -> dict:
        async with sem:
            return await one_request(client, model, q, max_tokens)

    start = time.perf_counter()
    results = await asyncio.gather(*(bounded(q) for q in questions))
    wall = time.perf_counter() - start
    gaps = [g for r in results for g in r["gaps"]]
    ttfts = sorted(r["ttft"] for r in results)
    prompt = sum(r["prompt"] for r in results)
    return {
        "concurrency": concurrency,
        "requests": len(results),
        "output_tokens": sum(r["tokens"] for r in results),
        "wall_s": wall,
        "tok_s": sum(r["tokens"] for r in results) / wall,
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
        "itl_p90_ms": 1e3 * sorted(gaps)[int(0.9 * (len(gaps) - 1))] if gaps else float("nan"),
        "hit_rate": (sum(r["cached"] for r in results) / prompt) if prompt else float("nan"),
    }


def table(rows: list[dict]) -> str:
    """Markdown table of the levels."""
    lines = ["| concurrency | requests | output tokens | wall (s) | output tok/s | TTFT p50 (s) | TTFT p90 (s) | ITL p50 (ms) | ITL p90 (ms) | cache hit rate |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['concurrency']} | {r['requests']} | {r['output_tokens']} | {r['wall_s']:.1f} | {r['tok_s']:.1f} | {r['ttft_p50']:.2f} | {r['ttft_p90']:.2f} | {r['itl_p50_ms']:.1f} | {r['itl_p90_ms']:.1f} | {r['hit_rate']:.3f} |")
    return "\n".join(lines)


async def main_async(args: argparse.Namespace) -> str:
    client = openai.AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    await one_request(client, model, "Hello!", 4)  # warm-up
    rows = []
    for c in args.concurrency:
        n = args.num_requests or max(8, 2 * c)
        rows.append(await run_level(client, model, chat_questions(n), c, args.max_tokens))
        print(table(rows[-1:]), flush=True)
    header = f"Server: {args.base_url} (model {model}); {args.max_tokens} max tokens, temperature 0; date {datetime.date.today()}.\n\nCommand: `{' '.join(sys.argv)}`\n\n"
    return header + table(rows) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--api-key", default="none")
    ap.add_argument("--model", default=None, help="Model name to send (default: the server's first model).")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--num-requests", type=int, default=None, help="Requests per level (default: max(8, 2 x concurrency)).")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", default=None, help="Also write the markdown result here.")
    args = ap.parse_args()
    text = asyncio.run(main_async(args))
    write(text, args.out)


if __name__ == "__main__":
    main()
