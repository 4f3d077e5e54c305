"""Prefill/decode disaggregation: what the scheduler does on either side and the KV transfer between them."""
