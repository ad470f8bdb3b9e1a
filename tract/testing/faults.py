"""Named kill points: a process dies by SIGKILL at a chosen point of a
protocol, as a crashing host would, so tests can prove that the rest of the
rack survives it (R6: every claim it held is a lease).

A point is armed from the environment, read once at import:
``TRACT_KILL_POINT=<name>`` and, optionally, ``TRACT_KILL_AFTER=<n>`` (die
at the n-th time the point is reached, default 1).  Unarmed, `point` is one
comparison.

Points: ``store.copied`` (`Connector.store`: payloads copied into reserved
blocks, not yet published).
"""

from __future__ import annotations

import os
import signal

__all__ = ["POINTS", "point"]

POINTS = ("store.copied",)

_ARMED = os.environ.get("TRACT_KILL_POINT") or None
_AFTER = int(os.environ.get("TRACT_KILL_AFTER", "1"))
if _ARMED is not None and _ARMED not in POINTS:
    raise ValueError(f"TRACT_KILL_POINT={_ARMED!r} is not a kill point; the points are "
                     f"{', '.join(POINTS)}")
if _AFTER < 1:
    raise ValueError(f"TRACT_KILL_AFTER must be at least 1, got {_AFTER}")
_reached = 0


def point(name: str) -> None:
    """Die here by SIGKILL if ``name`` is the armed point and this is the
    armed time it is reached."""
    global _reached
    if name != _ARMED:
        return
    _reached += 1
    if _reached >= _AFTER:
        os.kill(os.getpid(), signal.SIGKILL)
