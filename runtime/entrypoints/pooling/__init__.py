"""Pooling routes: /v1/embeddings, /v1/rerank and /v1/score over a pooling run of the served model."""
