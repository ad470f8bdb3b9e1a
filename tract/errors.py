"""Exceptions raised by tract.

Every error tract raises derives from ``TractError``.  Errors about bad input
also derive from the matching builtin (``IndexError``, ``ValueError``,
``OSError``) so callers can catch them either way.
"""

__all__ = ["TractError", "BoundsError", "ConfigError", "CorruptionError", "CudaError", "DaxError",
           "LeaseLost", "LockTimeout", "PoolFull"]


class TractError(Exception):
    """Base class of every error tract raises."""


class BoundsError(TractError, IndexError):
    """An offset or length lies outside a mapped region (nothing was touched)."""


class ConfigError(TractError, ValueError):
    """A configuration value (argument or environment variable) is invalid."""


class CorruptionError(TractError):
    """A value read from the pool is out of range (DESIGN.md R5).

    The message names the structure and the offset it was read from.
    """


class CudaError(TractError):
    """A CUDA runtime call failed; the message names the call and the error."""


class DaxError(TractError, OSError):
    """A device-DAX path breaks a rule for mapping it; the message names the rule."""


class LockTimeout(TractError, TimeoutError):
    """A lock was not acquired in time; the message names the lock, the
    holder node and how long the caller waited."""


class LeaseLost(TractError):
    """The caller's grant on a lock was revoked (its lease lapsed, or another
    node took the lock over): work done under it must not be published."""


class PoolFull(TractError, MemoryError):
    """No free space of the requested size, even after reclaiming what dead
    owners left; the message says how much was asked and how much is free."""
