"""One tool-using agent workload over three protocols: chat completions, Anthropic Messages, and
OpenAI Responses continuing with ``previous_response_id``.

Eight agents run six turns each, side by side. Each agent has the same instructions (~600 tokens)
and its own question; turns 1-5 force a call to the ``search`` tool and send back an observation,
turn 6 asks for the answer without tools. Over chat completions and Messages every turn resends the
whole conversation; over Responses a turn sends only the tool's output and the id of the response
it continues. Every request streams; the figures are output tokens/s over the whole run, time to the
first streamed token (p50/p90), the share of prompt tokens read from the radix cache, and request
body bytes at turns 1 and 6. Protocols alternate over ``--rounds`` rounds on one server, the cache
flushed before each; the table gives each protocol's median round.

    .venv/bin/python benchmarks/agent_protocols.py [--threads 2] [--out benchmarks/results/agent_protocols.md]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from http_overhead import start_server  # noqa: E402
from report import machine, write  # noqa: E402
from workloads import AGENT_OBSERVATIONS, agent_preamble, agent_tasks  # noqa: E402

TURNS = 6
SEARCH = {
    "name": "search",
    "description": "Look something up; returns a short observation.",
    "parameters": {
        "type": "object",
        "properties": {"query": {"type": "string", "maxLength": 24}},
        "required": ["query"],
        "additionalProperties": False,
    },
}
TOOL_TOKENS = 48  # room for the forced call's arguments (the query is at most 24 characters)
ANSWER_TOKENS = 32


@dataclass
class Turn:
    """One streamed request: its timings, token counts and body size."""

    ttft: float
    output_tokens: int
    prompt_tokens: int
    cached_tokens: int
    body_bytes: int


@dataclass
class Reply:
    """What the agent needs from a reply: the tool call it made (if any) and the response id."""

    call_id: str | None = None
    arguments: str = ""
    text: str = ""
    response_id: str | None = None
    usage: dict = field(default_factory=dict)


async def stream(client: httpx.AsyncClient, path: str, body: dict, on_event) -> tuple[float, int]:
    """POST ``body`` and feed each SSE data payload to ``on_event``; returns (ttft, body bytes).

    ``on_event`` returns True for an event that carries generated text or arguments: the first
    such event stamps the time to first token."""
    raw = json.dumps(body).encode()
    start = time.perf_counter()
    ttft = None
    async with client.stream("POST", path, content=raw, headers={"content-type": "application/json"}) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {(await r.aread()).decode()[:400]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            if on_event(json.loads(line[6:])) and ttft is None:
                ttft = time.perf_counter() - start
    return (ttft if ttft is not None else time.perf_counter() - start), len(raw)


class ChatAgent:
    """The agent over ``/v1/chat/completions``: the whole conversation every turn."""

    path = "/v1/chat/completions"

    def __init__(self, question: str) -> None:
        self.messages: list[dict] = [{"role": "system", "content": agent_preamble()}, {"role": "user", "content": question}]

    def body(self, turn: int, last: Reply | None) -> dict:
        if last is not None:
            self.messages.append({"role": "assistant", "content": None, "tool_calls": [{"id": last.call_id, "type": "function", "function": {"name": "search", "arguments": last.arguments}}]})
            self.messages.append({"role": "tool", "tool_call_id": last.call_id, "content": AGENT_OBSERVATIONS[turn - 1]})
        final = turn == TURNS - 1
        return {
            "model": "default", "messages": self.messages, "tools": [{"type": "function", "function": SEARCH}],
            "tool_choice": "none" if final else {"type": "function", "function": {"name": "search"}},
            "max_tokens": ANSWER_TOKENS if final else TOOL_TOKENS, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True},
        }

    @staticmethod
    def event(reply: Reply, ev: dict) -> bool:
        if ev.get("usage"):
            u = ev["usage"]
            reply.usage = {"prompt": u["prompt_tokens"], "output": u["completion_tokens"], "cached": (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0}
        if not ev.get("choices"):
            return False
        delta = ev["choices"][0].get("delta") or {}
        for call in delta.get("tool_calls") or []:
            reply.call_id = call.get("id") or reply.call_id
            reply.arguments += (call.get("function") or {}).get("arguments") or ""
        reply.text += delta.get("content") or ""
        return bool(delta.get("content") or any((c.get("function") or {}).get("arguments") for c in delta.get("tool_calls") or []))


class MessagesAgent:
    """The agent over Anthropic's ``/v1/messages``: the whole conversation every turn."""

    path = "/v1/messages"

    def __init__(self, question: str) -> None:
        self.messages: list[dict] = [{"role": "user", "content": question}]

    def body(self, turn: int, last: Reply | None) -> dict:
        if last is not None:
            self.messages.append({"role": "assistant", "content": [{"type": "tool_use", "id": last.call_id, "name": "search", "input": json.loads(last.arguments)}]})
            self.messages.append({"role": "user", "content": [{"type": "tool_result", "tool_use_id": last.call_id, "content": AGENT_OBSERVATIONS[turn - 1]}]})
        final = turn == TURNS - 1
        tool = {"name": SEARCH["name"], "description": SEARCH["description"], "input_schema": SEARCH["parameters"]}
        return {
            "model": "default", "system": agent_preamble(), "messages": self.messages, "tools": [tool],
            "tool_choice": {"type": "none"} if final else {"type": "tool", "name": "search"},
            "max_tokens": ANSWER_TOKENS if final else TOOL_TOKENS, "temperature": 0, "stream": True,
        }

    @staticmethod
    def event(reply: Reply, ev: dict) -> bool:
        kind = ev.get("type")
        if kind == "message_start":
            reply.usage.update(ev["message"].get("usage") or {})
        elif kind == "message_delta":
            reply.usage.update(ev.get("usage") or {})
        elif kind == "content_block_start" and ev["content_block"].get("type") == "tool_use":
            reply.call_id = ev["content_block"]["id"]
        elif kind == "content_block_delta":
            d = ev["delta"]
            reply.arguments += d.get("partial_json") or ""
            reply.text += d.get("text") or ""
            return bool(d.get("partial_json") or d.get("text"))
        if kind == "message_stop":
            u = reply.usage  # Anthropic counts input_tokens without the tokens read from the cache
            cached = u.get("cache_read_input_tokens") or 0
            reply.usage = {"prompt": u.get("input_tokens", 0) + cached + (u.get("cache_creation_input_tokens") or 0), "output": u.get("output_tokens", 0), "cached": cached}
        return False


class ResponsesAgent:
    """The agent over ``/v1/responses``: the first turn sends the conversation, later turns only
    the tool's output and ``previous_response_id``."""

    path = "/v1/responses"

    def __init__(self, question: str) -> None:
        self.question = question

    def body(self, turn: int, last: Reply | None) -> dict:
        final = turn == TURNS - 1
        body = {
            "model": "default", "tools": [{"type": "function", "strict": True, **SEARCH}],
            "tool_choice": "none" if final else {"type": "function", "name": "search"},
            "max_output_tokens": ANSWER_TOKENS if final else TOOL_TOKENS, "temperature": 0, "stream": True, "store": True,
        }
        if last is None:  # the instructions go in as a system item so the stored conversation carries them
            body["input"] = [{"role": "system", "content": agent_preamble()}, {"role": "user", "content": self.question}]
        else:
            body["previous_response_id"] = last.response_id
            body["input"] = [{"type": "function_call_output", "call_id": last.call_id, "output": AGENT_OBSERVATIONS[turn - 1]}]
        return body

    @staticmethod
    def event(reply: Reply, ev: dict) -> bool:
        kind = ev.get("type")
        if kind == "response.created":
            reply.response_id = ev["response"]["id"]
        elif kind == "response.output_item.done" and ev["item"].get("type") == "function_call":
            reply.call_id, reply.arguments = ev["item"]["call_id"], ev["item"]["arguments"]
        elif kind in ("response.completed", "response.incomplete"):  # incomplete: max_output_tokens reached
            u = ev["response"]["usage"]
            reply.usage = {"prompt": u["input_tokens"], "output": u["output_tokens"], "cached": (u.get("input_tokens_details") or {}).get("cached_tokens") or 0}
        elif kind in ("response.output_text.delta", "response.function_call_arguments.delta"):
            reply.text += ev["delta"] if kind == "response.output_text.delta" else ""
            return bool(ev["delta"])
        return False


PROTOCOLS = {"chat completions": ChatAgent, "Messages": MessagesAgent, "Responses + previous_response_id": ResponsesAgent}


async def run_agent(client: httpx.AsyncClient, agent) -> list[Turn]:
    """Six turns of one agent; every forced turn must come back with a tool call."""
    turns: list[Turn] = []
    last: Reply | None = None
    for turn in range(TURNS):
        reply = Reply()
        ttft, size = await stream(client, agent.path, agent.body(turn, last), lambda ev, r=reply: agent.event(r, ev))
        if turn < TURNS - 1 and reply.call_id is None:
            raise RuntimeError(f"{agent.path}: turn {turn + 1} came back without the forced tool call")
        u = reply.usage
        if "output" not in u:
            raise RuntimeError(f"{agent.path}: turn {turn + 1}'s stream ended without its usage")
        turns.append(Turn(ttft, u["output"], u["prompt"], u["cached"], size))
        reply.response_id = reply.response_id or (last.response_id if last else None)
        last = reply
    return turns


async def run_protocol(base: str, name: str, agents: int) -> dict:
    """All agents of one protocol side by side; the round's figures."""
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        await client.post("/flush_cache")
        start = time.perf_counter()
        runs = await asyncio.gather(*(run_agent(client, PROTOCOLS[name](q)) for q in agent_tasks(agents)))
        wall = time.perf_counter() - start
    turns = [t for run in runs for t in run]
    ttfts = sorted(t.ttft for t in turns)
    return {
        "tok_s": sum(t.output_tokens for t in turns) / wall,
        "output": sum(t.output_tokens for t in turns),
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[int(0.9 * (len(ttfts) - 1))],
        "cached_share": sum(t.cached_tokens for t in turns) / max(1, sum(t.prompt_tokens for t in turns)),
        "bytes_1": statistics.mean(run[0].body_bytes for run in runs),
        "bytes_6": statistics.mean(run[-1].body_bytes for run in runs),
        "wall": wall,
    }


def table(results: dict[str, list[dict]]) -> str:
    """The median round of each protocol, with its ratio to chat completions."""
    med = {name: {k: statistics.median(r[k] for r in rounds) for k in rounds[0]} for name, rounds in results.items()}
    chat = med["chat completions"]
    lines = [
        "| protocol | output tok/s | vs chat | TTFT p50 ms | TTFT p90 ms | cached share | request bytes turn 1 | request bytes turn 6 | turn-6 bytes: chat / this |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, m in med.items():
        lines.append(
            f"| {name} | {m['tok_s']:.1f} | {m['tok_s'] / chat['tok_s']:.3f} | {m['ttft_p50'] * 1e3:.0f} | {m['ttft_p90'] * 1e3:.0f} "
            f"| {m['cached_share']:.3f} | {m['bytes_1']:.0f} | {m['bytes_6']:.0f} | {chat['bytes_6'] / m['bytes_6']:.1f}x |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--agents", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--quantization", default=None, help="passed to radixlm serve (default: the checkpoint's own format)")
    ap.add_argument("--base-url", default=None, help="an already running radixlm server (default: start one)")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS), help="comma-separated, from: " + ", ".join(PROTOCOLS))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    names = [n.strip() for n in args.protocols.split(",")]
    if "chat completions" not in names or any(n not in PROTOCOLS for n in names):
        ap.error(f"--protocols: chat completions (the baseline) and names from {list(PROTOCOLS)}")
    proc = None
    if args.base_url:
        base = args.base_url
    else:
        proc, base = start_server(args)
    try:
        asyncio.run(run_protocol(base, "chat completions", 1))  # warm-up: kernels, grammars, allocator
        results: dict[str, list[dict]] = {name: [] for name in names}
        for _ in range(args.rounds):
            for name in names:
                results[name].append(asyncio.run(run_protocol(base, name, args.agents)))
                print(name, {k: round(v, 3) for k, v in results[name][-1].items()}, flush=True)
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(timeout=60)
    text = (
        "# One agent workload over chat completions, Messages and Responses\n\n"
        f"Machine: {machine()}; the embedded default model (SmolLM2-135M-Instruct, its GGUF as stored) served with "
        f"{args.threads} threads; {args.agents} agents x {TURNS} turns side by side, {args.rounds} rounds with the protocols alternating, "
        "the cache flushed before each; each protocol's median round.\n\n"
        f"Command: `{shlex.join(sys.argv)}`\n\n{table(results)}\n\n"
        "Turns 1-5 force a `search` call (arguments at most 24 characters), turn 6 answers without tools "
        f"(at most {ANSWER_TOKENS} tokens). Cached share: prompt tokens read from the radix cache over all prompt tokens. "
        "Over Responses the instructions go in as the first turn's system item, so later turns send only the tool output, "
        "the tools and `previous_response_id`.\n"
    )
    write(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
