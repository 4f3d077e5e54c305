"""What model families share: attention backends, linear forms and quantization, RoPE, the fused decode stack."""
