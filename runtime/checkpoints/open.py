"""Opening a checkpoint by what ``path`` is: a GGUF file or a Hugging Face folder."""

from __future__ import annotations

import os

from radixlm.runtime.checkpoints.base import Checkpoint


def is_gguf(path: str) -> bool:
    """True for a single-file GGUF model."""
    return os.path.isfile(path) and path.endswith(".gguf")


def open_checkpoint(path: str, native: bool = True) -> Checkpoint:
    """The checkpoint at ``path``; quantized weights as stored when ``native``, else dequantized."""
    if is_gguf(path):
        from radixlm.runtime.checkpoints.gguf import open_gguf

        return open_gguf(path, native)
    from radixlm.runtime.checkpoints.folder import open_folder

    return open_folder(path, native)
