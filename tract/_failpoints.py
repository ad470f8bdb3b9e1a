"""Named fail points in the protocol steps (`tract.testing.faults` runs the
kill and stall campaigns over them; this module imports only the standard
library, so the protocol modules import nothing of `tract.testing`).

A point is armed from the environment, read once at import
(``TRACT_KILL_POINT=<name>``, ``TRACT_KILL_AFTER=<n>``: die the n-th time
the point is reached, default 1; ``TRACT_KILL_ACTION=stop``: stop there
instead), or in a process by `arm`, whose
``action`` is ``"kill"`` (SIGKILL: a crash) or ``"stop"`` (SIGSTOP: a
stall, until another process sends SIGCONT; the point is disarmed first,
`on_stop` is called before it and `on_resume` after).  A thread inside
`suspended` passes every point as if none were armed, and counts none.
Unarmed, `point` is
one comparison; a hot path skips even the call while ``ARMED`` (the armed
point's name) is None.  The points are listed, with where each lies, in
`tract.testing.faults`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

__all__ = ["ACTIONS", "ARMED", "POINTS", "arm", "on_resume", "on_stop", "point", "suspended"]

POINTS = ("lock.acquired", "lock.release", "manager.grant", "alloc.locked", "free.locked",
          "store.copied", "publish.locked", "evict.marked", "load.pinned", "handoff.pinned",
          "handoff.released")
ACTIONS = ("kill", "stop")

ARMED = os.environ.get("TRACT_KILL_POINT") or None
_AFTER = int(os.environ.get("TRACT_KILL_AFTER", "1"))
if ARMED is not None and ARMED not in POINTS:
    raise ValueError(f"TRACT_KILL_POINT={ARMED!r} is not a kill point; the points are "
                     f"{', '.join(POINTS)}")
if _AFTER < 1:
    raise ValueError(f"TRACT_KILL_AFTER must be at least 1, got {_AFTER}")
_ACTION = os.environ.get("TRACT_KILL_ACTION", "kill")
if _ACTION not in ACTIONS:
    raise ValueError(f"TRACT_KILL_ACTION={_ACTION!r} is not an action; the actions are "
                     f"{', '.join(ACTIONS)}")
_reached = 0
_thread = threading.local()  # .suspended: how deep this thread is in `suspended`
#: called with the point's name right before a stop, and right after the resume
on_stop = None
on_resume = None


def arm(name: str | None, after: int = 1, action: str = "kill") -> None:
    """Arm ``name`` in this process (None disarms): ``action`` the
    ``after``-th time it is reached from now."""
    global ARMED, _AFTER, _ACTION, _reached
    if name is not None and name not in POINTS:
        raise ValueError(f"{name!r} is not a fail point; the points are {', '.join(POINTS)}")
    if after < 1:
        raise ValueError(f"after must be at least 1, got {after}")
    if action not in ACTIONS:
        raise ValueError(f"action must be one of {ACTIONS}, got {action!r}")
    ARMED, _AFTER, _ACTION, _reached = name, after, action, 0


@contextlib.contextmanager
def suspended():
    """Inside, this thread passes every point unarmed and uncounted: work
    that is no protocol step of the engine's (`tract.connector.warm_up`'s
    scratch pool) neither dies nor uses up an armed count."""
    _thread.suspended = getattr(_thread, "suspended", 0) + 1
    try:
        yield
    finally:
        _thread.suspended -= 1


def point(name: str) -> None:
    """Die here by SIGKILL, or stop by SIGSTOP, if ``name`` is the armed
    point and this is the armed time it is reached (outside `suspended`)."""
    global ARMED, _reached
    if name != ARMED or getattr(_thread, "suspended", 0):
        return
    _reached += 1
    if _reached < _AFTER:
        return
    if _ACTION == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    ARMED = None
    if on_stop is not None:
        on_stop(name)
    # sent to this thread: one sent to the process is taken by its main thread
    # first, and a point reached on another (a transfer thread) would run on
    # until then; the stop itself stops every thread
    signal.pthread_kill(threading.get_ident(), signal.SIGSTOP)
    if on_resume is not None:
        on_resume(name)
