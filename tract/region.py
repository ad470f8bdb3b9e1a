"""Mapping a pool: a regular file (tmpfs, hugetlbfs, any filesystem) or a
device-DAX character device, shared and read-write.

Rules relied on (DESIGN.md): R1 — each process maps the pool at its own
address, so everything else names memory by offset; the returned `Region`
checks every offset and length before touching memory.  The instruction
choice for R3/R4 is fixed here, when the pool is mapped
(`tract.platform.cache_control`).

Device DAX (``/dev/daxX.Y``): the size comes from
``/sys/bus/dax/devices/daxX.Y/size``, the mapping alignment from ``align``
(2 MiB when sysfs does not say); the mapped size and offset must be multiples
of it; only MAP_SHARED works.  Each broken rule is a `DaxError` that names it.
"""

from __future__ import annotations

import errno
import grp
import os
import stat
import tempfile
import uuid
from pathlib import Path

from tract import platform
from tract._native._region import Region, map_fd
from tract.errors import ConfigError, DaxError

__all__ = ["Region", "create_region", "is_dax_path", "open_region", "scratch_region"]

DEFAULT_DAX_ALIGN = 2 << 20


def is_dax_path(path: str | os.PathLike) -> bool:
    """Whether a path is named like a device-DAX instance (``daxX.Y``)."""
    return platform._DAX_NAME.match(Path(path).name) is not None


def create_region(path: str | os.PathLike, size: int, *, mode: int = 0o600,
                  group: str | int | None = None, flush: str | None = None,
                  coherence: str = "none", populate: bool = False) -> Region:
    """Create a pool file of exactly ``size`` bytes and map it.

    Parameters
    ----------
    path : path-like
        A new file; an existing one is refused (``FileExistsError``).
    size : int
        Bytes, > 0.  The space is reserved now (``posix_fallocate``) so a
        full tmpfs fails here rather than with SIGBUS later.
    mode : int
        Permission bits, applied exactly (the umask does not apply).
    group : str or int, optional
        Group to own the file, for pools shared by several users.
    flush, coherence, populate
        See `open_region`.
    """
    path = os.fspath(path)
    _check_size(size, path)
    if not 0 <= mode <= 0o7777:
        raise ConfigError(f"mode {mode:#o} for {path!r} is not a permission mode")
    if is_dax_path(path):
        raise ConfigError(f"{path!r} is a device-DAX path: devices are not created, open them "
                          f"with open_region")
    gid = _group_id(group) if group is not None else -1
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, mode)
    try:
        os.fchmod(fd, mode)
        if gid != -1:
            os.fchown(fd, -1, gid)
        _reserve(fd, size, path)
        return map_fd(fd, size, 0, path, "file",
                      platform.cache_control(flush, coherence), populate)
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def scratch_region(size: int, *, name: str = "scratch", **options) -> Region:
    """A private pool of ``size`` bytes in /dev/shm (or the temp directory),
    unlinked at once: it lives as long as the mapping.  For benchmarks and
    single-process tests; ``options`` go to `create_region`."""
    directory = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    path = os.path.join(directory, f"tract-{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    region = create_region(path, size, **options)
    os.unlink(path)
    return region


def open_region(path: str | os.PathLike, *, size: int | None = None, offset: int = 0,
                flush: str | None = None, coherence: str = "none", populate: bool = False,
                sysfs: str = "/sys") -> Region:
    """Map an existing pool file or device-DAX instance.

    Parameters
    ----------
    path : path-like
        A regular file, or ``/dev/daxX.Y``.
    size : int, optional
        For a file: the size the caller expects; a file of another size is
        refused.  For a DAX device: bytes to map from ``offset`` (default: the
        rest of the device).
    offset : int
        DAX only: where the mapping starts, aligned to the device alignment.
    flush : {"clflush", "clflushopt", "clwb"}, optional
        Flush instruction for this pool; default: the process choice.
    coherence : {"none", "hardware"}
        ``"none"`` (default) runs the flush discipline; ``"hardware"`` skips it.
    populate : bool
        Fault every page in now (MAP_POPULATE).
    """
    path = os.fspath(path)
    control = platform.cache_control(flush, coherence)
    if is_dax_path(path) or _is_char_device(path):
        return _open_dax(path, size, offset, control, populate, sysfs)
    if offset:
        raise ConfigError(f"offset {offset} given for {path!r}: only DAX devices take an offset")
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ConfigError(f"{path!r} is neither a regular file nor a device-DAX instance")
        if size is not None and st.st_size != size:
            raise ConfigError(f"pool file {path!r} has {st.st_size} bytes, expected {size}")
        _check_size(st.st_size, path)
        return map_fd(fd, st.st_size, 0, path, "file", control, populate)
    finally:
        os.close(fd)


def _check_size(size: int, path: str) -> None:
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise ConfigError(f"size of {path!r} must be a positive number of bytes, got {size!r}")


def _group_id(group: str | int) -> int:
    if isinstance(group, int):
        return group
    try:
        return grp.getgrnam(group).gr_gid
    except KeyError:
        raise ConfigError(f"group {group!r} does not exist") from None


def _reserve(fd: int, size: int, path: str) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as error:
        if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENODEV):
            raise OSError(error.errno, f"reserving {size} bytes for {path!r} failed: "
                                       f"{error.strerror}", path) from None
        os.ftruncate(fd, size)


def _is_char_device(path: str) -> bool:
    try:
        return stat.S_ISCHR(os.stat(path).st_mode)
    except OSError:
        return False


def _open_dax(path: str, size: int | None, offset: int, control, populate: bool,
              sysfs: str) -> Region:
    name = Path(path).name
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise DaxError(errno.ENOENT, f"DAX device {path!r} does not exist", path) from None
    except PermissionError:
        raise DaxError(errno.EACCES, f"no permission to reach {path!r}: a directory on the way "
                                     f"is not searchable by this user", path) from None
    if not stat.S_ISCHR(st.st_mode):
        raise DaxError(errno.ENODEV, f"{path!r} is not a character device: device DAX is "
                                     f"mapped through /dev/daxX.Y", path)
    if not platform._DAX_NAME.match(name):
        raise DaxError(errno.ENODEV, f"character device {path!r} is not named daxX.Y", path)
    entry = Path(sysfs, "bus/dax/devices", name)
    if not entry.is_dir():
        raise DaxError(errno.ENODEV, f"{path!r} has no sysfs entry {entry}: it is not a "
                                     f"device-DAX instance (is it bound to device_dax?)", path)
    device_size = _sysfs_int(entry / "size", path)
    if device_size is None or device_size <= 0:
        raise DaxError(errno.ENODEV, f"{entry / 'size'} gives no size for {path!r}", path)
    align = _sysfs_int(entry / "align", path) or DEFAULT_DAX_ALIGN
    if offset < 0 or offset % align:
        raise DaxError(errno.EINVAL, f"offset {offset} into {path!r} is not a multiple of "
                                     f"the device alignment {align}", path)
    if size is None:
        size = device_size - offset
    _check_size(size, path)
    if size % align:
        raise DaxError(errno.EINVAL, f"size {size} for {path!r} is not a multiple of the "
                                     f"device alignment {align}", path)
    if offset + size > device_size:
        raise DaxError(errno.EINVAL, f"offset {offset} + size {size} exceeds {path!r} of "
                                     f"{device_size} bytes", path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except PermissionError:
        raise DaxError(errno.EACCES, f"no permission to open {path!r} read-write: the "
                                     f"process needs rw on the device node", path) from None
    try:
        return map_fd(fd, size, offset, path, "devdax", control, populate)
    except OSError as error:
        raise DaxError(error.errno, f"{error.strerror} (device DAX maps MAP_SHARED only, "
                                    f"at multiples of {align})", path) from None
    finally:
        os.close(fd)


def _sysfs_int(path: Path, device: str) -> int | None:
    try:
        text = path.read_text().strip()
    except FileNotFoundError:
        return None
    try:
        return int(text, 0)
    except ValueError:
        raise DaxError(errno.EINVAL, f"{path} holds {text!r}, not a number, for {device!r}",
                       device) from None
