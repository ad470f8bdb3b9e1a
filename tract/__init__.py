"""tract: a rack-scale KV cache for disaggregated LLM serving in CXL shared memory.

The pool is one shared mapping that every host maps at its own address; see
`tract.region` for mapping it and `tract.platform` for the cache-control
choices made on this machine.
"""

from tract.errors import (
                          BoundsError,
                          ConfigError,
                          CorruptionError,
                          DaxError,
                          LeaseLost,
                          LockTimeout,
                          TractError,
)
from tract.lock import Lock
from tract.platform import CacheControl, cache_control, default_cache_control, info
from tract.pool import Pool
from tract.region import Region, create_region, open_region, scratch_region

__all__ = [
    "BoundsError",
    "CacheControl",
    "ConfigError",
    "CorruptionError",
    "DaxError",
    "LeaseLost",
    "Lock",
    "LockTimeout",
    "Pool",
    "Region",
    "TractError",
    "cache_control",
    "create_region",
    "default_cache_control",
    "info",
    "open_region",
    "scratch_region",
]

__version__ = "0.1.0"
