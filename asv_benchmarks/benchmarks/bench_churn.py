"""asv: tail latency under churn (`tract bench churn`): the p99 and p99.9
of store, load and take while writers, a reader, an evictor and a handoff
pair work at once, each divided by the same operation's p50 alone, measured
in the same run (one round of 1 s phases; the issue's targets are at most
3 and 10); and the control, a copy of the same bytes that touches no pool
(the machine's own tail under the same churn)."""

import numpy as np


class Churn:
    params = [["store", "load", "take", "copy"]]
    param_names = ["operation"]
    timeout = 600

    def setup_cache(self):
        from tract.bench.churn import measure

        measured = measure(rounds=1, seconds=1.0)
        return {op: (float(np.percentile(measured[op]["alone"], 50)),
                     float(np.percentile(measured[op]["churn"], 99)),
                     float(np.percentile(measured[op]["churn"], 99.9)))
                for op in ("store", "load", "take", "copy")}

    def track_p99_over_alone_p50(self, figures, operation):
        alone, p99, _ = figures[operation]
        return p99 / alone

    track_p99_over_alone_p50.unit = "x"

    def track_p999_over_alone_p50(self, figures, operation):
        alone, _, p999 = figures[operation]
        return p999 / alone

    track_p999_over_alone_p50.unit = "x"
