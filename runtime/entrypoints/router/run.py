"""``radixlm router``: the router alone, over servers already running, until SIGTERM/SIGINT."""

from __future__ import annotations

import argparse
import signal

import uvicorn

from radixlm.runtime.entrypoints.router.app import create_router_app
from radixlm.runtime.entrypoints.router.config import RouterConfig
from radixlm.runtime.entrypoints.secrets import command_keys


def router_config(ns: argparse.Namespace) -> RouterConfig:
    """The RouterConfig of ``radixlm router``'s options (checked; the key: --api-key, else $RADIXLM_API_KEY)."""
    api_key, admin_key = command_keys(ns)
    config = RouterConfig(
        worker_urls=list(ns.worker_urls), policy=ns.policy, cache_threshold=ns.cache_threshold,
        balance_abs_threshold=ns.balance_abs_threshold, balance_rel_threshold=ns.balance_rel_threshold,
        max_tree_chars=ns.max_tree_chars, health_check_interval=ns.health_check_interval, max_retries=ns.max_retries,
        pd_disaggregation=ns.pd_disaggregation, prefill_url=ns.prefill, decode_url=ns.decode, api_key=api_key,
        admin_api_key=admin_key, allowed_hosts=list(getattr(ns, "allowed_hosts", []) or []), allowed_origins=list(getattr(ns, "allowed_origins", []) or []),
    )
    config.validate()
    return config


def run_router(ns: argparse.Namespace) -> int:
    """``radixlm router``: serve until SIGTERM/SIGINT, then stop listening, let what runs
    finish (up to 30 s) and exit 0."""
    config = router_config(ns)
    app = create_router_app(config)
    state = app.state.router

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: object) -> None:
            # (not appended to uvicorn's captured signals: it would raise it again, exiting -SIGTERM)
            state.shutting_down = True
            if self.should_exit and sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True

    server = Server(uvicorn.Config(app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=30))
    targets = f"prefill {config.prefill_url}, decode {config.decode_url}" if config.pd_disaggregation else ", ".join(config.worker_urls)
    print(f"radixlm router ({config.policy if not config.pd_disaggregation else 'pd'}) on http://{ns.host}:{ns.port} over {targets}", flush=True)
    server.run()
    return 0
