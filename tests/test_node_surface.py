"""The node's surface around the core: stats, repr, the checks every call makes, close."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import inspect
import logging
import os
import socket
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import FAST, PS, WORKER, eventually, key, pair, pending, settle
from .procs import run_python


def test_stats_and_repr_describe_a_running_pair(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            for _ in range(5):
                await w.send(key("s"), np.arange(4))
            await eventually(lambda: p.stats()["steps"].get(0, {}).get("queued_values") == 5,
                             "five values queued at the consumer")
            ps = p.stats()
            assert ps["node"] == p.name and ps["state"] == "running" and ps["mode"] == "send"
            assert ps["implementation"] == rvz.implementation()
            peer = ps["peers"][w.name]
            assert peer["state"] == "connected" and peer["messages_in"] >= 5
            assert peer["bytes_in"] >= 5 * 32
            ws = w.stats()["peers"][p.name]
            assert ws["messages_out"] >= 5 and ws["credit"] < w.push_window
            blocked = await pending(p.recv(key("other"), timeout=5))
            st = p.stats()
            assert st["steps"][0]["waiting_recvs"] == 1 and st["waits"]["consumer"] >= 1
            blocked.cancel()
            assert repr(p).startswith(f"<rvz.Node {p.name} at {p.address} running")
            assert "peers=1" in repr(p)

    run(main(), timeout=15)


def test_recv_driven_stats_count_requests(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with pair(cluster, "recv") as (w, p):
            waiting = await pending(p.recv(key("r"), timeout=5))
            await eventually(lambda: w.stats()["peers"].get(p.name, {}).get("parked_requests") == 1,
                             "the producer parked the consumer's request")
            assert p.stats()["peers"][w.name]["outstanding_requests"] == 1
            await w.send(key("r"), np.arange(3))
            assert (await waiting).tolist() == [0, 1, 2]
            assert w.stats()["peers"][p.name]["parked_requests"] == 0
            assert p.stats()["peers"][w.name]["outstanding_requests"] == 0

    run(main(), timeout=15)


def test_recv_driven_requests_of_one_key_are_counted_as_recvs_come_and_go(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """One waiting recv, three, one of them cancelled, all answered: the count of requests
    out for the key follows (a lone request and several are kept differently)."""
    async def main() -> None:
        async with pair(cluster, "recv") as (w, p):
            core = p._core
            k = key("n")
            text = str(k)

            def parked() -> int:
                return int(w.stats()["peers"].get(p.name, {}).get("parked_requests", 0))

            first = await pending(p.recv(k, timeout=5))
            await eventually(lambda: parked() == 1, "one request parked")
            assert core.requests.outstanding_count(0, text) == 1
            more = [await pending(p.recv(k, timeout=5)) for _ in range(2)]
            await eventually(lambda: parked() == 3, "three requests parked")
            assert core.requests.outstanding_count(0, text) == 3
            more[0].cancel()
            await eventually(lambda: parked() == 2, "the cancelled recv's request withdrawn")
            assert core.requests.outstanding_count(0, text) == 2
            for i in range(2):
                await w.send(k, np.array([i]))
            assert (await first).tolist() == [0]
            assert (await more[1]).tolist() == [1]
            assert core.requests.outstanding_count(0, text) == 0
            assert not any(core.requests.outstanding.values())
            lone = await pending(p.recv(k, timeout=5))
            await eventually(lambda: parked() == 1, "a lone request parked again")
            await w.send(k, np.array([7]))
            assert (await lone).tolist() == [7]
            assert core.requests.outstanding_count(0, text) == 0 and not core.requests.by_id

    run(main(), timeout=15)


def test_cleaning_up_a_step_drops_its_requests_and_no_other_steps(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """Recv-Driven recvs waiting in two steps: cleaning one up fails its recvs and forgets
    its requests; the other step's stay outstanding and are answered."""
    async def main() -> None:
        async with pair(cluster, "recv") as (w, p):
            core = p._core
            k, other = key("a"), key("b")
            doomed = [await pending(p.step(3).recv(k, timeout=5)) for _ in range(2)]
            doomed.append(await pending(p.step(3).recv(other, timeout=5)))
            kept = await pending(p.step(4).recv(k, timeout=5))
            await eventually(lambda: len(core.requests.by_id) == 4, "four requests out")
            assert core.requests.outstanding_count(3, str(k)) == 2
            assert core.requests.outstanding_count(3, str(other)) == 1
            await p.step(3).cleanup()
            for recv in doomed:
                with pytest.raises(rvz.Aborted):
                    await recv
            assert core.requests.outstanding_count(3, str(k)) == 0 and 3 not in core.requests.outstanding
            assert core.requests.outstanding_count(4, str(k)) == 1 and len(core.requests.by_id) == 1
            await w.step(4).send(k, np.array([5]))
            assert (await kept).tolist() == [5]
            assert not any(core.requests.outstanding.values()) and not core.requests.by_id

    run(main(), timeout=15)


def test_a_call_from_another_loop_on_the_same_thread_is_refused(loop_name, cluster) -> None:  # type: ignore[no-untyped-def]
    """The node's loop is stopped and another loop runs on its thread: refused, as from
    another thread (the check's cheap path, same thread, must not let this through)."""
    home = rvz.new_event_loop(loop_name)
    try:
        node = rvz.Node(cluster, "worker", 0, mode="send")
        own = key("own", dst=WORKER)
        home.run_until_complete(asyncio.wait_for(node.start(), 10))
        try:
            # (its loop is not running: the advice is to call it from there, not to hand the
            # call to a loop that would never run it)
            with pytest.raises(RuntimeError, match="event loop that is not running"):
                rvz.run(asyncio.wait_for(node.send(key("t"), np.arange(2)), 10), loop=loop_name)
            # and back on its own loop the node serves again (a key to itself: no peer needed)
            home.run_until_complete(asyncio.wait_for(node.send(own, np.arange(2)), 10))
            got = home.run_until_complete(asyncio.wait_for(node.recv(own), 10))
            assert got.tolist() == [0, 1]
        finally:
            home.run_until_complete(asyncio.wait_for(node.close(), 10))
    finally:
        home.close()


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_loop_with_futures_of_its_own_gets_them(loop_name, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """The compiled engine makes plain asyncio futures itself, faster than the loop's
    ``create_future``; only when that is what the loop makes.  A loop whose
    ``create_future`` makes futures of its own class gets them: a recv waiting for its
    value waits on one."""
    made: list[asyncio.Future[Any]] = []
    plain = rvz.new_event_loop(loop_name)
    base = type(plain)
    plain.close()  # only its class is needed

    class Counted(asyncio.Future):  # type: ignore[type-arg]
        pass

    class OwnFutures(base):  # type: ignore[misc, valid-type]
        def create_future(self) -> asyncio.Future[Any]:
            future = Counted(loop=self)
            made.append(future)
            return future

    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            before = len(made)
            waiting = await pending(p.recv(key("own"), timeout=5))
            assert any(type(f) is Counted and not f.done() for f in made[before:]), \
                "the waiting recv's future is the loop's own"
            await w.send(key("own"), np.arange(3))
            assert (await waiting).tolist() == [0, 1, 2]

    loop = OwnFutures()
    try:
        loop.run_until_complete(asyncio.wait_for(main(), 15))
    finally:
        loop.close()


def test_a_plain_loop_s_futures_belong_to_it(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """The other side of the test above: on uvloop or asyncio, the engine's futures are
    asyncio futures of the node's loop (not of some other loop)."""
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            future = p._core.future()
            assert type(future) is asyncio.Future
            assert future.get_loop() is asyncio.get_running_loop()
            waiting = await pending(p.recv(key("plain"), timeout=5))
            await w.send(key("plain"), np.arange(2))
            assert (await waiting).tolist() == [0, 1]

    run(main(), timeout=15)


def test_a_call_from_another_thread_is_refused(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            errors: list[BaseException] = []

            def other_thread() -> None:
                try:
                    asyncio.run(w.send(key("t"), np.arange(2)))
                except BaseException as exc:
                    errors.append(exc)

            thread = threading.Thread(target=other_thread)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.01)
            assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
            assert "run_coroutine_threadsafe" in str(errors[0])
            # the supported way works
            loop = asyncio.get_running_loop()
            done = await asyncio.to_thread(
                lambda: asyncio.run_coroutine_threadsafe(w.send(key("t"), np.arange(2)), loop)
                .result(5))
            assert done is None
            assert (await p.recv(key("t"), timeout=5)).tolist() == [0, 1]

    run(main(), timeout=15)


def test_bad_arguments_fail_before_anything_happens(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            with pytest.raises(ValueError, match="timeout"):
                await p.recv(key("n"), timeout=-1)
            with pytest.raises(ValueError, match="timeout"):
                await w.send(key("n"), np.arange(1), timeout=-0.5)
            with pytest.raises(ValueError, match="step 0"):
                await w.cleanup_step(0)
            # step 0 still works after the refusal
            await w.send(key("n"), np.arange(1))
            assert (await p.recv(key("n"), timeout=5)).tolist() == [0]
            # a numpy scalar goes as a 0-d array
            await w.send(key("scalar"), np.arange(4).sum())
            got = await p.recv(key("scalar"), timeout=5)
            assert got.shape == () and int(got) == 6

    run(main(), timeout=15)


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_step_id_the_wire_cannot_carry_is_refused_at_the_call(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    # A step id is an integer in [0, 2**64): anything else is refused by the call that
    # names it, not when its first frame is written (the value was lost there, and the
    # error went to a loop callback).
    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            for bad, error in ((-1, ValueError), (1 << 64, ValueError), ("x", TypeError),
                               (None, TypeError), (1.5, TypeError), (True, TypeError),
                               (False, TypeError), (np.True_, TypeError)):
                with pytest.raises(error, match="step id"):
                    await w.send(key("s"), np.arange(1), step=bad)
                with pytest.raises(error, match="step id"):
                    await w.send_many([(key("s"), np.arange(1))], step=bad)
                with pytest.raises(error, match="step id"):
                    await p.recv(key("s"), step=bad, timeout=5)
                with pytest.raises(error, match="step id"):
                    await p.recv_many([key("s")], step=bad, timeout=5)
                with pytest.raises(error, match="step id"):
                    w.step(bad)
                with pytest.raises(error, match="step id"):
                    await w.cleanup_step(bad)
            # the largest id is one, numpy integers too; nothing was sent before
            top = w.step((1 << 64) - 1)
            await top.send(key("s"), np.arange(2))
            assert (await p.step((1 << 64) - 1).recv(key("s"), timeout=5)).tolist() == [0, 1]
            await w.step(np.int64(3)).send(key("s"), np.arange(3))
            assert (await p.recv(key("s"), step=3, timeout=5)).tolist() == [0, 1, 2]
            with pytest.raises(TimeoutError):
                await p.recv(key("s"), timeout=0.2)
            # Ids equal to 1 as dict keys (True, 1.0, numpy's True) are refused too once
            # step 1 has a table, which they would otherwise have found unchecked.
            await w.send(key("one"), np.arange(4), step=1)
            await eventually(lambda: 1 in (w.stats()["steps"] if mode == "recv" else p.stats()["steps"]),
                             "step 1 has a table where its value waits")
            for bad in (True, 1.0, np.True_):
                with pytest.raises(TypeError, match="step id"):
                    await w.send(key("one"), np.arange(1), step=bad)
                with pytest.raises(TypeError, match="step id"):
                    await p.recv(key("one"), step=bad, timeout=5)
                with pytest.raises(TypeError, match="step id"):
                    await p.recv_many([key("one")], step=bad, timeout=5)
            assert (await p.recv(key("one"), step=1, timeout=5)).tolist() == [0, 1, 2, 3]
            with pytest.raises(TimeoutError):
                await p.recv(key("one"), step=1, timeout=0.2)

    run(main(), timeout=20)


def test_a_node_not_started_says_how_to_start_it(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        node = rvz.Node(cluster, "worker", 0)
        with pytest.raises(rvz.RvzError, match="start"):
            await node.send(key("x"), np.arange(1))

    run(main(), timeout=5)


def test_a_port_in_use_is_a_transport_error_naming_the_node(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with rvz.Node(cluster, "worker", 0, **FAST):
            twin = rvz.Node(cluster, "worker", 0, **FAST)
            with pytest.raises(rvz.TransportError) as info:
                await twin.start()
            assert "/job:worker/replica:0/task:0" in str(info.value)
            assert cluster.address("worker", 0).rsplit(":", 1)[1] in str(info.value)

    run(main(), timeout=10)


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_close_does_not_wait_for_values_whose_recvs_were_cancelled(run, cluster, mode, caplog) -> None:  # type: ignore[no-untyped-def]
    """The producer sends values the consumer asked for and then stopped waiting for; its
    close delivers them (they land in the consumer's table) instead of lingering, and the
    consumer's next recvs get them in order."""

    async def main() -> None:
        async with rvz.Node(cluster, "ps", 0, mode, **FAST) as p:
            w = await rvz.Node(cluster, "worker", 0, mode,
                               **{**FAST, "linger": 30.0, "claim_timeout": None}).start()
            recvs = [await pending(p.recv(key(f"c{i}"), timeout=10), 0.01) for i in range(6)]
            for task in recvs:
                task.cancel()
            await settle()
            for i in range(6):
                await w.send(key(f"c{i}"), np.array([i]))
            with caplog.at_level(logging.WARNING, logger="rvz"):
                await asyncio.wait_for(w.close(), 8)   # far below the 30 s linger
            assert not [r for r in caplog.records if "undelivered" in r.getMessage()]
            got = [int((await p.recv(key(f"c{i}"), timeout=5))[0]) for i in range(6)]
            assert got == list(range(6))

    run(main(), timeout=20)


def test_close_counts_what_it_could_not_deliver_in_one_line(run, cluster, caplog) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        w = await rvz.Node(cluster, "worker", 0, "recv",
                           **{**FAST, "linger": 0.3, "connect_timeout": 0.2,
                              "claim_timeout": None}).start()
        for i in range(4):
            await w.send(key(f"lost{i}"), np.arange(3))   # held: nobody will ever ask
        with caplog.at_level(logging.WARNING, logger="rvz"):
            await w.close()
        lines = [r.getMessage() for r in caplog.records if "undelivered" in r.getMessage()]
        assert len(lines) == 1 and "4 values undelivered" in lines[0], lines

    run(main(), timeout=10)


def test_empty_step_tables_are_dropped(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            for step in range(1, 30):
                await w.step(step).send(key("s"), np.arange(2))
                assert (await p.step(step).recv(key("s"), timeout=5)).tolist() == [0, 1]
            await eventually(lambda: len(p.stats()["steps"]) <= 1 and len(w.stats()["steps"]) <= 1,
                             "finished steps' tables dropped at the next heartbeat")
            # a dropped step can be used again
            await w.step(7).send(key("s"), np.arange(1))
            assert (await p.step(7).recv(key("s"), timeout=5)).tolist() == [0]

    run(main(), timeout=15)


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_step_whose_table_was_dropped_gets_a_new_one_that_a_clean_up_reaches(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """The engine remembers the last step's table: after the heartbeat drops that table,
    the step's next recv must wait in a table the node knows, which ``cleanup_step``
    aborts (a recv left in the forgotten one would wait forever)."""
    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            await w.step(5).send(key("s"), np.arange(2))
            assert (await p.step(5).recv(key("s"), timeout=5)).tolist() == [0, 1]
            await eventually(lambda: 5 not in p._tables, "the empty table of step 5 dropped")
            waiting = await pending(p.step(5).recv(key("s"), timeout=5))
            assert 5 in p._tables and p._tables[5].waiting(str(key("s"))) == 1
            await p.cleanup_step(5)
            with pytest.raises(rvz.Aborted):
                await waiting

    run(main(), timeout=15)


def test_a_recv_driven_step_s_request_map_goes_with_its_table(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """A consumer keeps a step's map of outstanding requests while the step's table lives
    (a stream of recvs would otherwise make and free one per request), and drops it with
    the table: steps that come and go leave nothing behind."""
    async def main() -> None:
        async with pair(cluster, "recv") as (w, p):
            core = p._core
            for step in range(1, 30):
                waiting = await pending(p.step(step).recv(key("s"), timeout=5))
                assert core.requests.outstanding_count(step, str(key("s"))) == 1
                await w.step(step).send(key("s"), np.arange(2))
                assert (await waiting).tolist() == [0, 1]
            assert 29 in core.requests.outstanding, "the map of a step whose table lives is kept"
            # (stats() leaves empty tables out; the tables themselves go at heartbeats)
            await eventually(lambda: len(core.steps.tables) <= 1,
                             "finished steps' tables dropped at the next heartbeats")
            assert len(core.requests.outstanding) <= 1 and not core.requests.by_id

    run(main(), timeout=15)


def test_a_relayed_step_abort_names_its_origin_once(run) -> None:  # type: ignore[no-untyped-def]
    cluster = rvz.ClusterSpec.loopback({"a": 1, "b": 1, "c": 1})
    A, B, C = (f"/job:{j}/replica:0/task:0/device:CPU:0" for j in "abc")

    async def main() -> None:
        async with rvz.Node(cluster, "a", 0, "send", **FAST) as a, \
                rvz.Node(cluster, "b", 0, "send", **FAST) as b, \
                rvz.Node(cluster, "c", 0, "send", **FAST) as c:
            ab = rvz.Key(src=A, dst=B, name="ab")
            bc = rvz.Key(src=B, dst=C, name="bc")
            await a.step(3).send(ab, np.arange(1))
            await b.step(3).recv(ab, timeout=5)
            await b.step(3).send(bc, np.arange(1))
            await c.step(3).recv(bc, timeout=5)
            waiting: Any = await pending(c.step(3).recv(bc, timeout=5))
            await a.step(3).cleanup()
            with pytest.raises(rvz.Aborted) as info:
                await waiting
            text = str(info.value)
            assert text.count("/job:a/") == 1, text          # the origin, once
            assert text.count(str(bc)) == 1, text             # the key, once
            assert "step 3" in text, text

    run(main(), timeout=15)


def test_send_and_recv_are_the_active_variant_s_and_behave_as_coroutines() -> None:
    """``Node.send`` and ``Node.recv`` come from ``NodeCalls`` of the variant that loaded (a
    C coroutine function when compiled) and keep Node's signature and documentation."""
    assert rvz.Node.__mro__[1] is _impl.calls.NodeCalls
    assert _impl.calls.__file__.endswith(".py") == (rvz.implementation() == "python")
    for name, positional, keywords in (
            ("send", ["self", "key", "value"], ["mode", "step", "timeout"]),
            ("recv", ["self", "key"], ["mode", "step", "timeout", "into"])):
        method = getattr(rvz.Node, name)
        assert inspect.iscoroutinefunction(method), name
        params = inspect.signature(method).parameters
        assert [p for p in params if params[p].kind is not params[p].KEYWORD_ONLY] == positional
        assert [p for p in params if params[p].kind is params[p].KEYWORD_ONLY] == keywords
        assert "the key's " in (method.__doc__ or ""), name


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_send_and_a_recv_run_as_tasks_and_a_cancelled_recv_takes_nothing(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """What a call returns is a coroutine: ``asyncio.create_task`` (which refuses any other
    awaitable) runs it, and cancelling a waiting one leaves the next value to the next recv."""
    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            got = asyncio.create_task(p.recv(key("c"), timeout=5))
            sent = asyncio.create_task(w.send(key("c"), np.arange(3)))
            await sent
            assert (await got).tolist() == [0, 1, 2]
            gone = await pending(p.recv(key("d"), timeout=5))
            gone.cancel()
            with pytest.raises(asyncio.CancelledError):
                await gone
            await w.send(key("d"), np.arange(2))
            assert (await p.recv(key("d"), timeout=5)).tolist() == [0, 1]

    run(main(), timeout=15)


@pytest.mark.parametrize("how", ["close", "abort"])
def test_cleanup_step_on_a_node_that_is_gone_fails_as_any_call(run, cluster, how) -> None:  # type: ignore[no-untyped-def]
    # It returned normally, as if the step had been cleaned up on its peers.
    async def main() -> None:
        async with pair(cluster, "recv") as (w, _):
            if how == "close":
                await w.close()
            else:
                w.abort(RuntimeError("gone"))
            with pytest.raises(rvz.Aborted):
                await w.cleanup_step(4)
    run(main())


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_an_array_the_wire_cannot_carry_is_refused_at_the_call(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    # 33 dimensions: a Recv-Driven send queued it and the value was lost when its frame was
    # written (the consumer saw its peer lost).  Every send refuses it; the key goes on.
    try:
        deep = np.zeros((1,) * 33, np.float32)
    except ValueError:  # numpy before 2.0 makes no more than 32 dimensions itself
        pytest.skip(f"numpy {np.__version__} makes at most 32 dimensions")

    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            with pytest.raises(ValueError, match="33 dimensions"):
                await w.send(key("d"), deep)
            with pytest.raises(ValueError, match="33 dimensions"):
                await w.send_many([(key("d"), deep)])
            await w.send(key("d"), deep.reshape((1,) * 32))
            assert (await p.recv(key("d"), timeout=5)).ndim == 32
    run(main())


@pytest.mark.parametrize(("size", "frame"), [(5000, "DATA_MANY entry"), (20000, "DATA frame")])
@pytest.mark.loop_timeout(20)
async def test_a_value_above_the_consumer_s_max_payload_fails_the_connection(cluster, size, frame) -> None:  # type: ignore[no-untyped-def]
    # max_payload is the largest value a peer may send.  A Send-Driven value of 16 KiB or
    # less travels packed in a DATA_MANY frame, a larger one in a DATA frame: both are a
    # ProtocolError that closes the connection, and the producer sees it reset.
    async with pair(cluster, "send", ps={"max_payload": 1000}) as (w, p):
        await w.send(key("warm"), np.arange(2))
        assert (await p.recv(key("warm"), timeout=5)).tolist() == [0, 1]
        waiting = asyncio.ensure_future(p.recv(key("big"), timeout=10))
        back = asyncio.ensure_future(w.recv(key("back", src=PS, dst=WORKER), timeout=10))
        await settle()
        await w.send(key("big"), np.zeros(size, np.uint8))  # it left: the send returns
        with pytest.raises(rvz.PeerLost) as info:
            await waiting
        assert isinstance(info.value.__cause__, rvz.ProtocolError)
        assert f"{frame} for key {key('big')}: payload of {size} bytes exceeds the limit of 1000" \
            in str(info.value)
        with pytest.raises(rvz.PeerLost):  # the producer's recv from the consumer
            await back
        # Nothing of it was delivered; values within the limit go on a new connection.
        await w.send(key("after"), np.arange(1000, dtype=np.uint8))
        assert (await p.recv(key("after"), timeout=5)).nbytes == 1000
        with pytest.raises(TimeoutError):
            await p.recv(key("big"), timeout=0.2)


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_masked_array_is_refused_at_the_call_other_subclasses_go(run, cluster, mode, tmp_path) -> None:  # type: ignore[no-untyped-def]
    # A masked array's buffer is its data alone: it went as a plain array, its mask
    # silently dropped.  Every send refuses it, naming what to send instead; np.matrix and
    # np.memmap are their values and go as before.
    masked = np.ma.masked_array(np.arange(3.0), mask=[False, True, False])
    mapped = np.memmap(tmp_path / "values", np.float32, "w+", shape=(4,))
    mapped[:] = np.arange(4)

    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            for value in (masked, np.ma.masked_array(np.arange(2), mask=False), np.ma.masked):
                with pytest.raises(TypeError, match=r"masked arrays \(numpy\.ma.*filled") as info:
                    await w.send(key("m"), value)
                assert "mask" in str(info.value)
                with pytest.raises(TypeError, match=r"masked arrays \(numpy\.ma.*filled"):
                    await w.send_many([(key("m"), np.arange(1)), (key("m"), value)])
                # send_many checks every value first: none of its pairs was sent (the next
                # value the consumer gets is the one below)
            await w.send(key("m"), masked.filled(-1.0))
            assert (await p.recv(key("m"), timeout=5)).tolist() == [0.0, -1.0, 2.0]
            await w.send(key("m"), np.matrix([[1, 2], [3, 4]]))
            await w.send_many([(key("m"), mapped)])
            got = await p.recv(key("m"), timeout=5)
            assert type(got) is np.ndarray and got.tolist() == [[1, 2], [3, 4]]
            got = await p.recv(key("m"), timeout=5)
            assert type(got) is np.ndarray and got.tolist() == [0.0, 1.0, 2.0, 3.0]
            with pytest.raises(TimeoutError):
                await p.recv(key("m"), timeout=0.2)
    run(main())


@pytest.mark.filterwarnings("ignore:the matrix subclass:PendingDeprecationWarning")
@pytest.mark.parametrize("batch", [False, True])
@pytest.mark.parametrize("mode", ["recv", "send"])
def test_a_key_to_the_same_node_delivers_the_types_a_peer_would(run, cluster, mode, batch) -> None:  # type: ignore[no-untyped-def]
    # A bytearray or memoryview arrives as bytes and an array subclass as a plain ndarray,
    # from a peer.  A key whose src and dst are one node handed the sent object over as it
    # was: a bytearray, a memoryview of the sender's buffer, an np.matrix.
    mine = key("own", src=WORKER, dst=WORKER)
    buffer = bytearray(b"mutable")
    values = [buffer, memoryview(b"a view"), memoryview(bytes(range(10)))[::2],
              memoryview(np.arange(3, dtype=np.int16)), np.matrix([[1, 2], [3, 4]]), b"bytes"]
    expected = [b"mutable", b"a view", bytes(range(0, 10, 2)),
                np.arange(3, dtype=np.int16).tobytes(), [[1, 2], [3, 4]], b"bytes"]

    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            for where, node, k in (("peer", p, key("own")), ("local", w, mine)):
                if batch:
                    await w.send_many([(k, v) for v in values])
                    got = await node.recv_many([k] * len(values), timeout=5)
                else:
                    got = []
                    for v in values:
                        await w.send(k, v)
                        got.append(await node.recv(k, timeout=5))
                for value, want in zip(got, expected, strict=True):
                    if isinstance(want, bytes):
                        assert type(value) is bytes and value == want, where
                    else:
                        assert type(value) is np.ndarray and value.tolist() == want, where
            buffer[:] = b"changed"  # what a local recv got was the bytes sent, not the buffer
            assert got[0] == b"mutable"
    run(main())


@pytest.mark.loop_timeout(30)
async def test_steps_used_once_leave_no_state_behind(cluster) -> None:  # type: ignore[no-untyped-def]
    """Applications name steps by a counter.  A step's table goes once it is empty, and
    nothing else the step left may grow with the steps ever used: the idle clock of a step
    cleaned up (``Steps.idle_since``) stayed, and so did who took part in every step
    (``Steps.step_peers``, kept to relay a late clean-up).  The peers of the last retired
    steps are kept (``Steps.retired_max``, 8 here), the others forgotten."""
    async with pair(cluster, "recv", heartbeat=0.02) as (w, p):
        w._core.steps.retired_max = p._core.steps.retired_max = 8
        for s in range(1, 31):
            await w.step(s).send(key("x"), np.arange(1))
            if s % 2:
                await asyncio.sleep(0.05)   # held across heartbeats: the step's idle clock runs
            assert (await p.step(s).recv(key("x"), timeout=5))[0] == 0
            if s % 3 == 0:
                await w.step(s).cleanup()

        def settled(node: rvz.Node) -> bool:
            core = node._core
            return (not set(core.steps.tables) - {0} and not core.steps.idle_since
                    and len(core.steps.step_peers) - len(core.steps.tables) <= 8)

        await eventually(lambda: settled(w) and settled(p), "the finished steps were forgotten")
        # The steps remembered are the latest ones, and a late clean-up still reaches the
        # consumer through them (it cleans up its step 29 when told).
        latest = [s for s in range(1, 31) if s % 3][-8:]   # a clean-up forgot its step at once
        assert set(w._core.steps.step_peers) - {0} == set(latest)
        waiting = await pending(p.step(29).recv(key("x"), timeout=5))
        await w.step(29).cleanup()
        with pytest.raises(rvz.Aborted, match="step 29"):
            await waiting


@pytest.mark.loop_timeout(30)
async def test_the_oldest_dead_steps_are_forgotten_first(cluster) -> None:  # type: ignore[no-untyped-def]
    """A cleaned-up step stays dead (its later calls fail) for the last ``Steps.dead_max``
    clean-ups (4 here); older ones are forgotten oldest first, through a queue of their
    own (taking the dict's first key slowed every clean-up once the cap was reached)."""
    async with pair(cluster, "send") as (w, p):
        w._core.steps.dead_max = 4
        for s in range(1, 11):
            await w.step(s).cleanup()
        assert list(w._core.steps.dead_steps) == [7, 8, 9, 10]
        with pytest.raises(rvz.Aborted, match="step 9"):
            await w.step(9).send(key("x"), np.arange(1))
        await w.step(3).send(key("x"), np.arange(1))   # forgotten: a step like any other
        assert (await p.step(3).recv(key("x"), timeout=5))[0] == 0


def new_loop(name: str) -> asyncio.AbstractEventLoop:
    if name == "uvloop":
        import uvloop
        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def _listening(address: str) -> bool:
    """Whether something listens on ``address``: a node could not bind it.  Probed by a
    bind, not a connect, which would leave a connection the server accepted behind."""
    host, port = address.rsplit(":", 1)
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a node binds
        try:
            probe.bind((host, int(port)))
        except OSError:
            return True
        return False


@pytest.mark.parametrize("how", ["close", "abort"])
def test_every_call_a_close_fails_raises_node_closed(run, cluster, how) -> None:  # type: ignore[no-untyped-def]
    """Pending calls (local, remote, batch) and later ones: NodeClosed, an Aborted, naming the
    node once; after abort(exc), exc is the cause.  They raised a plain Aborted."""
    async def main() -> None:
        async with pair(cluster, "recv") as (w, p):
            waiting = [await pending(p.recv(key("r"), timeout=10)),
                       await pending(p.recv(key("local", src=p.name + "/device:CPU:0"), timeout=10)),
                       await pending(p.recv_many([key("m1"), key("m2")], timeout=10))]
            cause = RuntimeError("shutting down")
            if how == "close":
                await p.close()
            else:
                p.abort(cause)
            for task in waiting:
                with pytest.raises(rvz.NodeClosed) as info:
                    await task
                assert str(info.value).count(f"node {p.name}") == 1, info.value
                if how == "abort":
                    assert info.value.__cause__ is cause
            for call in (p.recv(key("r"), timeout=1), p.recv_many([key("r")], timeout=1),
                         p.send(key("b", src=p.name + "/device:CPU:0", dst=WORKER), np.arange(2))):
                with pytest.raises(rvz.NodeClosed) as info:
                    await call
                assert str(info.value).count(f"node {p.name}") == 1, info.value
            del w
    run(main())


def test_start_runs_once_and_leaves_nothing_bound_when_refused(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """A second start() of a running node raised the bind error of its own address (and on
    shm closed the running node's hub); a start() after close() bound the port, then failed
    and left it listening.  Both now fail before anything is bound."""
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            with pytest.raises(rvz.RvzError, match="is running"):
                await p.start()
            await w.send(key("still"), np.arange(3))
            assert (await p.recv(key("still"), timeout=5)).tolist() == [0, 1, 2]
        for node in (w, p):
            assert node.state == "closed"
            with pytest.raises(rvz.RvzError, match="is closed"):
                await node.start()
            assert not _listening(node.address), f"{node.address} listens after a refused start()"
    run(main(), timeout=20)


def test_a_start_cancelled_while_it_binds_leaves_nothing_listening(run, cluster) -> None:  # type: ignore[no-untyped-def]
    """Cancelled at every loop pass of its first few: on asyncio, a cancel that landed after
    create_server had bound lost the server, and the port listened for good; and a cancel
    that returned before the bind did left a server that was closed only later, so the
    next start() of that port could fail to listen."""
    async def main() -> None:
        for passes in range(8):
            node = rvz.Node(cluster, "ps", 0, "recv", **FAST)
            task = asyncio.ensure_future(node.start())
            for _ in range(passes):
                await asyncio.sleep(0)
            task.cancel()
            try:
                await task
            except asyncio.CancelledError:
                assert node.state == "new"
                # the server it made after all is closed before the cancel returned
                assert not _listening(node.address), f"listening after a cancel at pass {passes}"
            else:
                await node.close()  # it completed before the cancel
    run(main(), timeout=20)


@pytest.mark.parametrize("call", ["close", "abort"])
def test_close_and_abort_from_another_thread_raise_and_change_nothing(run, cluster, call) -> None:  # type: ignore[no-untyped-def]
    """They skipped the thread check every other call makes: closed the node from a foreign
    thread (or raised only after aborting it)."""
    async def main() -> None:
        async with pair(cluster, "send") as (w, p):
            errors: list[BaseException] = []

            def foreign() -> None:
                try:
                    if call == "close":
                        asyncio.run(p.close())
                    else:
                        p.abort()
                except BaseException as exc:  # noqa: BLE001 - the test inspects it
                    errors.append(exc)

            thread = threading.Thread(target=foreign)
            thread.start()
            while thread.is_alive():
                await asyncio.sleep(0.01)
            assert len(errors) == 1 and isinstance(errors[0], RuntimeError), errors
            assert p.state == "running"
            await w.send(key("after"), np.arange(2))
            assert (await p.recv(key("after"), timeout=5)).tolist() == [0, 1]
    run(main(), timeout=20)


def test_a_call_on_a_node_whose_loop_has_ended_says_so(cluster, loop_name) -> None:  # type: ignore[no-untyped-def]
    """The advice was run_coroutine_threadsafe on the node's loop, which hangs when that loop
    is closed (a node kept across pytest-asyncio's per-test loops)."""
    node = rvz.Node(cluster, "ps", 0, "recv", **FAST)
    loop = new_loop(loop_name)
    try:
        loop.run_until_complete(node.start())
    finally:
        loop.close()  # the node was never closed: its server and heartbeat die with it

    async def later() -> None:
        with pytest.raises(RuntimeError, match="event loop that is now closed"):
            await node.recv(key("x"), timeout=1)
        with pytest.raises(RuntimeError, match="event loop that is now closed"):
            await node.close()
    asyncio.run(later())


@pytest.mark.parametrize("bad", [{"task": "0"}, {"task": 0.0}, {"task": True}, {"incarnation": -1},
                                 {"incarnation": 1 << 64}, {"incarnation": "x"}, {"incarnation": 1.5}])
def test_task_and_incarnation_the_wire_cannot_carry_are_refused(cluster, bad) -> None:  # type: ignore[no-untyped-def]
    # They were accepted, and every connection of the node failed later (the peer's recv only
    # timed out; 2**64 raised inside an event-loop callback).
    args = {"task": 0, **bad}
    task = args.pop("task")
    with pytest.raises(rvz.ConfigError):
        rvz.Node(cluster, "ps", task, "recv", **args)


@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_a_node_dropped_unclosed_warns_and_gives_its_memory_back(cluster, loop_name, transport) -> None:  # type: ignore[no-untyped-def]
    """Never closed (its loop ended first): no warning said so, and on shm its memory files
    and pipes stayed open for the life of the process once the node was collected."""
    def pool_fds() -> int:
        count = 0
        for fd in os.listdir("/proc/self/fd"):
            try:
                count += "rvz-pool" in os.readlink(f"/proc/self/fd/{fd}")
            except OSError:
                pass
        return count

    before = pool_fds()

    async def main() -> None:
        w = rvz.Node(cluster, "worker", 0, "send", transport=transport, **FAST)
        p = rvz.Node(cluster, "ps", 0, "send", transport=transport, **FAST)
        await w.start()
        await p.start()
        await w.send(key("big"), np.zeros(1 << 20))
        await p.recv(key("big"), timeout=5)

    loop = new_loop(loop_name)
    with pytest.warns(ResourceWarning, match="unclosed node"):
        try:
            loop.run_until_complete(main())
        finally:
            loop.close()
        del loop  # (uvloop's keeps its servers, and through them the nodes)
        gc.collect()
    gc.collect()  # the warning's record held the node (its source) until the block ended
    assert pool_fds() == before


@pytest.mark.parametrize("mode", ["recv", "send"])
def test_timeouts_name_the_step_and_the_producer(run, cluster, mode) -> None:  # type: ignore[no-untyped-def]
    # Neither named the step, and recv_many's did not name the producer it waited for.
    async def main() -> None:
        async with pair(cluster, mode) as (w, p):
            with pytest.raises(TimeoutError) as info:
                await p.step(5).recv(key("late"), timeout=0.1)
            assert f"from {w.name} in step 5 timed out" in str(info.value), info.value
            with pytest.raises(TimeoutError) as info:
                await p.step(5).recv_many([key("a"), key("b")], timeout=0.1)
            assert f"recv_many of 2 keys in step 5 from {w.name} timed out" in str(info.value), info.value
            with pytest.raises(TimeoutError) as info:
                await p.recv(key("late"), timeout=0.1)
            assert "step" not in str(info.value), info.value
    run(main())


def _first_step(coro: Any) -> str:
    """Run a coroutine up to its first suspension, without a loop: what it does at once."""
    try:
        coro.send(None)
    except StopIteration:
        return "returned"
    except BaseException as exc:
        return f"{type(exc).__name__}: {exc}"
    coro.close()
    return "suspended"


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("mode", ["send", "recv"])
@pytest.mark.loop_timeout(20)
async def test_a_forked_child_cannot_use_or_close_the_parents_nodes(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    """A process forks while its nodes run.  The child's copies share the parent's sockets:
    a send there wrote a value into the parent's connection (or held it in a copy of the
    table, unseen), and close() wrote BYE and shut the socket down under the parent.  Now
    every call in the child raises RuntimeError saying so, close() and abort() there touch
    nothing, and the parent's nodes go on as if the child had never been."""

    async with pair(cluster, mode) as (w, p):
        await w.send(key("f"), np.full(1 << 16, -1.0))
        assert (await p.recv(key("f"), timeout=5))[0] == -1.0  # linked both ways
        read_end, write_end = os.pipe()
        pid = os.fork()
        if pid == 0:  # the child: never back into the test's loop or pytest
            status = 1
            try:
                os.close(read_end)
                steps = [_first_step(w.send(key("f"), np.full(1 << 16, 7.0))),
                         _first_step(p.recv(key("f"))),
                         _first_step(p.recv_many([key("f")])),
                         _first_step(w.close()), _first_step(p.close())]
                w.abort()
                p.abort()
                os.write(write_end, "\n".join(steps).encode())
                status = 0
            finally:
                os._exit(status)
        os.close(write_end)
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):
                await asyncio.sleep(0.01)
            with os.fdopen(read_end, "rb") as f:
                steps = f.read().decode().split("\n")
        finally:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        for said in steps[:3]:
            assert said.startswith("RuntimeError") and "forked" in said, steps
        assert steps[3:] == ["returned", "returned"], steps
        # The parent: its connections carry its own values only, both ways, and stay up.
        await w.send(key("f"), np.full(1 << 16, 1.0))
        got = await p.recv(key("f"), timeout=5)
        assert got[0] == 1.0
        with pytest.raises(TimeoutError):
            await p.recv(key("f"), timeout=0.3)  # nothing from the child behind it
        await p.send(key("back", src=PS, dst=WORKER), b"back")
        assert await w.recv(key("back", src=PS, dst=WORKER), timeout=5) == b"back"
        assert w.stats()["peers"][p.name]["state"] == "connected"
        assert p.stats()["peers"][w.name]["state"] == "connected"


_REPO = Path(__file__).resolve().parent.parent
_CLOSED_LOOP_SCRIPT = """
import asyncio, gc, sys
import rvz
print(rvz.implementation(), flush=True)
loop_name, mode, call = sys.argv[1:]
cluster = rvz.ClusterSpec.loopback({"worker": 1, "ps": 1})
def key(name):
    return rvz.Key("/job:worker/replica:0/task:0/device:CPU:0",
                   "/job:ps/replica:0/task:0/device:CPU:0", name)
loop = rvz.new_event_loop(loop_name)
async def begin():
    w = rvz.Node(cluster, job="worker", task=0)
    p = rvz.Node(cluster, job="ps", task=0)
    await w.start()
    await p.start()
    await w.send(key("linked"), b"x", mode=mode)
    await p.recv(key("linked"), mode=mode, timeout=5)
    if call == "recv":
        task = asyncio.ensure_future(p.recv(key("never"), mode=mode))
    else:
        task = asyncio.ensure_future(p.recv_many([key("never"), key("nor")], mode=mode))
    await asyncio.sleep(0.2)
    return w, p, task
nodes = loop.run_until_complete(begin())
loop.close()   # nodes still open, the recv still waiting: the application's mistake
del nodes
gc.collect()
print("collected", flush=True)
"""


@pytest.mark.parametrize("mode", ["recv", "send"])
@pytest.mark.parametrize("call", ["recv", "recv_many"])
def test_a_loop_closed_under_a_waiting_recv_leaves_no_error_from_rvz(loop_name, tmp_path, mode,
                                                                     call) -> None:  # type: ignore[no-untyped-def]
    """An application closes its loop while a recv still waits and its nodes are open (a
    test that forgot to close them, say).  asyncio says the task was destroyed pending, as
    it should; rvz's clean-up of that recv then tried to write its CANCEL through the
    closed loop, and Python printed that error as "Exception ignored".  Nothing can be
    written once the loop is closed: the clean-up now leaves the wire alone."""
    script = tmp_path / "closed_loop.py"
    script.write_text(_CLOSED_LOOP_SCRIPT)
    done = run_python([str(script), loop_name, mode, call], cwd=str(_REPO), timeout=30)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == [rvz.implementation(), "collected"], done.stdout
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]


@pytest.mark.loop_timeout(20)
async def test_stats_count_credit_stalls_and_errors_by_type(cluster) -> None:  # type: ignore[no-untyped-def]
    # A consumer that takes nothing fills its producer's push window: the next pushes wait
    # for credit, and its peer entry counts each.  A connection the consumer then fails for
    # a protocol violation counts once under "protocol" at both ends.
    async with pair(cluster, "send", worker={"push_window": 4096}) as (w, p):
        assert w.stats()["errors"] == dict.fromkeys(("protocol", "auth", "timeout", "reset",
                                                     "peer_lost"), 0)
        value = np.zeros(1024, np.uint8)
        await w.send(key(), value)  # the link is up: from now on only credit holds pushes back
        await p.recv(key(), timeout=5)
        sends = [asyncio.ensure_future(w.send(key(), value)) for _ in range(6)]

        def stalls() -> int:
            peer = w.stats()["peers"].get("/job:ps/replica:0/task:0")
            return 0 if peer is None else peer["credit_stalls"]

        await eventually(lambda: stalls() >= 3, "credit stalls")
        for _ in range(6):
            await p.recv(key(), timeout=5)
        await asyncio.gather(*sends)
        assert 3 <= stalls() <= 6, stalls()
        conn = next(c for c in p._conns if c.ready)
        conn.fail(rvz.ProtocolError("a test's violation"))
        await eventually(lambda: p.stats()["errors"]["protocol"] == 1, "counted here")
        await eventually(lambda: w.stats()["errors"]["protocol"] == 1, "counted by the peer")
