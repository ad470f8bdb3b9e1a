"""Private native layer (Cython).  Use the public modules of `tract` instead."""
