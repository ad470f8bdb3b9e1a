"""asv: the non-coherent memory simulator (`tract bench incoherent`).

Measures one seeded mailbox run (two hosts, 8 messages) with and without
chaos; the per-operation cost bounds how many seeds CI can afford.
"""

from tract.testing import mailbox
from tract.testing.incoherent import SimPool


class MailboxRun:
    """A whole simulated run: scheduler hand-offs, queued flushes, chaos."""

    params = [0.0, 0.3]
    param_names = ["chaos"]

    def setup(self, chaos):
        self.ring = mailbox.Ring(2, 40)

    def _run(self, chaos):
        ring = self.ring
        pool = SimPool(ring.nbytes, hosts=2, seed=1, chaos=chaos)
        pool.run(lambda r: [mailbox.send(r, ring, s, bytes(40)) for s in range(8)],
                 lambda r: [mailbox.receive(r, ring, s) for s in range(8)])
        return pool

    def time_mailbox_run(self, chaos):
        self._run(chaos)

    def track_operations(self, chaos):
        return self._run(chaos).steps

    track_operations.unit = "operations"
