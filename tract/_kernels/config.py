"""The one place kernel options are set (STYLE habit 10).

Kernels here take arrays, never raw addresses baked in as constants, so
caching them to disk is safe (a C-callable kernel takes its pointer as an
argument); ``TRACT_NUMBA_CACHE=0`` turns it off (read-only installs).
"""

import os

import numba

CACHE = os.environ.get("TRACT_NUMBA_CACHE", "1") != "0"


def kernel(function):
    """Compile ``function`` as a tract kernel: nopython, no GIL, cached."""
    return numba.njit(cache=CACHE, nogil=True)(function)


def c_kernel(signature):
    """Compile a function as a C-callable tract kernel of ``signature``
    (its ``address`` is for native callers): nopython, cached."""
    return numba.cfunc(signature, cache=CACHE, nopython=True)
