"""Build the Cython extensions of tract._native.

TRACT_DEBUG_BUILD=1 builds with Cython annotations (HTML next to each .pyx)
and line tracing, for coverage and profilers; TRACT_CACHECTL_PORTABLE=1
compiles the portable cache-control path instead of the x86 one.
"""

import os
from glob import glob

import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup

debug = os.environ.get("TRACT_DEBUG_BUILD") == "1"
macros = [("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]
if debug:
    macros += [("CYTHON_TRACE", "1"), ("CYTHON_TRACE_NOGIL", "1")]
if os.environ.get("TRACT_CACHECTL_PORTABLE") == "1":
    macros.append(("TRACT_CACHECTL_PORTABLE", "1"))

extensions = [
    Extension(
        "tract._native." + os.path.splitext(os.path.basename(source))[0],
        [source],
        include_dirs=["tract/_native", numpy.get_include()],
        define_macros=macros,
        extra_compile_args=["-O2"] + (["-g"] if debug else []),
    )
    for source in sorted(glob("tract/_native/*.pyx"))
]

setup(
    ext_modules=cythonize(
        extensions,
        language_level=3,
        annotate=debug,
        compiler_directives={"linetrace": debug, "embedsignature": True},
    ),
)
