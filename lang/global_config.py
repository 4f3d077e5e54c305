"""GlobalConfig: the frontend's process-wide settings (SGLang's ``global_config``), one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class GlobalConfig:
    """Settings every program run reads; change them on ``radixlm.global_config``.

    - ``verbosity``: 0 prints nothing; 2 prints each run's final text.
    - ``default_backend``: where programs run when ``run`` gets no backend (``set_default_backend``).
    - ``skip_special_tokens_in_output`` / ``spaces_between_special_tokens_in_out``: the defaults of
      the sampling parameters ``skip_special_tokens`` / ``spaces_between_special_tokens`` of every
      ``gen`` that does not set them.
    - ``enable_precache_with_tracing``: ``run_batch`` traces the program and prefills the prefix
      all its instances share before running them.
    - ``enable_parallel_encoding``: ``fork(n)`` with n > 1 prefills the shared text once before
      the branches start, so they all hit the cache instead of racing to compute it.
    """

    verbosity: int = 0
    default_backend: Any = None
    skip_special_tokens_in_output: bool = True
    spaces_between_special_tokens_in_out: bool = True
    enable_precache_with_tracing: bool = True
    enable_parallel_encoding: bool = True


global_config = GlobalConfig()
