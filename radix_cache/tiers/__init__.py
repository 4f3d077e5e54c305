"""Tiers of KV below the pool: host memory and disk, under the radix tree (``hierarchy.py``)."""

from radixlm.radix_cache.tiers.hierarchy import KVTiers, Promotion

__all__ = ["KVTiers", "Promotion"]
