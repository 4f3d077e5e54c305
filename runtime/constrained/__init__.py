"""Constrained decoding: grammar backends, compilation cache and jump-forward."""
