"""The ``radixlm`` command: ``generate`` runs one prompt, ``serve`` starts the HTTP server
(``--dp-size N``: N of them behind the router), ``router`` routes over running servers,
``explain-cache`` prints a server's recent cache explanations."""

from __future__ import annotations

import argparse
import logging
import sys

from radixlm.runtime.entrypoints.cli import explain_cache as explain_cli
from radixlm.runtime.entrypoints.secrets import ADMIN_KEY_ENV, API_KEY_ENV
from radixlm.runtime.server_args import ServerArgs


def _generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="Generate a continuation of a prompt and print it.",
        description="Load the model (the embedded SmolLM2-135M-Instruct unless --model-path is given), generate a continuation of TEXT and print it.",
    )
    p.add_argument("text", help="The prompt.")
    p.add_argument("--max-new-tokens", type=int, default=64, help="Most tokens to generate (default: 64).")
    p.add_argument("--temperature", type=float, default=0.0, help="Sampling temperature; 0 picks the most likely token each step (default: 0).")
    p.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling: keep the smallest set of tokens whose probability reaches this (default: 1).")
    p.add_argument("--top-k", type=int, default=-1, help="Keep only the k most likely tokens; -1 keeps all (default: -1).")
    p.add_argument("--seed", type=int, default=None, help="Seed for sampling, for repeatable output.")
    p.add_argument("--chat", action="store_true", help="Wrap TEXT as a user message in the model's chat template.")
    p.add_argument("--stream", action="store_true", help="Print text as it is generated.")
    ServerArgs.add_cli_args(p)


def _serve_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "serve",
        help="Serve the model over HTTP (native /generate and OpenAI-compatible routes).",
        description="Start the radixlm HTTP server.",
    )
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=30000, help="Port to listen on (default: 30000).")
    p.add_argument("--api-key", default=None, help=f"Require 'Authorization: Bearer KEY' on every route but /health (default: ${API_KEY_ENV} if set). Prefer the variable: a command line is readable by every local user.")
    p.add_argument("--admin-api-key", default=None, help=f"The key that alone opens what spans tenants: the dashboard, every tenant's cache explanations, /flush_cache, aborting any request, /get_server_info's paths (default: ${ADMIN_KEY_ENV} if set). See docs/security.md.")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST", help="Host header values accepted besides the bound address, localhost and the loopback addresses (against DNS rebinding); '*' accepts any. See docs/security.md.")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help="Browser origins (scheme://host[:port]) allowed to call the API cross-site (CORS); default: none, no CORS headers are sent.")
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # a socket the launcher bound and handed down
    p.add_argument("--max-queued-requests", type=int, default=1024, help="Requests waiting beyond this are refused with 429 (default: 1024).")
    p.add_argument("--drain-timeout", type=float, default=30.0, help="On SIGTERM, seconds to let running requests finish while new ones get 503; streams still running then end with an error event (default: 30).")
    p.add_argument("--served-model-name", default=None, help="Model name reported by /v1/models (default: from the model path).")
    p.add_argument("--dp-size", type=int, default=1, help="Data parallelism: start this many engine servers (each on a loopback port, with its share of the CPU threads or one GPU each) behind the router on --host/--port (default: 1, a single server).")
    p.add_argument("--router-policy", default="cache_aware", choices=["cache_aware", "round_robin", "shortest_queue"], help="With --dp-size > 1: how the router picks a server per request (default: cache_aware).")
    ServerArgs.add_cli_args(p)
    return p


def _router_parser(sub: argparse._SubParsersAction) -> None:
    from radixlm.runtime.entrypoints.router.cli_args import add_router_args

    p = sub.add_parser(
        "router",
        help="Route requests over several running servers (cache-aware), or a prefill/decode pair.",
        description="Start the radixlm router: one HTTP front (generation, models, health, metrics, cache flush, abort) over the engine servers given by --worker-urls, choosing a server per request; or, with --pd-disaggregation, over a prefill and a decode server.",
    )
    add_router_args(p)


def run_generate(ns: argparse.Namespace) -> int:
    """Run one generation and print it."""
    from radixlm.runtime.sampling_params import SamplingParams

    args = ServerArgs.from_cli(ns)
    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature, "top_p": ns.top_p, "top_k": ns.top_k, "seed": ns.seed}
    SamplingParams.from_dict(params)  # a bad option is refused before torch and the model load
    from radixlm.runtime.engine import Engine

    with Engine(**vars(args)) as engine:
        prompt = ns.text
        if ns.chat:
            from radixlm.runtime.tokenizer import apply_chat_template

            prompt = apply_chat_template(engine.tokenizer, [{"role": "user", "content": ns.text}])
        if ns.stream:
            shown = 0
            for out in engine.generate(prompt, params, stream=True):
                sys.stdout.write(out["text"][shown:])
                sys.stdout.flush()
                shown = len(out["text"])
            sys.stdout.write("\n")
        else:
            print(engine.generate(prompt, params)["text"])
    return 0


def main(argv: list[str] | None = None) -> None:
    """Entry point of the ``radixlm`` console script and ``python -m radixlm``."""
    parser = argparse.ArgumentParser(prog="radixlm", description="radixlm: a structured-generation runtime for LLM programs.")
    sub = parser.add_subparsers(dest="command", required=True)
    _generate_parser(sub)
    serve_parser = _serve_parser(sub)
    _router_parser(sub)
    explain_cli.add_parser(sub)
    ns = parser.parse_args(argv)
    # The library never configures logging; the command line does, for its own process.
    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        if ns.command == "generate":
            code = run_generate(ns)
        elif ns.command == "explain-cache":
            code = explain_cli.run(ns)
        elif ns.command == "router":
            from radixlm.runtime.entrypoints.router.run import run_router

            code = run_router(ns)
        elif ns.dp_size != 1:
            from radixlm.runtime.entrypoints.router.launch import run_dp

            if ns.dp_size < 1:
                raise ValueError(f"--dp-size must be >= 1, got {ns.dp_size}")
            if ns.disaggregation_mode is not None:
                raise ValueError("--dp-size does not combine with --disaggregation-mode: start the prefill and decode workers one by one and put radixlm router --pd-disaggregation in front")
            code = run_dp(ns, serve_parser)
        else:
            from radixlm.runtime.entrypoints.http.server import run_server

            code = run_server(ns)
    except (ValueError, FileNotFoundError) as exc:
        print(f"radixlm: error: {exc}", file=sys.stderr)
        code = 2
    sys.exit(code)
