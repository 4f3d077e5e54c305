"""Write the embedded SmolLM2 GGUF as a Hugging Face folder (fp32 safetensors) for peers that need one.

    .venv/bin/python benchmarks/peers/export_hf.py OUT_DIR
"""

from __future__ import annotations

import os
import sys

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from radixlm.runtime.loader import default_model_path


def main() -> None:
    out = sys.argv[1]
    folder, name = os.path.split(default_model_path())
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    model.hf_quantizer = None  # save_pretrained refuses a GGUF-loaded model otherwise
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
