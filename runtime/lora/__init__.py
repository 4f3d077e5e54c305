"""LoRA adapters: loading PEFT folders, the adapter pool and the batched low-rank deltas."""
