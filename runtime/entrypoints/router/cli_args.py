"""The options of ``radixlm router`` (argparse only: building the parser loads nothing else)."""

from __future__ import annotations

import argparse

from radixlm.runtime.entrypoints.secrets import API_KEY_ENV

POLICY_CHOICES = ["cache_aware", "round_robin", "shortest_queue"]


def add_router_args(p: argparse.ArgumentParser) -> None:
    """The options of ``radixlm router``."""
    p.add_argument("--worker-urls", nargs="+", default=[], metavar="URL", help="The engine servers (radixlm serve) to route to, e.g. http://127.0.0.1:30001.")
    p.add_argument("--policy", default="cache_aware", choices=POLICY_CHOICES, help="How a worker is chosen per request (default: cache_aware). See docs/scale-out.md.")
    p.add_argument("--host", default="127.0.0.1", help="Address to listen on (default: 127.0.0.1).")
    p.add_argument("--port", type=int, default=30000, help="Port to listen on (default: 30000).")
    p.add_argument("--cache-threshold", type=float, default=0.5, help="cache_aware: route to the worker with the longest prefix match when it covers at least this share of the request's text; else to the worker holding the least text (default: 0.5).")
    p.add_argument("--balance-abs-threshold", type=int, default=4, help="cache_aware: the load is imbalanced, and a request goes to the least loaded worker whatever its prefix, when the busiest worker has more than this many requests in flight beyond the idlest's and more than --balance-rel-threshold times them (default: 4, measured on benchmarks/scale_out.py; SGLang uses a larger one for GPU-sized batches).")
    p.add_argument("--balance-rel-threshold", type=float, default=1.5, help="cache_aware: see --balance-abs-threshold (default: 1.5).")
    p.add_argument("--max-tree-chars", type=int, default=2_000_000, help="cache_aware: characters of request text remembered per worker; past it the least recently used are forgotten (default: 2000000).")
    p.add_argument("--health-check-interval", type=float, default=2.0, help="Seconds between GET /health checks of each worker (default: 2).")
    p.add_argument("--max-retries", type=int, default=2, help="Times a request that fails before its first byte is sent to another worker (default: 2).")
    p.add_argument("--api-key", default=None, help=f"Require 'Authorization: Bearer KEY' on every route but /health; also sent on the router's own calls to the workers (default: ${API_KEY_ENV} if set). Prefer the variable: a command line is readable by every local user.")
    p.add_argument("--admin-api-key", default=None, help="Also accept this key (default: $RADIXLM_ADMIN_API_KEY if set); it is forwarded, and each worker decides what it opens (see radixlm serve --admin-api-key).")
    p.add_argument("--allowed-hosts", nargs="+", default=[], metavar="HOST", help="Host header values accepted besides IP addresses and localhost (against DNS rebinding); '*' accepts any.")
    p.add_argument("--allowed-origins", nargs="+", default=[], metavar="ORIGIN", help="Browser origins (scheme://host[:port]) allowed to send state-changing requests cross-site; default: none.")
    p.add_argument("--pd-disaggregation", action="store_true", help="Send each request to a prefill worker and a decode worker at once (with a shared bootstrap_room); the client gets the decode worker's answer.")
    p.add_argument("--prefill", default=None, metavar="URL", help="With --pd-disaggregation: the prefill worker.")
    p.add_argument("--decode", default=None, metavar="URL", help="With --pd-disaggregation: the decode worker.")
    p.add_argument("--log-level", default="warning", help="Logging level: debug, info, warning, error (default: warning).")
