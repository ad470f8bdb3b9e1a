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
import importlib

# The rest is imported on first use (PEP 562): `import tract.errors` or an
# engine adapter stays light (no Numba, no LLVM) until a pool is opened.
_LAZY = {"Lock": "tract.lock", "CacheControl": "tract.platform",
         "cache_control": "tract.platform", "default_cache_control": "tract.platform",
         "info": "tract.platform", "Pool": "tract.pool", "Region": "tract.region",
         "create_region": "tract.region", "open_region": "tract.region",
         "scratch_region": "tract.region"}


def __getattr__(name: str):
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tract' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


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
