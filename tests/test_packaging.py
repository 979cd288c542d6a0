"""Packaging: setup.py falls back to pure Python when a module cannot be compiled (and
refuses to when RVZ_REQUIRE_EXTENSIONS=1), leaves the example's module out of wheels, and
pyproject.toml states what the README promises (license, Python versions, no generated C in
wheels), and that an sdist holds what a build needs and no build artefacts, tests or
examples.  CI builds a real wheel and lists it (.ci/run); these tests stay offline and fast.

setup.py's own ``setup()`` call is intercepted, and its build_ext command is run on one
small module (rvz/_fast/keys.py) in a copy of the tree, with ``CC=false`` standing for a
machine without a working C compiler.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

# An example or a program, which the choice of hot paths does not change: scripts/test
# runs these in its compiled leg only.
pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parent.parent

DRIVER = textwrap.dedent("""
    import sys
    import setuptools

    captured = {}
    setuptools.setup = lambda **kw: captured.update(kw)
    exec(compile(open("setup.py").read(), "setup.py", "exec"), {"__name__": "__main__"})

    from setuptools import Distribution, Extension

    inplace = sys.argv[1] == "inplace"
    exts = [Extension("rvz._fast.keys", ["rvz/_fast/keys.py"]),
            Extension("examples.param_server._table", ["examples/param_server/_table.py"])]
    dist = Distribution({"ext_modules": exts, "cmdclass": captured["cmdclass"]})
    cmd = dist.get_command_obj("build_ext")
    cmd.inplace = inplace
    cmd.ensure_finalized()
    print("building:", sorted(e.name for e in cmd.extensions), flush=True)
    cmd.run()
    print("skipped:", sorted(cmd.skipped), flush=True)
""")


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    pytest.importorskip("Cython", reason="Cython is in the test extra")
    pytest.importorskip("setuptools", reason="setuptools is in the test extra")
    (tmp_path / "rvz" / "_fast").mkdir(parents=True)
    (tmp_path / "examples" / "param_server").mkdir(parents=True)
    shutil.copy2(ROOT / "setup.py", tmp_path)
    for name in ("keys.py", "keys.pxd", "__init__.py"):
        shutil.copy2(ROOT / "rvz" / "_fast" / name, tmp_path / "rvz" / "_fast")
    (tmp_path / "rvz" / "__init__.py").write_text("")  # Cython names modules by package
    # a stand-in for the example's module: it must not be compiled for a wheel
    (tmp_path / "examples" / "param_server" / "_table.py").write_text("X = 1\n")
    (tmp_path / "driver.py").write_text(DRIVER)
    return tmp_path


def build(tree: Path, mode: str, **env: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items()
            if k not in ("RVZ_NO_EXTENSIONS", "RVZ_REQUIRE_EXTENSIONS")}
    full.update(CC="false", **env)  # a C compiler that always fails
    return subprocess.run([sys.executable, "driver.py", mode], cwd=tree, env=full,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.timeout(150)
def test_no_compiler_falls_back_to_pure_python_with_a_warning(tree: Path) -> None:
    proc = build(tree, "inplace")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "building: ['examples.param_server._table', 'rvz._fast.keys']" in proc.stdout
    assert "skipped: ['examples.param_server._table', 'rvz._fast.keys']" in proc.stdout
    assert re.search(r"WARNING: rvz: cannot compile rvz\._fast\.keys: .*pure-Python", proc.stderr)
    assert not list(tree.rglob("*.so")), "a module was copied in place though it failed"


@pytest.mark.timeout(150)
def test_required_extensions_make_a_failed_compile_an_error(tree: Path) -> None:
    proc = build(tree, "inplace", RVZ_REQUIRE_EXTENSIONS="1")
    assert proc.returncode != 0
    assert "WARNING: rvz" not in proc.stderr


@pytest.mark.timeout(150)
def test_a_wheel_build_leaves_the_example_out(tree: Path) -> None:
    proc = build(tree, "wheel")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped: ['rvz._fast.keys']" in proc.stdout  # the example was not even tried
    assert "_table" not in proc.stderr


def test_no_extensions_asked_for_means_none_listed(tree: Path) -> None:
    code = ("import setuptools\nc = {}\nsetuptools.setup = lambda **kw: c.update(kw)\n"
            "exec(open('setup.py').read(), {'__name__': '__main__'})\n"
            "print(sorted(e.name for e in c['ext_modules']))\n")
    listed = {}
    for value in ("1", "0"):
        env = dict(os.environ, RVZ_NO_EXTENSIONS=value)
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        listed[value] = out.stdout.strip()
    assert listed["1"] == "[]"
    for name in ("rvz._fast.keys", "rvz._fast.engine", "rvz._fast.arrays",
                 "examples.param_server._table"):
        assert f"'{name}'" in listed["0"]


def pyproject() -> dict:
    tomllib = pytest.importorskip("tomllib", reason="tomllib is in Python 3.11+")
    with open(ROOT / "pyproject.toml", "rb") as f:
        return dict(tomllib.load(f))


def test_pyproject_states_the_support_matrix() -> None:
    project = pyproject()["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX string: no deprecated TOML table
    classifiers = project["classifiers"]
    versions = [c.rsplit(" ", 1)[1] for c in classifiers
                if re.fullmatch(r"Programming Language :: Python :: 3\.\d+", c)]
    assert versions == ["3.10", "3.11", "3.12", "3.13"]
    assert project["requires-python"] == f">={versions[0]}"
    assert "Operating System :: POSIX :: Linux" in classifiers
    assert not [c for c in classifiers if c.startswith("License ::")]  # not with an SPDX license
    assert "pdoc" in " ".join(project["optional-dependencies"]["docs"])
    assert "pytest-asyncio" in " ".join(project["optional-dependencies"]["test"])


def test_wheels_get_no_generated_c() -> None:
    config = pyproject()
    setuptools_cfg = config["tool"]["setuptools"]
    assert setuptools_cfg["include-package-data"] is False
    data = [p for patterns in setuptools_cfg["package-data"].values() for p in patterns]
    assert not [p for p in data if p.endswith((".c", ".pyx", "*"))], data
    requires = " ".join(config["build-system"]["requires"])
    found = re.search(r"setuptools>=(\d+)", requires)
    assert found and int(found.group(1)) >= 77, requires  # SPDX license strings


STALE_DRIVER = DRIVER.replace(
    'print("building:"',
    "import os\n"
    'stale = cmd.get_ext_fullpath("examples.param_server._table")\n'
    "os.makedirs(os.path.dirname(stale), exist_ok=True)\n"
    'open(stale, "wb").close()  # what an earlier in-place build leaves in build/lib\n'
    'print("building:"') + 'print("stale example left:", os.path.exists(stale), flush=True)\n'


def test_a_wheel_build_drops_the_example_module_an_inplace_build_left(tree: Path) -> None:
    # setuptools builds in place by building into build/lib and copying; a later wheel build
    # reuses build/lib, and shipped examples/param_server/_table.*.so as a top-level package
    (tree / "driver.py").write_text(STALE_DRIVER)
    proc = build(tree, "wheel")
    assert "stale example left: False" in proc.stdout, proc.stdout + proc.stderr[-2000:]


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             timeout=30, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("needs a git checkout")
    return [name for name in out.decode().split("\0") if name]


@pytest.mark.timeout(150)
def test_sdist_has_what_a_build_needs_and_nothing_else(tmp_path: Path) -> None:
    pytest.importorskip("setuptools", reason="setuptools is in the test extra")
    tree = tmp_path / "tree"
    for name in _tracked_files():
        if (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    # what a previous in-place build and test run leave in a checkout
    (tree / "rvz" / "_fast" / "keys.c").write_text("/* generated */\n")
    (tree / "rvz" / "_fast" / "keys.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\0")
    (tree / "rvz" / "__pycache__").mkdir()
    (tree / "rvz" / "__pycache__" / "node.cpython-311.pyc").write_bytes(b"\0")
    proc = subprocess.run([sys.executable, "setup.py", "-q", "sdist", "-d", str(tmp_path / "dist")],
                          cwd=tree, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    import tarfile

    (sdist,) = (tmp_path / "dist").glob("rvz-*.tar.gz")
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    sources = {name for name in _tracked_files()
               if name.startswith("rvz/") and name.endswith((".py", ".pxd", ".pyx", ".typed"))}
    needed = sources | {"setup.py", "pyproject.toml", "README.md", "LICENSE", "CHANGELOG.md"}
    assert not needed - names, f"missing from the sdist: {sorted(needed - names)}"
    junk = [n for n in names if n.endswith((".c", ".so", ".pyc")) or "__pycache__" in n
            or n.startswith(("build/", "tests/", "examples/", ".venv"))]
    assert not junk, f"not for an sdist: {sorted(junk)}"
