"""Tiers of KV below the pool: host memory and disk, under the radix tree (``hierarchy.py``)."""

from radixlm.radix_cache.tiers.hierarchy import LOWER_TIERS, TIERS, KVTiers, Promotion

__all__ = ["LOWER_TIERS", "TIERS", "KVTiers", "Promotion"]
