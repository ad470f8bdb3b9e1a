"""A fork server for the mutation harness: one interpreter that has
imported what every mutant's test run imports before anything of tract
(pytest and its plugins, NumPy, Numba), and forks a child for each run.

A mutant's run then costs its fork and what is its own, not an
interpreter's start: about 1.4 s here, of the 2-5 s a mutant takes.  The
server never imports tract: each mutant's run imports tract afresh, from
its own overlay (`tract.testing.mutants`), in its own child.

A child gets the run's working directory, environment and code (run as
``python -c`` runs it); its stdout and stderr go to files, its stdin is
/dev/null, and its exit status comes back as `subprocess` reports one
(negative: the signal that ended it).  A server serves one environment
but for the variables its caller names as each run's own (read after
the fork: seeds, report files): `Servers` starts another server for a
run whose other variables differ (one read at import, such as
NUMBA_CACHE_DIR).  A run whose server ended raises `Unavailable`, and
the caller starts an interpreter as before.
"""

from __future__ import annotations

import json
import os
import queue
import select
import signal
import subprocess
import sys
import tempfile

PRELOAD = ("numpy", "numba", "pytest", "_pytest.python", "_pytest.assertion.rewrite",
           "hypothesis", "psutil")

_SERVER = r"""
import json, os, sys, traceback
for name in {preload!r}:
    try:
        __import__(name)
    except ImportError:
        pass
replies = os.fdopen(os.dup(1), "w")
quiet = os.open(os.devnull, os.O_RDWR)
os.dup2(quiet, 1)
for line in sys.stdin:
    request = json.loads(line)
    child = os.fork()
    if child == 0:
        code = 1
        try:
            replies.close()
            os.chdir(request["cwd"])
            os.environ.clear()
            os.environ.update(request["env"])
            for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
                os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
            os.dup2(quiet, 0)
            sys.argv = ["-c"]
            try:
                exec(compile(request["code"], "<string>", "exec"), {{"__name__": "__main__"}})
                code = 0
            except SystemExit as stop:
                if stop.code is None or isinstance(stop.code, int):
                    code = stop.code or 0
                else:
                    print(stop.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except Exception:
                    pass
            os._exit(code)
    print(json.dumps({{"pid": child}}), file=replies, flush=True)
    _, status = os.waitpid(child, 0)
    print(json.dumps({{"status": status}}), file=replies, flush=True)
"""


class Unavailable(Exception):
    """No fork server can take the run: its environment differs from the
    server's in a variable a run may not set for itself, or the server
    ended."""


class ForkServer:
    """One server process; `run` one run at a time (see `Servers` for
    several at once)."""

    def __init__(self, env: dict, run_variables: frozenset, cwd: str):
        self.env = {name: value for name, value in env.items() if name not in run_variables}
        self.run_variables = run_variables
        self._process = subprocess.Popen(
            [sys.executable, "-c", _SERVER.format(preload=PRELOAD)], env=self.env, cwd=cwd,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1)  # by line

    def fits(self, env: dict) -> bool:
        return {name: value for name, value in env.items()
                if name not in self.run_variables} == self.env

    def _reply(self, timeout: float | None) -> dict | None:
        stream = self._process.stdout
        if timeout is not None and not select.select([stream], [], [], max(0.0, timeout))[0]:
            return None
        line = stream.readline()
        if not line:
            raise Unavailable(f"the fork server ended (exit {self._process.poll()})")
        return json.loads(line)

    def run(self, code: str, cwd: str, env: dict, timeout: float
            ) -> subprocess.CompletedProcess:
        """``python -c code`` in ``cwd`` with ``env``, forked; its pid is
        ``.pid`` on the result (and on a `subprocess.TimeoutExpired`)."""
        if not self.fits(env):
            raise Unavailable("the run's environment differs from the fork server's")
        with tempfile.TemporaryDirectory(prefix="tract-fork-") as scratch:
            out, err = os.path.join(scratch, "stdout"), os.path.join(scratch, "stderr")
            request = {"code": code, "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            self._process.stdin.write(json.dumps(request) + "\n")
            pid = self._reply(None)["pid"]
            reply = self._reply(timeout)
            expired = reply is None
            if expired:
                os.kill(pid, signal.SIGKILL)
                reply = self._reply(None)
            status = reply["status"]
            with open(out) as stdout, open(err) as stderr:
                done = subprocess.CompletedProcess(code, _returncode(status), stdout.read(),
                                                   stderr.read())
        done.pid = pid
        if expired:
            error = subprocess.TimeoutExpired(code, timeout, done.stdout, done.stderr)
            error.pid = pid
            raise error
        return done

    def close(self) -> None:
        if self._process.poll() is None:
            self._process.stdin.close()
            try:
                self._process.wait(10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()
        self._process.stdout.close()


def _returncode(status: int) -> int:
    return -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class Servers:
    """Fork servers for threads that run at once: each run takes a free
    server of its environment, or starts one."""

    def __init__(self, run_variables: frozenset):
        self.run_variables = run_variables
        self._free: queue.SimpleQueue = queue.SimpleQueue()
        self._all: list[ForkServer] = []

    def run(self, code: str, cwd: str, env: dict, timeout: float
            ) -> subprocess.CompletedProcess:
        """As `ForkServer.run`, on a free server of ``env``'s (one is
        started where none is free)."""
        server = None
        for _ in range(self._free.qsize()):  # one of this environment, if free
            try:
                candidate = self._free.get_nowait()
            except queue.Empty:
                break
            if candidate.fits(env):
                server = candidate
                break
            self._free.put(candidate)
        if server is None:
            server = ForkServer(env, self.run_variables, str(cwd))
            self._all.append(server)
        try:
            done = server.run(code, cwd, env, timeout)
        except Unavailable:
            if server._process.poll() is None:  # a mismatch: it serves on
                self._free.put(server)
            raise
        except BaseException:
            self._free.put(server)
            raise
        self._free.put(server)
        return done

    def close(self) -> None:
        for server in self._all:
            server.close()
        self._all.clear()
