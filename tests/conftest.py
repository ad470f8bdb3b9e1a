import os
import uuid

import pytest

from tract.pool import Pool
from tract.region import create_region


@pytest.fixture
def pool_path():
    """A fresh path in /dev/shm, removed after the test."""
    path = f"/dev/shm/tract-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        Pool.destroy(path)  # with its node-local lock files, when it is a pool


@pytest.fixture
def region(pool_path):
    region = create_region(pool_path, 1 << 20)
    yield region
    region.close()


@pytest.fixture(autouse=True, scope="session")
def no_leaked_shared_memory():
    """Teardown asserts the suite left none of its pool files in /dev/shm
    (only this session's: other runs may share the machine)."""
    yield
    leaked = sorted(name for name in os.listdir("/dev/shm")
                    if name.startswith(f"tract-test-{os.getpid()}-"))
    assert not leaked, f"tests left {leaked} in /dev/shm"
