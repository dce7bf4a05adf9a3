"""KV cache: token-granular pools, the request-slot table and exact allocators."""

from executor.kv.allocator import RESERVED_LOCATION, SlotAllocator, TokenAllocator
from executor.kv.manager import Allocation, Extension, KVCacheManager, SequenceState
from executor.kv.pool import KVPool, ReqToTokenTable

__all__ = [
    "RESERVED_LOCATION",
    "Allocation",
    "Extension",
    "KVCacheManager",
    "KVPool",
    "ReqToTokenTable",
    "SequenceState",
    "SlotAllocator",
    "TokenAllocator",
]
