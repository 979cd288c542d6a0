"""Compiles the hot paths in rvz/_fast with Cython (see rvz/_fast/__init__.py).

Set RVZ_NO_EXTENSIONS=1 at build time to skip compiling; the package then runs in pure
Python, and rvz.implementation() says so.

Without Cython, numpy's headers or a working C compiler, the build warns and installs the
pure-Python package, which runs the same code more slowly.  RVZ_REQUIRE_EXTENSIONS=1 (CI
sets it) turns that fallback into a build failure, so a broken build is never silently slow.

The parameter-server example's table core (EXAMPLE_MODULES) is compiled only in place (an
editable install or ``build_ext --inplace``): it belongs to the source tree, not to a wheel.
"""

import os
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.sdist import sdist
from setuptools.errors import CCompilerError, ExecError, PlatformError

# What a missing or broken C toolchain raises (OSError: the compiler binary is not there).
BUILD_ERRORS = (CCompilerError, ExecError, PlatformError, OSError)

MODULES = ["keys", "table", "codec", "recvpool", "peers", "steps", "holding", "wire", "requests",
           "credit", "routes", "deadlines", "engine", "batches", "calls"]
EXAMPLE_MODULES = ["examples/param_server/_table.py"]  # the parameter server's table core


def _flag(name):
    return os.environ.get(name, "") not in ("", "0")


def _warn(text):
    # pip shows a backend's output only with -v or on failure; the import-time report
    # (rvz.implementation()) is what a user sees later.
    print(f"WARNING: rvz: {text}", file=sys.stderr, flush=True)


def _fallback(text):
    """A compiled module cannot be built: fail if required, else warn and go on."""
    if _flag("RVZ_REQUIRE_EXTENSIONS"):
        raise SystemExit(f"rvz: {text} (RVZ_REQUIRE_EXTENSIONS is set, so this is an error)")
    _warn(f"{text}; installing the pure-Python hot paths instead (slower, same behaviour)")


def extensions():
    """The modules to compile, from their Python/Cython sources (cythonized by BuildExt)."""
    if _flag("RVZ_NO_EXTENSIONS"):
        return []
    exts = [Extension(f"rvz._fast.{name}", [f"rvz/_fast/{name}.py"]) for name in MODULES]
    exts += [Extension(path[:-3].replace("/", "."), [path]) for path in EXAMPLE_MODULES
             if os.path.exists(path)]  # a checkout, not an sdist
    # The one module written as .pyx (raw pointers, numpy's C API); arrays.py is its twin.
    exts.append(Extension("rvz._fast.arrays", ["rvz/_fast/arrays.pyx"],
                          define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")]))
    return exts


class BuildExt(build_ext):
    """Cythonizes, then compiles what it can (see the module docstring)."""

    def finalize_options(self):
        super().finalize_options()
        if not self.parallel:  # one compiler per core, unless --parallel said otherwise
            self.parallel = os.cpu_count() or 1

    def run(self):
        if not self.inplace:  # a wheel: leave the example's module out
            for ext in self.extensions:
                stale = self.get_ext_fullpath(ext.name)
                if ext.name.startswith("examples.") and os.path.exists(stale):
                    # left in build/lib by an in-place build (setuptools builds there, then
                    # copies): bdist_wheel would ship it as a top-level "examples" package
                    os.remove(stale)
            self.extensions = [e for e in self.extensions if not e.name.startswith("examples.")]
        self.skipped = set()
        if not self.extensions:
            return
        try:
            import numpy
            from Cython.Build import cythonize
        except ImportError as exc:
            _fallback(f"cannot compile the hot paths without Cython and numpy ({exc})")
            self.extensions = []
            return
        for ext in self.extensions:
            if ext.name == "rvz._fast.arrays":
                ext.include_dirs.append(numpy.get_include())
        generated = cythonize(self.extensions, language_level=3, quiet=True,
                              nthreads=os.cpu_count() or 1,
                              compiler_directives={
                                  "boundscheck": False, "wraparound": False, "cdivision": True,
                                  "embedsignature": True, "annotation_typing": False})
        # Keep the Extension objects setuptools prepared; take only the generated C sources.
        sources = {ext.name: ext.sources for ext in generated}
        for ext in self.extensions:
            ext.sources = sources[ext.name]
        try:
            super().run()
        except BUILD_ERRORS as exc:  # no usable compiler at all
            if _flag("RVZ_REQUIRE_EXTENSIONS"):
                raise
            self.skipped.update(e.name for e in self.extensions)
            _fallback(f"cannot compile the hot paths: {exc}")

    def build_extension(self, ext):
        try:
            super().build_extension(ext)
        except BUILD_ERRORS as exc:
            if _flag("RVZ_REQUIRE_EXTENSIONS"):
                raise
            self.skipped.add(ext.name)
            _fallback(f"cannot compile {ext.name}: {exc}")

    def copy_extensions_to_source(self):
        # Copy only what was built: a skipped module leaves its pure-Python source in charge.
        self.extensions = [e for e in self.extensions if e.name not in self.skipped]
        super().copy_extensions_to_source()

    def get_outputs(self):
        return [path for path in super().get_outputs() if os.path.exists(path)]


class SDist(sdist):
    """An sdist without generated C or compiled modules, even when a previous in-place build
    left them in the tree (a stale .c would be newer than its source and not regenerated)."""

    def make_release_tree(self, base_dir, files):
        files = [f for f in files if not f.endswith((".c", ".so", ".pyd"))]
        super().make_release_tree(base_dir, files)


setup(ext_modules=extensions(), cmdclass={"build_ext": BuildExt, "sdist": SDist})
