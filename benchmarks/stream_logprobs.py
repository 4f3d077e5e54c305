"""What streaming with prompt logprobs costs: bytes sent and engine time per step.

Streams ``--tokens`` tokens from the tiny random-weight Llama of the test suite with prompt
logprobs (``logprob_start_len=0``), ``--top`` alternatives and their texts, next to a plain
greedy stream (the neighbour). Reports the bytes of every chunk as JSON (what ``/generate``
sends), the time the engine thread spent building outputs, the mean engine step and the
neighbour's mean time per token.

    .venv/bin/python benchmarks/stream_logprobs.py [--tokens 512] [--top 20] [--prompt-tokens 256]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
import radixlm  # noqa: E402
from helpers import make_tiny_model  # noqa: E402
from radixlm.runtime import output as output_mod  # noqa: E402
from radixlm.runtime.scheduler import step as scheduler_mod  # noqa: E402


class _Timer:
    """Wraps a method on a class and sums the seconds spent in it."""

    def __init__(self, cls: type, name: str) -> None:
        self.total, self.calls = 0.0, 0
        inner = getattr(cls, name)

        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.total += time.perf_counter() - t0
                self.calls += 1

        setattr(cls, name, timed)


async def _run(engine: radixlm.Engine, prompt_ids: list[int], tokens: int, top: int) -> dict:
    params = {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}
    heavy = await engine.async_generate(
        input_ids=prompt_ids, sampling_params=params, stream=True, return_logprob=True,
        top_logprobs_num=top, logprob_start_len=0, return_text_in_logprobs=True,
    )
    light = await engine.async_generate(input_ids=prompt_ids[:8], sampling_params=params, stream=True)
    sizes: list[int] = []

    async def read_heavy() -> None:
        async for chunk in heavy:
            sizes.append(len(json.dumps(chunk)))

    async def read_light() -> tuple[float, int]:
        t0, n = time.perf_counter(), 0
        async for _ in light:
            n += 1
        return time.perf_counter() - t0, n

    _, (light_s, light_n) = await asyncio.gather(read_heavy(), read_light())
    return {"sizes": sizes, "light_ms_per_token": 1e3 * light_s / max(light_n, 1)}


def main() -> None:
    """Parse the options, run one measured stream and print the figures."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512)
    ap.add_argument("--top", type=int, default=20)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ns = ap.parse_args()
    folder = make_tiny_model("llama", Path(tempfile.mkdtemp(prefix="radixlm-stream-")) / "llama")
    build = _Timer(output_mod.OutputBuilder, "build")
    step = _Timer(scheduler_mod.Scheduler, "step")
    with radixlm.Engine(model_path=folder, max_total_tokens=8192, num_threads=1) as engine:
        prompt = engine.tokenize("Once upon a time, in a small village, there lived a curious engineer. " * 40)[: ns.prompt_tokens]
        res = asyncio.run(_run(engine, prompt, ns.tokens, ns.top))
    sizes = res["sizes"]
    print(f"chunks {len(sizes)}  total bytes {sum(sizes):,}  first {sizes[0]:,}  last {sizes[-1]:,}  max {max(sizes):,}")
    print(f"engine steps {step.calls}  mean step {1e3 * step.total / max(step.calls, 1):.2f} ms  "
          f"OutputBuilder.build {1e3 * build.total:.0f} ms total over {build.calls} calls")
    print(f"neighbour stream: {res['light_ms_per_token']:.2f} ms per token")


if __name__ == "__main__":
    main()
