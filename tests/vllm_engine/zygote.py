"""Start the vLLM tier's instances (`engine.py`) by forking one process that
imported vLLM once: importing vLLM (and torch with it) is most of an
instance's start on this machine, and the tier starts dozens.

    python zygote.py      # the server: reads requests on stdin, one JSON a line

A request is ``{"spec", "env", "log", "exit"}``: the zygote forks; the child
takes ``env`` as its whole environment, sends its output to ``log``, and
runs `engine.py` on ``spec`` as its ``__main__``, then exits as that script
would (its exit handlers and threads joined).  The zygote answers
``{"pid"}`` on stdout, reaps the child, and writes its exit status, as
`subprocess.Popen.returncode` has it (minus the signal that killed it), to
``exit``.  It ends when its stdin closes.

vLLM reads its settings from the environment when it uses them, so a child's
own environment holds; the zygote imports nothing of tract (a child imports
it with its own environment, its fail points armed or not), and never runs
a torch operation (a forked child must not inherit a thread pool).
`Zygote` and `Child` are the tests' side: a `Child` answers what the tests
ask of a `subprocess.Popen`.
"""

import json
import os
import runpy
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback

ENGINE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "engine.py")


# ------------------------------------------------------------------ server

def _child(request: dict) -> int:
    """In the forked child: run `engine.py` as ``request`` asks; its exit code."""
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = [ENGINE, request["spec"]]
    try:
        runpy.run_path(ENGINE, run_name="__main__")
    except SystemExit as exit:
        return exit.code if isinstance(exit.code, int) else (exit.code is not None)
    except BaseException:  # noqa: B036 - the child reports whatever ended it
        traceback.print_exc()
        return 1
    return 0


def _record(path: str, code: int) -> None:
    with open(path + ".tmp", "w") as sink:
        json.dump({"returncode": code}, sink)
    os.replace(path + ".tmp", path)


def serve() -> None:
    # what every child imports: `engine.py`'s imports and the CPU worker's
    import vllm.distributed.kv_transfer  # noqa: F401
    import vllm.inputs  # noqa: F401
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.engine.llm_engine  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    from vllm import LLM, SamplingParams  # noqa: F401

    children: dict[int, str] = {}
    pending = b""
    while True:
        ready, _, _ = select.select([0], [], [], 0.02)
        if ready:
            chunk = os.read(0, 1 << 16)
            if not chunk:
                break
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    sys.exit(_child(request))  # unwinds to the top: a normal exit
                children[pid] = request["exit"]
                os.write(1, (json.dumps({"pid": pid}) + "\n").encode())
        while children:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            _record(children.pop(pid), os.waitstatus_to_exitcode(status))


# ------------------------------------------------------------- tests' side

class Child:
    """A forked instance, as the tests use a `subprocess.Popen`."""

    def __init__(self, pid: int, exit_path: str):
        self.pid, self.returncode, self._exit = pid, None, exit_path

    def poll(self):
        if self.returncode is None and os.path.exists(self._exit):
            with open(self._exit) as source:
                self.returncode = json.load(source)["returncode"]
        return self.returncode

    def wait(self, timeout=None):
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(ENGINE, timeout)
            time.sleep(0.02)
        return self.returncode

    def send_signal(self, sig) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # exited; the zygote records it

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The server, started with ``env`` (the environment every child's
    starts from); `spawn` forks an instance.  Exit statuses go to a new
    directory under ``directory``."""

    def __init__(self, env: dict, directory: str):
        self._exits, self._count = tempfile.mkdtemp(prefix="exits-", dir=directory), 0
        self._process = subprocess.Popen([sys.executable, __file__], env=env,
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)

    def spawn(self, spec: str, env: dict, log: str) -> Child:
        self._count += 1
        exit_path = os.path.join(self._exits, f"{self._count}.exit")
        request = {"spec": spec, "env": env, "log": log, "exit": exit_path}
        self._process.stdin.write((json.dumps(request) + "\n").encode())
        self._process.stdin.flush()
        answer = self._process.stdout.readline()
        if not answer:
            raise RuntimeError(f"the vLLM zygote exited with {self._process.wait()}")
        return Child(json.loads(answer)["pid"], exit_path)

    def close(self) -> None:
        self._process.stdin.close()
        try:
            self._process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


if __name__ == "__main__":
    serve()
