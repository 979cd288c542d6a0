"""Every test runs on both event loops; the implementation is chosen per process.

``scripts/test`` runs the suite twice: once on the compiled hot paths and once with
``RVZ_NO_EXTENSIONS=1``.  ``RVZ_EXPECT_IMPL`` says which one must have loaded (see
test_implementation.py), so a build that silently fell back to Python fails.
"""

from __future__ import annotations

import asyncio
import os
import socket
from collections.abc import Callable, Coroutine
from typing import Any

import pytest

import rvz

LOOPS = ["asyncio", "uvloop"]


def expected_implementation() -> str:
    expected = os.environ.get("RVZ_EXPECT_IMPL")
    if expected:
        return expected
    return "python" if os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0") else "compiled"


def pytest_report_header(config: pytest.Config) -> str:
    return f"rvz implementation: {rvz.implementation()} (expected {expected_implementation()})"


@pytest.fixture(params=LOOPS)
def loop_name(request: pytest.FixtureRequest) -> str:
    return str(request.param)


Runner = Callable[..., Any]


@pytest.fixture
def run(loop_name: str) -> Runner:
    """``run(coro, timeout=30)``: run a coroutine on this test's loop, bounded in time."""

    def _run(coro: Coroutine[Any, Any, Any], timeout: float = 30.0) -> Any:
        async def bounded() -> Any:
            assert rvz.loop_name() == loop_name
            return await asyncio.wait_for(coro, timeout)

        return rvz.run(bounded(), loop=loop_name)

    return _run


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on loopback."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


@pytest.fixture
def cluster() -> rvz.ClusterSpec:
    """Two jobs on loopback: worker/0 and ps/0."""
    p = free_ports(2)
    return rvz.ClusterSpec({"worker": [f"127.0.0.1:{p[0]}"], "ps": [f"127.0.0.1:{p[1]}"]})


WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
PS = "/job:ps/replica:0/task:0/device:CPU:0"


def key(name: str = "t", src: str = WORKER, dst: str = PS, **kw: Any) -> rvz.Key:
    return rvz.Key(src=src, dst=dst, name=name, **kw)
