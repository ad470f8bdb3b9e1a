"""The one place kernel options are set (STYLE habit 10).

Kernels here take arrays, never raw addresses baked in as constants, so
caching them to disk is safe (a C-callable kernel takes its pointer as an
argument); ``TRACT_NUMBA_CACHE=0`` turns it off (read-only installs).
"""

import os

import numba

CACHE = os.environ.get("TRACT_NUMBA_CACHE", "1") != "0"


def kernel(function=None, *, inline: str = "never"):
    """Compile ``function`` as a tract kernel: nopython, no GIL, cached;
    ``inline="always"`` for the small helpers of a kernel."""
    if function is None:
        return lambda function: kernel(function, inline=inline)
    return numba.njit(cache=CACHE, nogil=True, inline=inline)(function)


def c_kernel(signature):
    """Compile a function as a C-callable tract kernel of ``signature``
    (its ``address`` is for native callers): nopython, cached."""
    return numba.cfunc(signature, cache=CACHE, nopython=True)
