"""Private Numba kernels.  Each is small and pure, behind a wrapper that
checks its inputs; its plain-Python twin in tests/naive.py is the
specification.  Kernel options come from `tract._kernels.config`."""
