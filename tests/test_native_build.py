"""The native build: the portable cache-control path builds and runs on x86
(behind TRACT_CACHECTL_PORTABLE), the C primitives copy exactly, and the
debug build switch works."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
NATIVE = ROOT / "tract" / "_native"
CC = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler")


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
def test_c_primitives_copy_exactly(tmp_path, portable):
    binary = tmp_path / "check"
    flags = ["-DTRACT_CACHECTL_PORTABLE"] if portable else []
    subprocess.run([CC, "-O2", "-Wall", "-Werror", "-std=c11", *flags, f"-I{NATIVE}",
                    str(ROOT / "tests" / "c" / "cachectl_check.c"), "-o", str(binary)],
                   check=True, capture_output=True, text=True)
    done = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith("ok portable" if portable else "ok ")


def _build_copy(tmp_path, env_extra):
    tree = tmp_path / "src"
    shutil.copytree(ROOT / "tract", tree / "tract",
                    ignore=shutil.ignore_patterns("*.so", "*.c", "*.html", "__pycache__"))
    shutil.copy(ROOT / "setup.py", tree)
    shutil.copy(ROOT / "pyproject.toml", tree)
    env = dict(os.environ, **env_extra)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree,
                   env=env, check=True, capture_output=True, text=True, timeout=600)
    return tree


@pytest.mark.slow
def test_portable_extension_builds_and_runs(tmp_path):
    tree = _build_copy(tmp_path, {"TRACT_CACHECTL_PORTABLE": "1"})
    script = (
        "import os, json, tract\n"
        "from tract.region import create_region\n"
        "info = tract.info()\n"
        "path = f'/dev/shm/tract-portable-{os.getpid()}'\n"
        "r = create_region(path, 1 << 22); os.unlink(path)\n"
        "data = bytes(range(256)) * 8193\n"
        "r.copy_in(3, data); r.flush(0, r.size); r.invalidate(0, r.size); r.fence()\n"
        "assert r.read(3, len(data)) == data\n"
        "print(json.dumps([info['build_path'], info['cache_control']['flush'], r.nontemporal]))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=tree, capture_output=True,
                          text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(tree)))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == '["portable", "none", "none"]'


@pytest.mark.slow
def test_debug_build_annotates_and_traces(tmp_path):
    tree = _build_copy(tmp_path, {"TRACT_DEBUG_BUILD": "1"})
    assert (tree / "tract" / "_native" / "_region.html").exists()
    assert "CYTHON_TRACE" in (tree / "tract" / "_native" / "_region.c").read_text()
