"""asv: the two-tier lock (`tract bench lock`), every mode, against a
process-shared pthread mutex and an fcntl lock.

Uncontended acquire + release is timed in one process (manager mode with
its manager in another process, as `tract manager` runs it); contended
throughput comes from 2 or 4 processes over 1, 2 or 4 node ids.
"""

import fcntl
import tempfile

from tract._native._localmutex import LocalMutex
from tract.bench import lock as bench
from tract.pool import Pool
from tract.region import scratch_region


class UncontendedLock:
    """One acquire + release with nobody else asking."""

    params = ["manager", "bakery", "atomic", "pthread_mutex", "fcntl_lock"]
    param_names = ["mode"]

    def setup(self, mode):
        self.cleanup = []
        if mode == "pthread_mutex":
            region = scratch_region(4096, name="asv-lock", coherence="hardware")
            mutex = LocalMutex(region, 0)
            mutex.initialize()
            self.cleanup.append(region.close)
            self.acquire, self.release = mutex.acquire, mutex.release
        elif mode == "fcntl_lock":
            handle = tempfile.TemporaryFile()
            self.cleanup.append(handle.close)
            self.acquire = lambda: fcntl.lockf(handle, fcntl.LOCK_EX)
            self.release = lambda: fcntl.lockf(handle, fcntl.LOCK_UN)
        else:
            path = bench._create(mode)
            self.cleanup.append(lambda: Pool.destroy(path))
            if mode == "manager":
                context = bench.multiprocessing.get_context("fork")
                stop = context.Event()
                manager = context.Process(target=bench.manage_locks, args=(path, stop))
                manager.start()
                self.cleanup.insert(0, lambda: (stop.set(), manager.join(30)))
            pool = Pool.open(path, 0)
            self.cleanup.insert(0, pool.close)
            lock = pool.lock("alloc")
            with lock(timeout=30):
                pass
            self.acquire, self.release = lock.acquire, lock.release

    def teardown(self, mode):
        for step in self.cleanup:
            step()

    def time_acquire_release(self, mode):
        self.acquire()
        self.release()


class ContendedLock:
    """Acquisitions per second of several processes bumping one counter."""

    params = (["manager", "bakery", "atomic"], [(2, 1), (2, 2), (4, 2)])
    param_names = ["mode", "processes_nodes"]
    timeout = 120

    def setup(self, mode, processes_nodes):
        self.path = bench._create(mode)

    def teardown(self, mode, processes_nodes):
        Pool.destroy(self.path)

    def track_throughput(self, mode, processes_nodes):
        processes, nodes = processes_nodes
        placement = [index % nodes for index in range(processes)]
        return bench._with_manager(mode, self.path, lambda: bench._contended(
            bench._tract_worker, self.path, placement, 0.3))

    track_throughput.unit = "acquisitions/s"
