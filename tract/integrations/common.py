"""What every engine adapter shares: its tract options, read from the
engine's own config, and one pool handle per (pool, node) per process.

Import-light on purpose (no Numba, no torch): engines import their adapter
module in processes that never open a pool.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Mapping

from tract.errors import ConfigError

__all__ = ["Options", "close_pool", "flag", "open_connector", "open_pool", "options"]


@dataclasses.dataclass(frozen=True)
class Options:
    """An adapter's tract options (the same names in every engine's config)."""

    pool: str  # pool file or DAX device
    node: int  # this host's node id
    manager: bool = False  # run a lock-manager thread here (active or standby)
    checksum: bool = True  # verify every block loaded
    salt: str | None = None  # a tenant's salt: only the same salt shares blocks
    timeout: float = 30.0  # seconds a pool lock may be waited for
    tier: str | None = None  # the cluster tier below the rack (mooncake://MASTER:PORT?...)
    tier_policy: str = "write_through"  # how stores reach the tier (`tract.tier.POLICIES`)
    load_threads: int | None = None  # threads a large load is copied by (`tract.transfer`)


def flag(value, name: str, where: str) -> bool:
    """``value`` as a bool (true or false, as JSON or a string; 1 or 0 as a
    string); a `ConfigError` naming ``name`` in ``where`` otherwise."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false", "1", "0"):
        return value.lower() in ("true", "1")
    raise ConfigError(f"{where}: {name} must be true or false, got {value!r}")


def options(config: Mapping, where: str, prefix: str = "") -> Options:
    """The `Options` in an engine's config mapping (keys ``prefix + name``);
    ``where`` names the config for errors.  ``pool`` and ``node`` are
    required; unknown ``prefix`` keys are refused, so a typo is not a
    silent default."""
    known = {field.name for field in dataclasses.fields(Options)}
    ours = {key[len(prefix):]: value for key, value in config.items()
            if isinstance(key, str) and key.startswith(prefix)}
    if prefix:
        unknown = sorted(set(ours) - known)
        if unknown:
            raise ConfigError(f"{where}: unknown tract option(s) "
                              f"{[prefix + name for name in unknown]}; known: "
                              f"{[prefix + name for name in sorted(known)]}")
    for name in ("pool", "node"):
        if name not in ours:
            raise ConfigError(f"{where} needs {prefix + name!r} (the pool's path and this "
                              f"host's node id); got {sorted(config)}")
    node = ours["node"]
    if isinstance(node, str) and node.strip().isdigit():
        node = int(node)
    if not isinstance(node, int) or isinstance(node, bool) or node < 0:
        raise ConfigError(f"{where}: {prefix}node must be a non-negative int, got "
                          f"{ours['node']!r}")
    try:
        timeout = float(ours.get("timeout", 30.0))
    except (TypeError, ValueError):
        raise ConfigError(f"{where}: {prefix}timeout must be a number of seconds, got "
                          f"{ours['timeout']!r}") from None
    if not timeout > 0:
        raise ConfigError(f"{where}: {prefix}timeout must be positive, got {timeout}")
    salt, tier = ours.get("salt"), ours.get("tier")
    if tier is not None and not (isinstance(tier, str) and tier.startswith("mooncake://")):
        raise ConfigError(f"{where}: {prefix}tier must be a tier URL (mooncake://MASTER:PORT"
                          f"?metadata=...), got {tier!r}")
    from tract.tier import POLICIES

    policy = ours.get("tier_policy", POLICIES[0])
    if policy not in POLICIES:
        raise ConfigError(f"{where}: {prefix}tier_policy must be one of {POLICIES}, got "
                          f"{policy!r}")
    threads = ours.get("load_threads")
    if isinstance(threads, str) and threads.strip().isdigit():
        threads = int(threads)
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool)
                                or threads < 1):
        raise ConfigError(f"{where}: {prefix}load_threads must be a positive int, got "
                          f"{ours['load_threads']!r}")
    return Options(pool=str(ours["pool"]), node=node,
                   manager=flag(ours.get("manager", False), prefix + "manager", where),
                   checksum=flag(ours.get("checksum", True), prefix + "checksum", where),
                   salt=None if salt is None else str(salt), timeout=timeout, tier=tier,
                   tier_policy=policy, load_threads=threads)


_pools: dict[tuple[str, int], list] = {}  # (path, node) -> [pool, users]
_pools_lock = threading.Lock()


def open_pool(path: str, node: int, manager: bool):
    """This process's pool handle as ``node``: every adapter object of one
    process (vLLM's scheduler and worker connectors, SGLang's TP ranks in
    one process) shares it; `close_pool` once per `open_pool`."""
    from tract.pool import Pool

    with _pools_lock:
        entry = _pools.get((path, node))
        if entry is None:
            entry = _pools[(path, node)] = [Pool.open(path, node, manager=manager), 0]
        entry[1] += 1
        return entry[0]


def close_pool(path: str, node: int) -> None:
    with _pools_lock:
        entry = _pools.get((path, node))
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            del _pools[(path, node)]
            entry[0].close()


def open_connector(opts: Options, layout):
    """A `tract.connector.Connector` for ``layout`` over this process's
    handle of the pool; `close_pool` when done with it.  The process's
    kernels are compiled first (`tract.connector.warm_up`), so none is
    compiled under a pool lock or in a request."""
    from tract.connector import Connector, warm_up

    warm_up()
    pool = open_pool(opts.pool, opts.node, opts.manager)
    try:
        return Connector(pool, layout, checksum=opts.checksum, salt=opts.salt,
                         timeout=opts.timeout, tier=opts.tier, tier_policy=opts.tier_policy,
                         load_threads=opts.load_threads)
    except BaseException:
        close_pool(opts.pool, opts.node)
        raise
