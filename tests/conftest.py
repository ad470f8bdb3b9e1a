import os
import uuid

import pytest

from tract.region import create_region


@pytest.fixture
def pool_path():
    """A fresh path in /dev/shm, removed after the test."""
    path = f"/dev/shm/tract-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield path
    if os.path.exists(path):
        os.unlink(path)


@pytest.fixture
def region(pool_path):
    region = create_region(pool_path, 1 << 20)
    yield region
    region.close()
