"""`tract bench incoherent`: what a simulated memory operation costs.

The simulator is what the protocol suites run under, hundreds of seeds each,
so its cost per operation bounds how many interleavings CI can afford.  The
baseline is the same mailbox protocol on a native mapping, run from one
thread (send, then receive), measured in the same run: the ratio is the
simulator's slowdown, as native/simulated time per operation.
"""

from __future__ import annotations

import time

from tract.bench import Result
from tract.region import scratch_region
from tract.testing import mailbox
from tract.testing.incoherent import SimPool


def _payload(seq: int) -> bytes:
    return seq.to_bytes(8, "little") * 5


def run(quick: bool = False) -> list[Result]:
    messages, seeds = (8, 5) if quick else (8, 40)
    ring = mailbox.Ring(2, 40)
    simulated_ops, simulated_seconds = 0, 0.0
    for seed in range(seeds):
        pool = SimPool(ring.nbytes, hosts=2, seed=seed, chaos=0.3)
        start = time.perf_counter()
        pool.run(lambda r: [mailbox.send(r, ring, s, _payload(s)) for s in range(messages)],
                 lambda r: [mailbox.receive(r, ring, s) for s in range(messages)])
        simulated_seconds += time.perf_counter() - start
        simulated_ops += pool.steps
    # One native send + receive touches the same lines once each, with no
    # polling: count the same operations the simulator counts for it.
    single = SimPool(ring.nbytes, hosts=1, chaos=0)
    mailbox.send(single.hosts[0], ring, 0, _payload(0))
    mailbox.receive(single.hosts[0], ring, 0)
    ops_per_message = single.steps
    region = scratch_region(ring.nbytes, name="bench-incoherent")
    rounds = 200 if quick else 2000
    start = time.perf_counter()
    for seq in range(rounds):
        mailbox.send(region, ring, seq, _payload(seq))
        mailbox.receive(region, ring, seq)
    native = (time.perf_counter() - start) / (rounds * ops_per_message)
    region.close()
    per_op = simulated_seconds / simulated_ops
    return [Result("simulated_operation", per_op * 1e6, "us per operation", False,
                   "native_operation", native * 1e6)]
