"""The compiled hot paths must load when expected: no silent fallback to Python."""

import os

import rvz
from rvz import _impl

from .conftest import expected_implementation


def test_expected_implementation_loaded() -> None:
    assert rvz.implementation() == expected_implementation(), (
        f"expected the {expected_implementation()} hot paths, but {rvz.implementation()} loaded "
        f"(keys from {_impl.keys.__file__})")


def test_every_hot_module_is_of_the_active_kind() -> None:
    compiled = rvz.implementation() == "compiled"
    for name in _impl.MODULES:
        module = getattr(_impl, name)
        assert module.__file__.endswith(".py") != compiled, module.__file__


def test_switch_is_read_from_the_environment() -> None:
    forced = os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0")
    assert _impl._forced_python() == forced


def test_both_variants_load_side_by_side() -> None:
    python = _impl.load("python")
    assert python.keys.__file__.endswith(".py")
    assert python.codec.Decoder is not None
    if expected_implementation() == "compiled":
        compiled = _impl.load("compiled")
        assert not compiled.codec.__file__.endswith(".py")
        # same behaviour on both: a key formats identically
        a = compiled.keys.Key("/job:a/task:0", "/job:b/task:1", "x", 1, 2, 3)
        b = python.keys.Key("/job:a/task:0", "/job:b/task:1", "x", 1, 2, 3)
        assert str(a) == str(b)
