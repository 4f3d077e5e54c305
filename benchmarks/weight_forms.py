"""The weight formats the decode benchmarks compare, ``int4_torch`` (our int4 codes on
PyTorch's int4 kernel instead of ours) among them."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import radixlm.runtime.layers.quant as quant_mod
from radixlm.runtime.layers.quantized_linear import Int4Linear


@contextlib.contextmanager
def weights_as(form: str) -> Iterator[str | None]:
    """The ``--quantization`` value of ``form`` (None for fp32 and bf16), for building an engine
    in the block; ``int4_torch`` builds its int4 layers on PyTorch's kernel."""
    kernel = "torch" if form.endswith("_torch") else "auto"
    quant = form.removesuffix("_torch") if form.startswith("int") or form == "auto" else None
    with mock.patch.object(quant_mod, "Int4Linear", functools.partial(Int4Linear, kernel=kernel)):
        yield quant
