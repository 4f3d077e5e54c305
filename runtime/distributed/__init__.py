"""Tensor parallelism: process groups, how a model's weights split across ranks, and the workers."""
