"""KV memory: the token-slot pool, per-request slot tables and the RadixAttention prefix tree."""

from radixlm.radix_cache.manager import KVManager, KVState
from radixlm.radix_cache.origin import EvictionLog, Origin
from radixlm.radix_cache.pool import KVPool, SlotAllocator
from radixlm.radix_cache.req_table import ReqToTokenTable
from radixlm.radix_cache.tree import MatchResult, RadixCache, TreeNode

__all__ = ["EvictionLog", "KVManager", "KVPool", "KVState", "Origin", "MatchResult", "RadixCache", "ReqToTokenTable", "SlotAllocator", "TreeNode"]
