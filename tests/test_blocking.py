"""``rvz.blocking.BlockingNode``: the async node's calls from synchronous threads.

Sync tests on both loops (``loop_name``); the implementation is the process's (scripts/test
runs the suite once each way).  Each pair of nodes is closed by its test, and every test
ends with no loop thread left (``no_loop_thread_left``).
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
from rvz.blocking import THREAD_PREFIX, BlockingNode, BlockingStep, _Call

from .conftest import FAST, PS, WORKER, key
from .procs import run_python
from .test_typing import PROGRAMS, errors_by_line, run_mypy

ROOT = Path(__file__).resolve().parent.parent
MODES = ["recv", "send"]


def loop_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def wait_until(predicate: Callable[[], bool], what: str, within: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail naming ``what`` if it never does."""
    deadline = time.monotonic() + within
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"never happened: {what}")
        time.sleep(0.002)


@pytest.fixture(autouse=True)
def no_loop_thread_left() -> Iterator[None]:
    yield
    wait_until(lambda: not loop_threads(), "every BlockingNode's loop thread ended", 10.0)


@contextlib.contextmanager
def pair(cluster: rvz.ClusterSpec, loop_name: str, mode: str = "recv",
         **kw: Any) -> Iterator[tuple[BlockingNode, BlockingNode]]:
    """The producer (worker/0) and the consumer (ps/0) of ``key()``, each a BlockingNode."""
    settings = {**FAST, **kw}
    with BlockingNode(cluster, "worker", 0, mode, loop=loop_name, **settings) as w, \
            BlockingNode(cluster, "ps", 0, mode, loop=loop_name, **settings) as p:
        yield w, p


def in_thread(fn: Callable[[], Any]) -> Future[Any]:
    """Run ``fn`` in a thread of its own; its outcome in the future returned."""
    fut: Future[Any] = Future()

    def body() -> None:
        try:
            fut.set_result(fn())
        except BaseException as exc:
            fut.set_exception(exc)

    threading.Thread(target=body, daemon=True).start()
    return fut


def waiting_recvs(node: BlockingNode, step: int = 0) -> int:
    steps = node.stats()["steps"]
    return steps[step]["waiting_recvs"] if step in steps else 0


def queued_values(node: BlockingNode, step: int = 0) -> int:
    steps = node.stats()["steps"]
    return steps[step]["queued_values"] if step in steps else 0


# -- the calls --------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_round_trips_in_both_modes(cluster: rvz.ClusterSpec, loop_name: str, mode: str) -> None:
    k, raw = key("t"), key("raw")
    with pair(cluster, loop_name, mode) as (w, p):
        assert w.state == p.state == "running"
        assert w.name == "/job:worker/replica:0/task:0" and w.address == cluster.address("worker", 0)
        assert rvz.loop_name(w.loop) == loop_name and p.loop is not w.loop
        assert w.node.mode == mode and "running" in repr(w)
        for i in range(20):
            w.send(k, np.arange(8, dtype=np.float32) + i, timeout=5.0)
            got = p.recv(k, timeout=5.0)
            assert isinstance(got, np.ndarray) and got.tolist() == list(range(i, i + 8))
        w.send(str(raw), bytearray(b"abc"))
        assert p.recv(raw) == b"abc"
        w.send_many(((k, np.full(3, i)) for i in range(4)), timeout=5.0)  # a generator
        assert [v.tolist() for v in p.recv_many(iter([k, k, k, k]), timeout=5.0)] == [
            [i] * 3 for i in range(4)]  # type: ignore[union-attr]
        step = w.step(7)
        assert isinstance(step, BlockingStep) and step.id == 7 and "7" in repr(step)
        step.send(k, b"s1")
        step.send_many([(k, b"s2")])
        assert p.step(7).recv(k, timeout=5.0) == b"s1"
        assert p.step(7).recv_many([k], timeout=5.0) == [b"s2"]
        fresh = w.new_step()
        assert fresh.id not in (0, 7)
        stats = w.stats()
        assert stats["state"] == "running" and PS.rsplit("/", 1)[0] in stats["peers"]
        assert w.transport_for("/job:ps/replica:0/task:0") == "tcp"
        assert w.transport_for(("ps", 0)) == "tcp"


@pytest.mark.parametrize("mode", MODES)
def test_values_are_received_into_the_callers_buffers(cluster: rvz.ClusterSpec, loop_name: str,
                                                      mode: str) -> None:
    k = key("t")
    big = np.zeros(1 << 18, np.float32)  # 1 MiB: it lands from the socket when the recv waits
    small = np.zeros(4, np.int64)
    with pair(cluster, loop_name, mode) as (w, p):
        got = in_thread(lambda: p.recv(k, into=big, timeout=5.0))
        wait_until(lambda: waiting_recvs(p) == 1, "the recv waits")
        w.send(k, np.arange(1 << 18, dtype=np.float32))
        assert got.result(10) is big and np.array_equal(big, np.arange(1 << 18))
        assert p.stats()["into"]["landed_bytes"] > 0
        w.send_many([(k, np.arange(4)), (k, b"ab")], timeout=5.0)
        filled = p.step(0).recv_many([k, k], into=[small, bytearray(2)], timeout=5.0)
        assert filled[0] is small and small.tolist() == [0, 1, 2, 3] and filled[1] == b"ab"
        w.send(k, np.arange(3))
        with pytest.raises(rvz.BufferMismatch, match="does not fit into= a int64 buffer"):
            p.recv(k, into=small, timeout=5.0)
        assert p.recv(k, timeout=5.0).tolist() == [0, 1, 2]  # type: ignore[union-attr]


def test_calls_raise_what_the_async_node_raises(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        # The key's endpoints are checked by the node, on its loop.
        with pytest.raises(rvz.WrongEndpoint, match="cannot recv key") as info:
            w.recv(k)
        # The very exception the node raised on its loop (its traceback passes there).
        assert {"begin", "drive"} & {code.co_name for code in _frames(info.value)}
        with pytest.raises(rvz.WrongEndpoint):
            p.send(k, b"x")
        with pytest.raises(rvz.WrongEndpoint):
            p.send_many([(k, b"x")])
        with pytest.raises(ValueError, match="timeout"):
            p.recv(k, timeout=-1)
        with pytest.raises(ValueError, match="step 0"):
            p.cleanup_step(0)
        with pytest.raises(TypeError):
            w.step("x")  # type: ignore[arg-type]
        # A clean-up aborts the step's pending and later calls, here and on the peer.
        pending = in_thread(lambda: p.step(5).recv(k, timeout=10.0))
        wait_until(lambda: waiting_recvs(p, 5) == 1, "the recv waits in step 5")
        w.step(5).cleanup("enough")
        with pytest.raises(rvz.Aborted, match="step 5 was cleaned up by .*: enough"):
            pending.result(10)
        with pytest.raises(rvz.Aborted):
            w.step(5).send(k, b"late")
        # abort(exc): every later call fails with NodeClosed caused by exc.
        cause = RuntimeError("stop here")
        p.abort(cause)
        assert p.state == "closed"
        with pytest.raises(rvz.NodeClosed) as closed:
            p.recv(k)
        assert closed.value.__cause__ is cause
        p.abort()  # once closed, abort does nothing


def _frames(exc: BaseException) -> list[Any]:
    tb, frames = exc.__traceback__, []
    while tb is not None:
        frames.append(tb.tb_frame.f_code)
        tb = tb.tb_next
    return frames


def test_timeout_is_the_nodes_and_leaves_the_node_usable(cluster: rvz.ClusterSpec,
                                                         loop_name: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        start = time.monotonic()
        with pytest.raises(TimeoutError, match="timed out after 0.2s"):
            p.recv(k, timeout=0.2)
        assert 0.15 < time.monotonic() - start < 5.0
        with pytest.raises(TimeoutError):
            p.recv_many([k, key("u")], timeout=0.1)
        assert waiting_recvs(p) == 0
        w.send(k, b"after")
        assert p.recv(k, timeout=5.0) == b"after"


def test_a_send_that_waits_for_room_times_out_and_then_goes_on(cluster: rvz.ClusterSpec,
                                                               loop_name: str) -> None:
    """A Recv-Driven send past ``hold_limit`` waits on the loop (its first step ran outside a
    task, the rest in one): its timeout is the node's, and the next send gets through once
    the consumer took the held value."""
    k = key("t")
    with pair(cluster, loop_name, hold_limit=256) as (w, p):
        w.send(k, b"a" * 150)
        with pytest.raises(TimeoutError, match="hold limit"):
            w.send(k, b"b" * 150, timeout=0.2)
        later = in_thread(lambda: w.send(k, b"c" * 150, timeout=10.0))
        assert p.recv(k, timeout=5.0) == b"a" * 150
        later.result(10)
        assert p.recv(k, timeout=5.0) == b"c" * 150


def test_calls_after_close_fail_with_node_closed(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        waiting = in_thread(lambda: p.recv(k))  # no timeout: close must end it
        wait_until(lambda: waiting_recvs(p) == 1, "the recv waits")
        p.close()
        with pytest.raises(rvz.NodeClosed):
            waiting.result(10)
        assert p.state == "closed" and not any(p.name in t.name for t in loop_threads())
        for call in (lambda: p.recv(k), lambda: p.stats(), lambda: p.new_step(),
                     lambda: p.step(3).recv(k), lambda: p.transport_for(("worker", 0))):
            with pytest.raises(rvz.NodeClosed, match="is closed"):
                call()
        p.close()  # idempotent
        p.abort()
        w.close()
        w.close()
    assert not loop_threads()


def test_close_from_many_threads_at_once(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    with pair(cluster, loop_name) as (w, _):
        closers = [in_thread(w.close) for _ in range(4)]
        for closer in closers:
            closer.result(30)
        assert w.state == "closed"


def test_leaving_with_an_error_aborts_with_it(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    with pytest.raises(KeyError):
        with BlockingNode(cluster, "worker", 0, loop=loop_name, **FAST) as w:
            raise KeyError("boom")
    assert w.state == "closed"
    with pytest.raises(rvz.NodeClosed):
        w.send(key(), b"x")


def test_a_bad_option_or_a_taken_port_leaves_no_thread(cluster: rvz.ClusterSpec,
                                                       loop_name: str) -> None:
    with pytest.raises(rvz.ConfigError):
        BlockingNode(cluster, "worker", "0", loop=loop_name)  # type: ignore[call-overload]
    with pytest.raises(ValueError, match="loop must be"):
        BlockingNode(cluster, "worker", 0, loop="tokio")  # type: ignore[call-overload]
    assert not loop_threads()
    with BlockingNode(cluster, "worker", 0, loop=loop_name, **FAST):
        with pytest.raises(rvz.TransportError, match="cannot listen"):
            BlockingNode(cluster, "worker", 0, loop=loop_name, **FAST)
        assert len(loop_threads()) == 1


def test_from_env(cluster: rvz.ClusterSpec, loop_name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import json
    spec = {job: [cluster.address(job, 0)] for job in ("worker", "ps")}
    monkeypatch.delenv("TF_CONFIG", raising=False)
    monkeypatch.setenv("RVZ_CLUSTER", json.dumps(spec))
    monkeypatch.setenv("RVZ_JOB", "ps")
    monkeypatch.setenv("RVZ_TASK", "0")
    with BlockingNode.from_env(loop=loop_name, mode="send", **FAST) as node:
        assert node.name == "/job:ps/replica:0/task:0" and node.node.mode == "send"


# -- threads ---------------------------------------------------------------------------------


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", MODES)
def test_eight_threads_lose_duplicate_and_corrupt_nothing(cluster: rvz.ClusterSpec, loop_name: str,
                                                          mode: str) -> None:
    """Each thread sends on its own key and on a shared one through one BlockingNode, and
    receives both through the other: for 2 s.  Its own key's values come back in order and
    intact; every value sent on the shared key is received exactly once, by some thread."""
    threads, duration = 8, 2.0
    shared = key("shared")
    with pair(cluster, loop_name, mode) as (w, p):
        stop = time.monotonic() + duration

        def value(thread: int, n: int) -> np.ndarray:
            return np.full(16, thread * 1_000_000 + n, dtype=np.int64)

        def hammer(i: int) -> tuple[int, list[int]]:
            own, n, got = key(f"own{i}"), 0, []
            while time.monotonic() < stop:
                w.send(own, value(i, n), timeout=20.0)
                w.send(shared, value(i, n), timeout=20.0)
                back = p.recv(own, timeout=20.0)
                assert isinstance(back, np.ndarray) and (back == value(i, n)).all(), (i, n, back)
                other = p.recv(shared, timeout=20.0)
                assert isinstance(other, np.ndarray) and other.shape == (16,)
                assert (other == other[0]).all(), other  # one sender's value, whole
                got.append(int(other[0]))
                n += 1
            return n, got

        futures = [in_thread(lambda i=i: hammer(i)) for i in range(threads)]  # type: ignore[misc]
        results = [f.result(60) for f in futures]
        counts = [n for n, _ in results]
        received = sorted(v for _, got in results for v in got)
        sent = sorted(t * 1_000_000 + n for t, count in enumerate(counts) for n in range(count))
        assert all(counts), counts
        assert received == sent  # each shared value exactly once
        assert queued_values(p) == 0 and waiting_recvs(p) == 0


def test_a_call_from_the_loop_thread_raises(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    with pair(cluster, loop_name) as (w, p):
        outcome: Future[Any] = Future()

        def on_loop() -> None:
            try:
                p.recv(key(), timeout=1.0)
            except BaseException as exc:
                outcome.set_exception(exc)
            else:
                outcome.set_result(None)

        p.loop.call_soon_threadsafe(on_loop)
        with pytest.raises(RuntimeError, match="own event loop's thread"):
            outcome.result(10)
        closing: Future[Any] = Future()
        p.loop.call_soon_threadsafe(lambda: closing.set_result(_raised(p.close)))
        assert isinstance(closing.result(10), RuntimeError)
        assert p.state == "running"
        w.send(key(), b"still fine")
        assert p.recv(key(), timeout=5.0) == b"still fine"


def _raised(fn: Callable[[], Any]) -> BaseException | None:
    try:
        fn()
    except BaseException as exc:
        return exc
    return None


@contextlib.contextmanager
def interrupt_when(predicate: Callable[[], bool]) -> Iterator[None]:
    """Raise KeyboardInterrupt in the main thread, as Ctrl-C would, once ``predicate()``."""
    if threading.current_thread() is not threading.main_thread():
        pytest.skip("signals reach the main thread only")
    main = threading.main_thread().ident
    assert main is not None

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, interrupt)
    done = threading.Event()

    def watch() -> None:
        try:
            wait_until(lambda: done.is_set() or predicate(), "the call waits")
        finally:
            if not done.is_set():
                signal.pthread_kill(main, signal.SIGUSR1)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(10)
        signal.signal(signal.SIGUSR1, previous)


def test_an_interrupted_recv_is_cancelled_on_the_loop(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        with pytest.raises(KeyboardInterrupt):
            with interrupt_when(lambda: waiting_recvs(p) == 1):
                p.recv(k)
        # The cancellation ended before the interrupt reached us: nothing waits to take
        # the next value, which goes to the next recv.
        assert waiting_recvs(p) == 0
        w.send(k, b"for the second recv")
        assert p.recv(k, timeout=5.0) == b"for the second recv"


def test_a_cancel_that_comes_after_the_awaited_result_is_thrown_in(cluster: rvz.ClusterSpec,
                                                                    loop_name: str) -> None:
    """A call driven without a task is cancelled as a task is: what it awaits got its result
    and the wake-up is on its way when the cancel comes, so the cancellation is thrown in at
    its next step, where a recv gives back the value it got."""
    with pair(cluster, loop_name) as (_, p):
        runner = p._runner
        awaited: Future[Any] = Future()
        seen: list[Any] = []

        async def work() -> Any:
            fut = asyncio.get_running_loop().create_future()
            awaited.set_result(fut)
            try:
                return await fut
            except asyncio.CancelledError:
                seen.append(fut.result())
                raise

        outcome = in_thread(lambda: runner.call(work(), None, True))
        fut = awaited.result(10)
        wait_until(lambda: [c.waiting for c in list(runner.calls)] == [fut], "the call waits")

        def done_then_cancelled() -> None:
            fut.set_result("value")
            runner.cancel(next(iter(runner.calls)))

        p.loop.call_soon_threadsafe(done_then_cancelled)
        with pytest.raises(asyncio.CancelledError):
            outcome.result(10)
        assert seen == ["value"] and not runner.calls


@pytest.mark.parametrize("when", ["before its task's first step", "before it was queued"])
def test_a_call_cancelled_before_it_ran_releases_its_caller_at_once(
        cluster: rvz.ClusterSpec, loop_name: str, when: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        runner = p._runner
        call = _Call(runner.node.recv_many([k], timeout=30.0), False)
        runner.calls.add(call)  # handed over; an interrupt comes before (or as) it begins
        if when == "before it was queued":
            runner.loop.call_soon_threadsafe(runner.cancel, call)
        else:
            runner.loop.call_soon_threadsafe(lambda: (runner.begin(call), runner.cancel(call)))
        assert call.done.acquire(True, 5.0), "the caller is still waiting"
        assert isinstance(call.error, asyncio.CancelledError) and call not in runner.calls
        assert waiting_recvs(p) == 0  # nothing of it waits for a value
        w.send(k, b"for the next recv")
        assert p.recv(k, timeout=5.0) == b"for the next recv"


def test_a_driven_call_that_yields_to_the_loop_goes_on_in_a_task(cluster: rvz.ClusterSpec,
                                                                 loop_name: str) -> None:
    with pair(cluster, loop_name) as (_, p):

        async def work() -> bool:
            await asyncio.sleep(0)  # a bare yield, no future to wake it
            return asyncio.current_task() is not None

        assert p._runner.call(work(), None, True) is True


def test_an_interrupted_recv_many_gives_its_values_back(cluster: rvz.ClusterSpec,
                                                        loop_name: str) -> None:
    a, b = key("a"), key("b")
    with pair(cluster, loop_name, "send") as (w, p):
        w.send(a, b"first a")
        wait_until(lambda: queued_values(p) == 1, "a arrived")
        with pytest.raises(KeyboardInterrupt):
            # Takes a at once, then waits for b.
            with interrupt_when(lambda: waiting_recvs(p) == 1 and queued_values(p) == 0):
                p.recv_many([a, b])
        assert queued_values(p) == 1 and waiting_recvs(p) == 0  # a is back
        assert p.recv(a, timeout=5.0) == b"first a"
        w.send(b, b"b")
        assert p.recv(b, timeout=5.0) == b"b"


# -- the loop thread's life ------------------------------------------------------------------


def test_a_dead_loop_fails_the_waiting_calls_and_close_returns(cluster: rvz.ClusterSpec,
                                                               loop_name: str) -> None:
    k = key("t")
    with pair(cluster, loop_name) as (w, p):
        waiting = in_thread(lambda: p.recv(k))
        wait_until(lambda: waiting_recvs(p) == 1, "the recv waits")

        def die() -> None:
            raise SystemExit("the loop dies")

        p.loop.call_soon_threadsafe(die)
        with pytest.raises(rvz.NodeClosed) as info:
            waiting.result(10)
        # The node was aborted with the loop's failure as the cause.
        assert "event loop stopped on SystemExit" in str(info.value.__cause__)
        wait_until(lambda: not any(p.name in t.name for t in loop_threads()), "the thread ended")
        assert p.state == "closed" and p.node.state == "closed" and p.loop.is_closed()
        with pytest.raises(rvz.NodeClosed):
            p.send(key("x", src=PS, dst=WORKER), b"x")
        p.close()
        p.close()


def test_an_unclosed_node_warns_and_stops_its_thread(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    node = BlockingNode(cluster, "worker", 0, loop=loop_name, **FAST)
    inner = weakref.ref(node.node)
    with pytest.warns(ResourceWarning, match="unclosed BlockingNode"):
        del node
        gc.collect()
    wait_until(lambda: not loop_threads(), "the thread of the dropped node ended")
    gc.collect()
    assert inner() is None or inner().state == "closed"  # type: ignore[union-attr]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_gets_runtime_error(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    with pair(cluster, loop_name) as (w, p):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: report, and leave without running anything of the parent's
            code = 1
            try:
                try:
                    w.send(key(), b"x", timeout=1.0)
                    os.write(write, b"sent")
                except RuntimeError as exc:
                    w.close()  # the parent's: nothing to do
                    os.write(write, b"ok" if "forked" in str(exc) else str(exc).encode())
                code = 0
            finally:
                os._exit(code)
        os.close(write)
        with os.fdopen(read, "rb") as f:
            said = f.read()
        _, status = os.waitpid(pid, 0)
        assert said == b"ok" and status == 0
        w.send(key(), b"the parent's node still works")
        assert p.recv(key(), timeout=5.0) == b"the parent's node still works"


@pytest.mark.timeout(120)
def test_nodes_left_open_are_closed_at_exit(cluster: rvz.ClusterSpec, loop_name: str) -> None:
    """A program that exits without closing its nodes: the atexit hook closes them, the
    value held for the consumer is delivered by the graceful close, nothing warns."""
    code = f"""
import json, sys, warnings
warnings.simplefilter("error", ResourceWarning)
import rvz
from rvz.blocking import BlockingNode
cluster = rvz.ClusterSpec({{job: [a] for job, a in json.loads(sys.argv[1]).items()}})
k = rvz.Key("{WORKER}", "{PS}", "t")
w = BlockingNode(cluster, "worker", 0, "recv", loop="{loop_name}", linger=2.0, heartbeat=0.05)
p = BlockingNode(cluster, "ps", 0, "recv", loop="{loop_name}", linger=2.0, heartbeat=0.05)
w.send(k, b"v")
assert p.recv(k, timeout=10) == b"v"
print("ran", flush=True)
"""
    import json
    spec = json.dumps({job: cluster.address(job, 0) for job in ("worker", "ps")})
    start = time.monotonic()
    proc = run_python(["-c", code, spec], cwd=str(ROOT), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ran"
    assert "Traceback" not in proc.stderr and "Warning" not in proc.stderr, proc.stderr
    assert time.monotonic() - start < 60


# -- typing ----------------------------------------------------------------------------------


@pytest.mark.process
@pytest.mark.timeout(300)
def test_the_blocking_api_is_typed(tmp_path: Path) -> None:
    """mypy --strict passes a program on the whole blocking API and catches the mistakes
    marked in blocking_typos.py, as tests/test_typing.py does for the async API."""
    good, bad = PROGRAMS / "uses_blocking.py", PROGRAMS / "blocking_typos.py"
    out = run_mypy(tmp_path, good, bad).stdout
    assert good.name not in out, f"mypy --strict rejects {good.name}:\n{out}"
    expected = {n: m.group(1) for n, line in enumerate(bad.read_text().splitlines(), 1)
                if (m := re.search(r"# E: ([a-z-]+)$", line))}
    got = errors_by_line(out, bad)
    assert expected and {n: [code] for n, code in expected.items()} == {
        n: sorted(set(codes)) for n, codes in got.items()}, out


def test_the_module_is_importable_without_side_effects() -> None:
    # Importing starts nothing: threads come with BlockingNodes only.
    assert "rvz.blocking" in sys.modules and not loop_threads()
