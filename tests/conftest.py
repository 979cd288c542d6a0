"""Every test runs on both event loops; the implementation is chosen per process.

``scripts/test`` runs the suite twice: once on the compiled hot paths and once with
``RVZ_NO_EXTENSIONS=1``.  ``RVZ_EXPECT_IMPL`` says which one must have loaded (see
test_implementation.py), so a build that silently fell back to Python fails.

``async def test_...`` functions are run by pytest-asyncio (``asyncio_mode = "auto"``), once
on each loop of ``LOOPS``: the ``pytest_asyncio_loop_factories`` hook below gives the loops
(``@pytest.mark.asyncio(loop_factories=["uvloop"])`` picks one).  Each such test first checks
that it runs on the loop it was given, and its coroutine is bounded by
``@pytest.mark.loop_timeout(seconds)`` (default ``LOOP_TIMEOUT``), as ``run`` bounds its
coroutine; pytest-timeout still bounds the whole test.  Synchronous tests that need a loop
use the ``run`` fixture, which is parametrized over ``LOOPS`` by ``loop_name``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import socket
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any

import pytest
import pytest_asyncio

import rvz
import rvz.onesided

from .hostile import HEADER

LOOPS = ["asyncio", "uvloop"]


def expected_implementation() -> str:
    expected = os.environ.get("RVZ_EXPECT_IMPL")
    if expected:
        return expected
    return "python" if os.environ.get("RVZ_NO_EXTENSIONS", "") not in ("", "0") else "compiled"


def pytest_report_header(config: pytest.Config) -> str:
    return f"rvz implementation: {rvz.implementation()} (expected {expected_implementation()})"


# -- async tests (pytest-asyncio) ---------------------------------------------------------

# How long an async test's coroutine may run on its loop unless marked: what ``run`` gives.
LOOP_TIMEOUT = 30.0

# The name each loop was made under, so a test can check it runs on the loop it was given.
_given_loops: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, str] = weakref.WeakKeyDictionary()


def _loop_factory(name: str) -> Callable[[], asyncio.AbstractEventLoop]:
    def new_loop() -> asyncio.AbstractEventLoop:
        loop = rvz.new_event_loop(name)  # type: ignore[arg-type]
        _given_loops[loop] = name
        return loop

    return new_loop


LOOP_FACTORIES = {name: _loop_factory(name) for name in LOOPS}


def pytest_asyncio_loop_factories(config: pytest.Config,
                                  item: pytest.Item) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    """Every async test runs once per loop; its id names the loop, like ``loop_name``'s."""
    return LOOP_FACTORIES


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "loop_timeout(seconds): bound on an async test's coroutine, "
                                       f"TimeoutError after it (default {LOOP_TIMEOUT:g} s)")
    config.addinivalue_line("markers", "process: runs a program (an example, rvz-bench, the build) "
                                       "whose behaviour the hot paths' implementation does not "
                                       "change; scripts/test runs these in the compiled leg only")


def _on_given_loop(test: Callable[..., Coroutine[Any, Any, None]],
                   seconds: float) -> Callable[..., Coroutine[Any, Any, None]]:
    @functools.wraps(test)
    async def bounded(**kwargs: Any) -> None:
        given = _given_loops.get(asyncio.get_running_loop())
        assert given is not None, "the test's loop was not made by pytest_asyncio_loop_factories"
        assert rvz.loop_name() == given, f"runs on {rvz.loop_name()}, was given {given}"
        await asyncio.wait_for(test(**kwargs), seconds)

    return bounded


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if pytest_asyncio.is_async_test(item):
            marker = item.get_closest_marker("loop_timeout")
            seconds = float(marker.args[0]) if marker else LOOP_TIMEOUT
            item.obj = _on_given_loop(item.obj, seconds)


# Every socket object this process makes (accept(), fromfd and ssl's too: all run
# socket.socket.__init__), so that the check below need not walk every object there is.
_sockets: weakref.WeakSet[socket.socket] = weakref.WeakSet()
_socket_init = socket.socket.__init__


def _registered_init(self: socket.socket, *args: Any, **kwargs: Any) -> None:
    _socket_init(self, *args, **kwargs)
    _sockets.add(self)


socket.socket.__init__ = _registered_init  # type: ignore[method-assign]


@pytest.fixture(autouse=True)
def no_socket_left_owning_a_closed_fd() -> Any:
    """Fail a test that leaves a socket object owning an fd number that is already closed.

    Collected later, such an object closes that number again, by then another socket's, in
    whatever test runs then (uvloop closes the fd of a transport made with ``sock=`` without
    detaching the socket when the transport closed before ``create_connection`` returned:
    a later test's listener was closed that way and its dials hung)."""
    yield
    stale = []
    for sock in list(_sockets):
        fd = sock.fileno()
        if fd >= 0:
            try:
                os.fstat(fd)
            except OSError:
                stale.append(fd)
    assert not stale, f"socket objects own fds that are already closed: {stale}"


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


free_ports = rvz.cluster.free_ports


def _worker_ports() -> None:
    """Under pytest-xdist, each worker draws ports from its own slice of the spans
    ``free_ports`` draws from: a port one worker's test found free cannot be taken by
    another worker's before the first one's node binds it."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER", ""), os.environ.get(
        "PYTEST_XDIST_WORKER_COUNT", "")
    if not worker.startswith("gw") or not count.isdigit() or int(count) < 2:
        return
    index, count_ = int(worker[2:]), int(count)
    spans = rvz.cluster._outside_ephemeral()
    mine = []
    for lo, hi in spans:
        share = (hi - lo + 1) // count_
        mine.append((lo + index * share, lo + (index + 1) * share - 1))
    # The programs the tests start (examples, rvz-bench) draw from the same slice.
    os.environ["RVZ_PORT_SPANS"] = ",".join(f"{lo}-{hi}" for lo, hi in mine)


_worker_ports()


@pytest.fixture
def cluster() -> rvz.ClusterSpec:
    """Two jobs on loopback: worker/0 and ps/0."""
    return rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})


WORKER = "/job:worker/replica:0/task:0/device:CPU:0"
PS = "/job:ps/replica:0/task:0/device:CPU:0"


def key(name: str = "t", src: str = WORKER, dst: str = PS, **kw: Any) -> rvz.Key:
    return rvz.Key(src=src, dst=dst, name=name, **kw)


# Node settings that keep tests fast: quick heartbeats and claims, short linger.
FAST: dict[str, Any] = dict(heartbeat=0.05, peer_timeout=2.0, linger=1.0, connect_timeout=5.0,
                            claim_timeout=0.3)


@contextlib.asynccontextmanager
async def pair(cluster: rvz.ClusterSpec, mode: str = "recv", *, worker: dict[str, Any] | None = None,
               ps: dict[str, Any] | None = None,
               **kw: Any) -> AsyncIterator[tuple[rvz.Node, rvz.Node]]:
    """The producer (worker/0) and the consumer (ps/0) of ``key()``, both running."""
    settings = {**FAST, **kw}
    async with rvz.Node(cluster, "worker", 0, mode, **{**settings, **(worker or {})}) as w, \
            rvz.Node(cluster, "ps", 0, mode, **{**settings, **(ps or {})}) as p:
        yield w, p


async def eventually(predicate: Callable[[], bool], what: str, within: float = 5.0) -> None:
    """Wait until ``predicate()`` holds; fail naming ``what`` if it never does."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within
    while not predicate():
        if loop.time() > deadline:
            raise AssertionError(f"never happened: {what}")
        await asyncio.sleep(0.005)


async def settle(n: int = 5) -> None:
    """Let the loop run a few iterations."""
    for _ in range(n):
        await asyncio.sleep(0)


async def pending(aw: Awaitable[Any], time: float = 0.1) -> asyncio.Future[Any]:
    """Start ``aw`` as a task, let it run ``time`` seconds, and check it is still waiting."""
    task = asyncio.ensure_future(aw)
    await asyncio.sleep(time)
    if task.done():
        raise AssertionError(f"expected a pending operation, it finished: {task.result()!r}"
                             if not task.exception() else
                             f"expected a pending operation, it failed: {task.exception()!r}")
    return task


def in_loop(test: Callable[..., None]) -> Callable[..., None]:
    """Run a synchronous test body inside a coroutine on the test's loop, through ``run``.

    For checks of pure code (keys, codec, table): every test still runs on both loops.
    """

    @functools.wraps(test)
    def wrapper(run: Runner, *args: Any, **kwargs: Any) -> None:
        async def body() -> None:
            test(*args, **kwargs)

        run(body(), timeout=30)

    params = list(inspect.signature(test).parameters.values())
    run_param = inspect.Parameter("run", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    wrapper.__signature__ = inspect.Signature([run_param, *params])  # type: ignore[attr-defined]
    return wrapper


class FakeTransport:
    """Just enough of an asyncio transport for a Connection fed by hand: it keeps what was
    written (``sent``) and whether the connection was reset (``aborted``) or ended (``eof``)."""

    def __init__(self) -> None:
        self.aborted = False
        self.eof = False
        self.sent = bytearray()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        pass

    def write(self, data: Any) -> None:
        self.sent += data

    def get_write_buffer_size(self) -> int:
        return 0  # everything "sent" at once

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.write(part)

    def abort(self) -> None:
        self.aborted = True

    def is_closing(self) -> bool:
        return self.aborted or self.eof

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.aborted = True


def frame_starts(data: bytes) -> list[tuple[int, int]]:
    """``(type, where its metadata starts)`` of each frame in ``data``, which must be whole
    frames (a write of small frames)."""
    frames, pos = [], 0
    while pos < len(data):
        _, ftype, _, meta_len, payload_len = HEADER.unpack_from(data, pos)
        frames.append((ftype, pos + HEADER.size))
        pos += HEADER.size + meta_len + payload_len
    assert pos == len(data), f"a frame runs past the end of the write ({pos} > {len(data)})"
    return frames


def frame_types(data: bytes) -> list[int]:
    """The frame type of each frame in ``data`` (whole frames)."""
    return [ftype for ftype, _ in frame_starts(data)]


def record_writes(conn: Any, raw: list[bytes] | None = None,
                   early: list[bool] | None = None) -> tuple[list[list[int]], Any]:
    """Route ``conn``'s small writes through a recorder: the frame types of each write
    (and, given ``raw``, the bytes of each write appended to it; given ``early``, whether
    an end-of-iteration flush was still pending when each write left: a write from within
    the iteration ahead of it, not the flush's own; a frame that leaves alone schedules no
    flush, so its write records False)."""
    written: list[list[int]] = []
    transport = conn.transport
    real_write = transport.write

    class Recording:
        def __getattr__(self, name: str) -> Any:
            return getattr(transport, name)

        def write(self, data: Any) -> None:
            data = bytes(data)
            if raw is not None:
                raw.append(data)
            if early is not None:
                early.append(bool(conn._flush_scheduled))
            written.append(frame_types(data))
            real_write(data)

    conn.transport = Recording()
    return written, transport


@contextlib.contextmanager
def after_each_read(conns: list[Any], then: Callable[[], None]) -> Any:
    """Call ``then()`` right after each read of ``conns`` is decoded and dispatched, inside
    the transport's callback (before any task it woke runs), until the block ends.

    A protocol that forwards to the connection stands between it and its transport (set
    with ``set_protocol``, which both loops honour; uvloop binds the protocol's read
    methods there, so patching the connection itself would not be seen)."""

    class AfterRead(asyncio.BufferedProtocol):
        def __init__(self, conn: Any) -> None:
            self.conn = conn

        def get_buffer(self, sizehint: int) -> Any:
            return self.conn.get_buffer(sizehint)

        def buffer_updated(self, nbytes: int) -> None:
            self.conn.buffer_updated(nbytes)
            then()

        def eof_received(self) -> Any:
            return self.conn.eof_received()

        def connection_lost(self, exc: BaseException | None) -> None:
            self.conn.connection_lost(exc)

        def pause_writing(self) -> None:
            self.conn.pause_writing()

        def resume_writing(self) -> None:
            self.conn.resume_writing()

    for conn in conns:
        conn.transport.set_protocol(AfterRead(conn))
    try:
        yield
    finally:
        for conn in conns:
            if not conn.transport.is_closing():
                conn.transport.set_protocol(conn)


def provider_or_skip(name: str) -> str:
    """``name``, or skip the test with the reason this machine cannot run that one-sided
    provider."""
    why = rvz.onesided.available().get(name)
    if why:
        pytest.skip(f"{name} contract not run on this machine: {why}")
    return name
