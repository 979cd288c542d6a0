"""``rvz.options.Options``: the checked options of a node."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import rvz
from rvz.options import Options
from rvz.types import NodeOptions

from .conftest import in_loop


@in_loop
def test_options_node_options_and_the_node_name_the_same_options() -> None:
    """Three lists of one set of names: the checked options, the keywords ``from_env``
    types, and ``Node``'s keyword arguments."""
    checked = {f.name for f in dataclasses.fields(Options) if f.init}
    node = set(inspect.signature(rvz.Node).parameters) - {"cluster", "job", "task"}
    assert checked == set(NodeOptions.__annotations__) == node


@in_loop
def test_the_secret_is_the_key_and_never_printed() -> None:
    cluster = rvz.ClusterSpec.loopback({"worker": 1})
    node = rvz.Node(cluster, "worker", 0, secret="k" * 16)
    assert node._handshake.has_secret
    defaults = {name: p.default for name, p in inspect.signature(rvz.Node).parameters.items()
                if name not in ("cluster", "job", "task")}
    options = Options(**{**defaults, "secret": "s3cr3t-" * 4})
    assert options.secret == b"s3cr3t-" * 4
    assert "s3cr3t" not in repr(options)


@pytest.mark.parametrize(("option", "value", "match"), [
    ("push_window", -1, "push_window must be a number of bytes"),
    ("step_idle", -1.0, "step_idle must be >= 0 seconds"),
    ("incarnation", 1 << 64, "incarnation must be an int"),
    ("tls_identity", True, "tls_identity needs mutual TLS"),
])
@in_loop
def test_a_bad_option_fails_naming_it(option: str, value: object, match: str) -> None:
    with pytest.raises(rvz.ConfigError, match=match):
        rvz.Node(rvz.ClusterSpec.loopback({"worker": 1}), "worker", 0, **{option: value})
