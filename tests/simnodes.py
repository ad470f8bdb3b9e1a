"""Helpers shared by the simulated suites: a node's heartbeat thread."""


def heartbeat(pool, handles, finished, node, period):
    """A simulated thread that beats ``node``'s heartbeat every ``period``
    virtual seconds from when its handle exists until it finished."""
    def body(host):
        while node not in handles:
            pool.clock.sleep(period)
        while not finished[node]:
            handles[node].beat()  # through its own lease when it fences
            pool.clock.sleep(period)
    return body
