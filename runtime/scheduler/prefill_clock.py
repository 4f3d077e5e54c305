"""PrefillClock: how long one chunked prompt has run and sat out, which bounds how long it gives way."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PrefillClock:
    """Forward seconds one chunked prompt has run and sat out, which bound how long it gives way.

    A prompt computed over many steps makes every step it joins last seconds. While other
    requests decode (or a short prompt waits) it sits steps out, so theirs stay fast, but only
    while the time it sat out is under ``share`` of its expected prefill time: its own seconds
    so far scaled by its uncomputed tokens (an underestimate, since attention grows with the
    prefix). So it never finishes more than about ``share`` later than it would have alone.
    """

    start: int  # KV length when its prefill began (the cached prefix)
    run_s: float = 0.0  # forward seconds of the steps that computed a chunk of it
    paused_s: float = 0.0  # forward seconds of the steps it sat out

    def may_pause(self, computed: int, total: int, share: float) -> bool:
        """True while the time sat out is within ``share`` of the expected prefill time."""
        done = computed - self.start
        return done > 0 and self.paused_s < share * self.run_s * (total - self.start) / done
