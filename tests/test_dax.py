"""Device-DAX validation: every broken rule is a DaxError that names it.

No DAX device exists here, so the device node is a character device made with
mknod (the numbers of /dev/null) and sysfs is a fake tree; the last step,
mmap, then fails as a real non-DAX device would.
"""

import errno
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tract.errors import DaxError
from tract.region import is_dax_path, open_region

MIB = 1 << 20


@pytest.fixture
def dax():
    """(device path, sysfs root, sysfs entry) for a fake dax9.0 of 64 MiB, in
    a tree any user may search."""
    root = Path(tempfile.mkdtemp(dir="/dev/shm", prefix="tract-test-dax-"))
    os.chmod(root, 0o755)
    try:
        yield _make_dax(root)
    finally:
        shutil.rmtree(root)


def _make_dax(tmp_path):
    null = os.stat("/dev/null").st_rdev
    device = tmp_path / "dev" / "dax9.0"
    device.parent.mkdir()
    try:
        os.mknod(device, 0o600 | stat.S_IFCHR, null)
    except PermissionError:
        pytest.skip("mknod needs root")
    sysfs = tmp_path / "sys"
    entry = sysfs / "bus/dax/devices/dax9.0"
    entry.mkdir(parents=True)
    (entry / "size").write_text(f"{64 * MIB}\n")
    (entry / "align").write_text(f"{2 * MIB}\n")
    return str(device), str(sysfs), entry


def _refused(path, sysfs, match, code, **kwargs):
    with pytest.raises(DaxError, match=match) as error:
        open_region(path, sysfs=sysfs, **kwargs)
    assert error.value.errno == code
    assert isinstance(error.value, OSError)
    return error.value


def test_missing_device(tmp_path):
    _refused(str(tmp_path / "dax0.0"), str(tmp_path), "does not exist", errno.ENOENT)


def test_regular_file_named_like_a_device(tmp_path):
    path = tmp_path / "dax0.0"
    path.write_bytes(b"\0" * 4096)
    _refused(str(path), str(tmp_path), "is not a character device", errno.ENODEV)


def test_character_device_with_another_name(tmp_path):
    _refused("/dev/null", str(tmp_path), "is not named daxX.Y", errno.ENODEV)


def test_no_sysfs_entry(dax, tmp_path):
    path, _, _ = dax
    _refused(path, str(tmp_path / "empty"), "has no sysfs entry", errno.ENODEV)


def test_sysfs_without_size(dax):
    path, sysfs, entry = dax
    (entry / "size").unlink()
    _refused(path, sysfs, "gives no size", errno.ENODEV)


def test_sysfs_size_not_a_number(dax):
    path, sysfs, entry = dax
    (entry / "size").write_text("lots\n")
    _refused(path, sysfs, "holds 'lots', not a number", errno.EINVAL)


def test_offset_not_aligned(dax):
    path, sysfs, _ = dax
    _refused(path, sysfs, "offset 4096 .* not a multiple of the device alignment 2097152",
             errno.EINVAL, offset=4096)


def test_size_not_aligned(dax):
    path, sysfs, _ = dax
    _refused(path, sysfs, "size 3145728 .* not a multiple of the device alignment",
             errno.EINVAL, size=3 * MIB)


def test_alignment_defaults_to_2mib_without_sysfs_align(dax):
    path, sysfs, entry = dax
    (entry / "align").unlink()
    _refused(path, sysfs, "alignment 2097152", errno.EINVAL, size=MIB)


def test_range_beyond_the_device(dax):
    path, sysfs, _ = dax
    _refused(path, sysfs, "exceeds .* of 67108864 bytes", errno.EINVAL,
             offset=32 * MIB, size=64 * MIB)


def test_mmap_failure_names_the_rule(dax):
    path, sysfs, _ = dax
    error = _refused(path, sysfs, "MAP_SHARED only", errno.ENODEV)
    assert "mmap of 67108864 bytes" in str(error)


@pytest.mark.parametrize("reachable", [True, False])
def test_no_permission(dax, reachable):
    path, sysfs, _ = dax
    if os.geteuid() != 0:
        pytest.skip("needs root to drop privileges")
    # The device node is 0600 root; its directory is searchable or not.
    os.chmod(os.path.dirname(path), 0o755 if reachable else 0o700)
    script = (
        "import os, sys\n"
        "from tract.errors import DaxError\n"
        "from tract.region import open_region\n"
        "os.setgid(65534); os.setuid(65534)\n"
        "try:\n"
        "    open_region(sys.argv[1], sysfs=sys.argv[2])\n"
        "except DaxError as error:\n"
        "    print(error.errno, error)\n"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    done = subprocess.run([sys.executable, "-c", script, path, sysfs], capture_output=True,
                          text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"{errno.EACCES} ")
    if reachable:
        assert "no permission to open" in done.stdout and "read-write" in done.stdout
    else:
        assert "no permission to reach" in done.stdout


def test_is_dax_path():
    assert is_dax_path("/dev/dax0.0") and is_dax_path("/dev/dax12.3")
    assert not is_dax_path("/dev/shm/pool") and not is_dax_path("/dev/daxa.0")
