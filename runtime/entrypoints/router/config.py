"""RouterConfig: every option of ``radixlm router``, checked in one place."""

from __future__ import annotations

from dataclasses import dataclass, field

from radixlm.runtime.entrypoints.router.policy import POLICIES, CacheAwareSettings


@dataclass
class RouterConfig:
    """What the router serves: its workers (or a prefill/decode pair), policy and limits."""

    worker_urls: list[str] = field(default_factory=list)
    policy: str = "cache_aware"
    cache_threshold: float = 0.5
    balance_abs_threshold: int = 4
    balance_rel_threshold: float = 1.5
    max_tree_chars: int = 2_000_000
    health_check_interval: float = 2.0
    max_retries: int = 2
    connect_timeout: float = 5.0
    pd_disaggregation: bool = False
    prefill_url: str | None = None
    decode_url: str | None = None
    api_key: str | None = None  # required of clients (but on /health) and sent on the router's own calls
    admin_api_key: str | None = None  # also accepted from clients (forwarded: the workers decide what it opens)
    allowed_hosts: list[str] = field(default_factory=list)  # Host values beyond IP literals and localhost
    allowed_origins: list[str] = field(default_factory=list)  # browser origins allowed cross-site

    def validate(self) -> None:
        """Raise ValueError naming the first invalid option."""
        if self.pd_disaggregation:
            if not self.prefill_url or not self.decode_url:
                raise ValueError("--pd-disaggregation needs --prefill URL and --decode URL")
        elif not self.worker_urls:
            raise ValueError("--worker-urls needs at least one URL")
        elif self.prefill_url or self.decode_url:
            raise ValueError("--prefill and --decode apply only with --pd-disaggregation")
        for url in [*self.worker_urls, self.prefill_url or "http://", self.decode_url or "http://"]:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"a worker URL starts with http:// or https://, got {url!r}")
        if len(set(self.worker_urls)) != len(self.worker_urls):
            raise ValueError("--worker-urls names a worker twice")
        if self.policy not in POLICIES:
            raise ValueError(f"--policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if not 0 <= self.cache_threshold <= 1:
            raise ValueError(f"--cache-threshold must be in [0, 1], got {self.cache_threshold}")
        if self.balance_abs_threshold < 0:
            raise ValueError(f"--balance-abs-threshold must be >= 0, got {self.balance_abs_threshold}")
        if self.balance_rel_threshold < 1:
            raise ValueError(f"--balance-rel-threshold must be >= 1, got {self.balance_rel_threshold}")
        if self.max_tree_chars <= 0:
            raise ValueError(f"--max-tree-chars must be positive, got {self.max_tree_chars}")
        if self.health_check_interval <= 0:
            raise ValueError(f"--health-check-interval must be positive, got {self.health_check_interval}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")
        if self.connect_timeout <= 0:
            raise ValueError(f"connect_timeout must be positive, got {self.connect_timeout}")

    def cache_aware_settings(self) -> CacheAwareSettings:
        """The thresholds of the cache_aware policy."""
        return CacheAwareSettings(self.cache_threshold, self.balance_abs_threshold, self.balance_rel_threshold, self.max_tree_chars)
