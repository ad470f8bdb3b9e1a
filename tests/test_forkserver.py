"""The mutation harness's fork server (`tract.testing.forkserver`): a run
forked from it is what ``python -c`` in a fresh interpreter would be."""

import os
import subprocess
import sys

import pytest

from tract.testing import forkserver

OWN = frozenset({"TRACT_TEST_RUN"})


@pytest.fixture
def servers():
    pool = forkserver.Servers(OWN)
    yield pool
    pool.close()


def test_a_forked_run_has_its_directory_environment_streams_and_exit_status(servers, tmp_path):
    env = dict(os.environ, TRACT_TEST_RUN="7")
    code = ("import os, sys; print(os.getcwd(), os.environ['TRACT_TEST_RUN'], sys.argv); "
            "print('to err', file=sys.stderr); sys.stdin.read(); raise SystemExit(3)")
    done = servers.run(code, tmp_path, env, timeout=60)
    assert done.returncode == 3 and done.pid != os.getpid()
    assert done.stdout == f"{tmp_path} 7 ['-c']\n" and done.stderr == "to err\n"
    done = servers.run("raise SystemExit('not in effect')", tmp_path, env, timeout=60)
    assert (done.returncode, done.stderr) == (1, "not in effect\n")
    done = servers.run("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", tmp_path,
                       env, timeout=60)
    assert done.returncode == -9
    done = servers.run("1 / 0", tmp_path, env, timeout=60)
    assert done.returncode == 1 and "ZeroDivisionError" in done.stderr
    assert servers.run("import sys; sys.exit()", tmp_path, env, timeout=60).returncode == 0
    fresh = subprocess.run([sys.executable, "-c", "import sys; print(sys.modules.get('tract'))"],
                           env=env, capture_output=True, text=True)
    assert servers.run("import sys; print(sys.modules.get('tract'))", tmp_path, env,
                       timeout=60).stdout == fresh.stdout == "None\n"  # a mutant imports it


def test_a_run_past_its_timeout_is_killed_and_the_server_serves_on(servers, tmp_path):
    with pytest.raises(subprocess.TimeoutExpired) as expired:
        servers.run("import time; time.sleep(60)", tmp_path, dict(os.environ), timeout=0.5)
    with pytest.raises(ProcessLookupError):
        os.kill(expired.value.pid, 0)  # killed and reaped
    assert servers.run("print(2)", tmp_path, dict(os.environ), timeout=60).stdout == "2\n"


def test_a_variable_read_at_import_gets_a_server_of_its_own(servers, tmp_path):
    def server_of(env):
        code = "import os; print(os.getppid(), os.environ.get('NUMBA_CACHE_DIR'))"
        return servers.run(code, tmp_path, env, timeout=60).stdout.split()

    base = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    first, _ = server_of(dict(base, TRACT_TEST_RUN="1"))
    again, _ = server_of(dict(base, TRACT_TEST_RUN="2"))  # a run's own variable: the same
    other, cache = server_of(dict(base, NUMBA_CACHE_DIR=str(tmp_path)))
    assert first == again != other and cache == str(tmp_path)
    pids = [int(first), int(other)]
    servers.close()
    for pid in pids:  # closed: no server stays behind
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
