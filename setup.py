"""Compiles the hot paths in rvz/_fast with Cython (see rvz/_fast/__init__.py).

Set RVZ_NO_EXTENSIONS=1 at build time to skip compiling; the package then runs in pure
Python, and rvz.implementation() says so.
"""

import os

from setuptools import Extension, setup

MODULES = ["keys", "table", "codec", "recvpool", "engine"]


def extensions():
    if os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0"):
        return []
    from Cython.Build import cythonize

    import numpy

    exts = [Extension(f"rvz._fast.{name}", [f"rvz/_fast/{name}.py"]) for name in MODULES]
    # The one module written as .pyx (raw pointers, numpy's C API); arrays.py is its twin.
    exts.append(Extension("rvz._fast.arrays", ["rvz/_fast/arrays.pyx"],
                          include_dirs=[numpy.get_include()],
                          define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]))
    return cythonize(exts, language_level=3, compiler_directives={
        "boundscheck": False, "wraparound": False, "cdivision": True,
        "embedsignature": True, "annotation_typing": False,
    })


setup(ext_modules=extensions())
