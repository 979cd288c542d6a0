"""Two nodes over TCP on loopback, in Recv-Driven and Send-Driven mode.

The producer of ``key()`` is worker/0 and its consumer ps/0; ``back()`` goes the other way.
"""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import rvz

from .conftest import FAST, PS, WORKER, eventually, key, pair, pending, settle

MODES = ["recv", "send"]


def back(name: str = "b", **kw: object) -> rvz.Key:
    return key(name, src=PS, dst=WORKER, **kw)  # type: ignore[arg-type]


def table(node: rvz.Node, step: int = 0):  # type: ignore[no-untyped-def]
    return node._tables.get(step)


def queued(node: rvz.Node, k: rvz.Key, step: int = 0) -> int:
    t = table(node, step)
    return 0 if t is None else int(t.queued(str(k)))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_send_before_recv(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        await w.send(key(), np.arange(5, dtype=np.int32))
        got = await p.recv(key(), timeout=5)
        assert got.dtype == np.int32 and got.tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_recv_before_send(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        task = await pending(p.recv(key(), timeout=10))
        await w.send(key(), np.array([7.5]))
        assert (await task).tolist() == [7.5]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_ping_pong_through_two_keys(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        async def ponger() -> None:
            for _ in range(30):
                value = await p.recv(key("ping"), timeout=5)
                await p.send(back("pong"), value + 1)

        task = asyncio.ensure_future(ponger())
        value = np.zeros(3, np.int64)
        for i in range(30):
            await w.send(key("ping"), value)
            value = await w.recv(back("pong"), timeout=5)
            assert value.tolist() == [i + 1] * 3
        await task


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_fifo_of_n_values(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        # Some recvs wait before the sends, the rest find their values queued.
        early = [asyncio.ensure_future(p.recv(key(), timeout=10)) for _ in range(20)]
        await settle()
        for i in range(100):
            await w.send(key(), np.array([i]))
        late = [await p.recv(key(), timeout=10) for _ in range(80)]
        got = [int(v[0]) for v in await asyncio.gather(*early)] + [int(v[0]) for v in late]
        assert got == list(range(100))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_bytes_and_sizes_interleaved_keep_order(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        sizes = [0, 1, 70000, 10, 300000, 5, 2 << 20, 3]
        for i, n in enumerate(sizes):
            await w.send(key(), np.full(n, i, np.uint8))
        for i, n in enumerate(sizes):
            got = await p.recv(key(), timeout=10)
            assert got.shape == (n,) and (n == 0 or int(got[0]) == i and int(got[-1]) == i)


@pytest.mark.loop_timeout(15)
async def test_per_call_mode_override_to_send(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        await w.send(key(), np.arange(3), mode="send")
        # Pushed: it reaches the consumer's table without any recv asking for it.
        await eventually(lambda: queued(p, key()) == 1, "the push arrived")
        assert queued(w, key()) == 0
        got = await p.recv(key(), mode="send", timeout=5)
        assert got.tolist() == [0, 1, 2]


@pytest.mark.loop_timeout(15)
async def test_per_call_mode_override_to_recv(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send", claim_timeout=None) as (w, p):
        await w.send(key(), np.arange(3), mode="recv")
        # Held by the producer until the consumer asks for it.
        assert queued(w, key()) == 1
        await asyncio.sleep(0.1)
        assert queued(p, key()) == 0
        got = await p.recv(key(), mode="recv", timeout=5)
        assert got.tolist() == [0, 1, 2]
        assert queued(w, key()) == 0


def spelled(mode: str) -> str:
    """The mode as a string built at run time: equal to the literal, not the same object."""
    built = "".join(list(mode))
    assert built == mode and built is not mode
    return built


@pytest.mark.loop_timeout(15)
async def test_modes_spelled_at_run_time_behave_as_the_literals(cluster) -> None:  # type: ignore[no-untyped-def]
    # The engine tests modes by identity once it has made them its own constants: a mode
    # read from a config file or built by a program must be the same mode.
    async with pair(cluster, spelled("recv"), claim_timeout=None) as (w, p):
        pushed, pulled = key("pushed"), key("pulled")
        await w.send(pushed, np.arange(2), mode=spelled("send"))
        await eventually(lambda: queued(p, pushed) == 1, "the push arrived")
        await w.send(pulled, np.arange(3))  # the node's default, Recv-Driven: held
        assert queued(w, pulled) == 1 and queued(p, pulled) == 0
        assert (await p.recv(pulled, mode=spelled("recv"), timeout=5)).tolist() == [0, 1, 2]
        assert (await p.recv(pushed, mode=spelled("send"), timeout=5)).tolist() == [0, 1]


@pytest.mark.loop_timeout(15)
async def test_bad_mode_is_refused(cluster) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError):
        rvz.Node(cluster, "ps", 0, mode="pull")
    async with pair(cluster, "recv") as (w, p):
        with pytest.raises(ValueError):
            await w.send(key(), np.arange(1), mode="push")
        with pytest.raises(ValueError):
            await p.recv(key(), mode="push", timeout=1)
        # the refused recv left no waiter behind
        await w.send(key(), np.arange(2))
        assert (await p.recv(key(), timeout=5)).tolist() == [0, 1]


@pytest.mark.loop_timeout(15)
async def test_both_modes_on_different_keys_in_one_cluster(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv", claim_timeout=None) as (w, p):
        pulled, pushed = key("pulled"), key("pushed")
        for i in range(10):
            await w.send(pulled, np.array([i]), mode="recv")
            await w.send(pushed, np.array([100 + i]), mode="send")
        await eventually(lambda: queued(p, pushed) == 10, "all pushes arrived")
        assert queued(w, pulled) == 10 and queued(p, pulled) == 0
        a = [int((await p.recv(pulled, mode="recv", timeout=5))[0]) for _ in range(10)]
        b = [int((await p.recv(pushed, mode="send", timeout=5))[0]) for _ in range(10)]
        assert a == list(range(10)) and b == list(range(100, 110))


# -- the two sides disagree on a key's mode -------------------------------------------------


@pytest.mark.loop_timeout(15)
async def test_producer_pushes_consumer_requests(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        k = key("mixed")
        # consumer asks first, then the producer pushes
        task = await pending(p.recv(k, mode="recv", timeout=5))
        await w.send(k, np.array([1]), mode="send")
        assert (await task).tolist() == [1]
        # producer pushes first, then the consumer asks
        for i in range(5):
            await w.send(k, np.array([10 + i]), mode="send")
        got = [int((await p.recv(k, mode="recv", timeout=5))[0]) for _ in range(5)]
        assert sorted(got) == list(range(10, 15))
        # nothing left over and nothing duplicated: the next value is the next one sent
        await asyncio.sleep(0.1)
        assert queued(p, k) == 0 and queued(w, k) == 0
        await w.send(k, np.array([99]), mode="send")
        assert (await p.recv(k, mode="recv", timeout=5)).tolist() == [99]
        with pytest.raises(TimeoutError):
            await p.recv(k, mode="recv", timeout=0.2)


@pytest.mark.loop_timeout(15)
async def test_producer_holds_consumer_waits_locally(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send", claim_timeout=0.2, heartbeat=0.05) as (w, p):
        k = key("held")
        # consumer waits first (no request crosses the wire), producer holds
        task = await pending(p.recv(k, mode="send", timeout=5))
        await w.send(k, np.array([1]), mode="recv")
        assert (await task).tolist() == [1]   # pushed after claim_timeout
        # producer holds first, then the consumer waits locally
        for i in range(3):
            await w.send(k, np.array([10 + i]), mode="recv")
        got = [int((await p.recv(k, mode="send", timeout=5))[0]) for _ in range(3)]
        assert sorted(got) == [10, 11, 12]
        assert queued(w, k) == 0 and w._held_count == 0



@pytest.mark.loop_timeout(15)
@pytest.mark.parametrize("first_ask", ["recv call", "handshake"])
async def test_held_values_of_a_key_asked_for_once_are_still_pushed(cluster, first_ask) -> None:  # type: ignore[no-untyped-def]
    # A request for a key defers the push of its other held values (its consumer pulls the
    # key, and will ask for them too): to claim_timeout after that request, not for good. A
    # consumer that asked once, then waits locally (its recvs say mode="send"; or it asked
    # only because the handshake told it the producer holds), still gets them all.
    k = key("asked-once")
    consumer_mode = "recv" if first_ask == "recv call" else "send"
    async with rvz.Node(cluster, "worker", 0, "recv", **FAST) as w:
        for i in range(3):
            await w.send(k, np.array([i]))            # held: nobody is connected yet
        async with rvz.Node(cluster, "ps", 0, consumer_mode, **FAST) as p:
            # The handshake's ask (a Send-Driven node meeting one that holds) or this recv's
            # own request takes the first value.
            got = [int((await p.recv(k, mode="recv" if first_ask == "recv call" else "send",
                                     timeout=5))[0])]
            got += [int((await p.recv(k, mode="send", timeout=5))[0]) for _ in range(2)]
            assert got == [0, 1, 2]
            assert queued(w, k) == 0 and w._held_count == 0

# -- values -----------------------------------------------------------------------------------

VALUES = [
    np.array([True, False]),
    np.arange(-4, 4, dtype=np.int8),
    np.arange(6, dtype=np.uint16).reshape(2, 3),
    np.array([-(2 ** 63), 2 ** 63 - 1], dtype=np.int64),
    np.array([2 ** 64 - 1], dtype=np.uint64),
    np.array([1.5, -2], dtype=np.float16),
    np.linspace(0, 1, 7, dtype=np.float32),
    np.array([np.nan, np.inf, -0.0]),
    np.array([1 + 2j], dtype=np.complex64),
    np.array([[3 - 4j]], dtype=np.complex128),
    np.array(42),
    np.array(2.5, dtype=np.float32),
    np.zeros((0,), np.float64),
    np.zeros((2, 0, 3), np.int32),
    np.arange(24, dtype=np.int16).reshape(2, 3, 4)[:, ::2, 1:],   # non-contiguous
    np.arange(10, dtype=">i4"),                                  # big-endian
    b"",
    b"raw bytes \x00\xff",
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_values_of_every_kind(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        for value in VALUES:
            await w.send(key(), value)
        for value in VALUES:
            got = await p.recv(key(), timeout=5)
            if isinstance(value, bytes):
                assert type(got) is bytes and got == value
            else:
                assert got.shape == value.shape
                assert got.dtype == value.dtype.newbyteorder("=")  # native order on arrival
                np.testing.assert_array_equal(got, value)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(20)
async def test_multi_mib_array(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    value = np.random.default_rng(3).standard_normal((1024, 1024))  # 8 MiB
    big_bytes = bytes(range(256)) * 8192                           # 2 MiB
    async with pair(cluster, mode) as (w, p):
        task = asyncio.ensure_future(p.recv(key(), timeout=10))
        await w.send(key(), value)
        await w.send(key(), big_bytes)
        got = await task
        np.testing.assert_array_equal(got, value)
        assert await p.recv(key(), timeout=10) == big_bytes


@pytest.mark.loop_timeout(15)
async def test_object_dtype_is_refused_before_anything_is_sent(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send") as (w, p):
        with pytest.raises(TypeError):
            await w.send(key(), np.array([{}], dtype=object))
        with pytest.raises(TypeError):
            await w.send(key(), [1, 2])
        await w.send(key(), np.arange(2))
        assert (await p.recv(key(), timeout=5)).tolist() == [0, 1]


# -- endpoints, cancel, timeout ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_wrong_endpoint_names_the_key(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        k = key("misrouted")
        with pytest.raises(rvz.WrongEndpoint) as info:
            await p.send(k, np.arange(1))       # ps is not the key's source
        assert str(k) in str(info.value)
        with pytest.raises(rvz.WrongEndpoint) as info:
            await w.recv(k, timeout=1)           # worker is not the key's destination
        assert str(k) in str(info.value)
        with pytest.raises(rvz.WrongEndpoint):
            await w.recv(str(k), timeout=1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_local_key_on_one_node(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, _):
        k = key("self", dst=WORKER)
        task = await pending(w.recv(k, timeout=5))
        await w.send(k, np.arange(2))
        await w.send(k, np.arange(3))
        assert (await task).tolist() == [0, 1]
        assert (await w.recv(k, timeout=5)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_cancel_pending_remote_recv_next_send_goes_to_next_waiter(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        first = await pending(p.recv(key(), timeout=10))
        second = await pending(p.recv(key(), timeout=10))
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        await asyncio.sleep(0.05)  # the cancel reaches the producer
        await w.send(key(), np.array([1]))
        assert (await second).tolist() == [1]
        # and nothing was lost or duplicated
        await w.send(key(), np.array([2]))
        assert (await p.recv(key(), timeout=5)).tolist() == [2]
        await asyncio.sleep(0.1)
        assert queued(p, key()) == 0 and queued(w, key()) == 0


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_cancel_all_pending_remote_recvs_then_send(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        tasks = [asyncio.ensure_future(p.recv(key(), timeout=10)) for _ in range(3)]
        await asyncio.sleep(0.1)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.sleep(0.05)
        await w.send(key(), np.array([5]))
        assert (await p.recv(key(), timeout=5)).tolist() == [5]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_timeout_on_remote_recv(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        with pytest.raises(TimeoutError) as info:
            await p.recv(key(), timeout=0.1)
        assert type(info.value) is TimeoutError
        assert str(key()) in str(info.value) and w.name in str(info.value)
        # the timed-out recv is gone: the next value goes to the next recv
        task = await pending(p.recv(key(), timeout=5))
        await w.send(key(), np.array([3]))
        assert (await task).tolist() == [3]
        await asyncio.sleep(0.05)
        assert queued(p, key()) == 0 and queued(w, key()) == 0


class _Looked:
    """A waiter put in a key's queue by hand, done already (no value goes to it), that
    counts how often the table looks at it: asks whether it is done, or compares it with
    another waiter (``deque.remove`` walks a key's waiters from the oldest)."""

    def __init__(self) -> None:
        self.asked = 0
        self.compared = 0

    def done(self) -> bool:
        self.asked += 1
        return True

    def __eq__(self, other: object) -> bool:
        self.compared += 1
        return other is self

    __hash__ = object.__hash__


@pytest.mark.loop_timeout(20)
async def test_many_recvs_of_one_key_cost_each_the_same(cluster) -> None:  # type: ignore[no-untyped-def]
    """n recvs waiting on one key cost n times one, not n * n: a recv that ends does not walk
    the key's other waiters (``Core.rebalance`` asked each one whether it was done), and
    the producer finds a cancelled request, the newest, without walking the key's parked
    requests from the oldest.  (10k recvs of one key took 42 to 122 us each.)"""
    n = 40
    async with pair(cluster, "recv") as (w, p):
        k = key("shared")
        text = str(k)
        # Answered: each recv's clean-up looks at no other waiter of the key.
        tasks = [asyncio.ensure_future(p.recv(k, timeout=10)) for _ in range(n)]
        await eventually(lambda: len(p._core.requests.by_id) == n, "every recv asked")
        behind = _Looked()
        table(p).wait(text, behind)   # behind the n recvs
        for i in range(n):   # one at a time: each recv ends while the others still wait
            await w.send(k, np.array([i]))
            assert int((await tasks[i])[0]) == i
        assert behind.asked == 0, f"the key's waiters were walked {behind.asked} times"
        table(p).remove_waiter(text, behind)
        # Timed out: each recv cancels the newest request, which the producer finds first.
        ahead = _Looked()
        w._core.steps.table(0).wait(text, ahead)   # ahead of the n requests it parks
        tasks = [asyncio.ensure_future(p.recv(k, timeout=0.3)) for _ in range(n)]
        for result in await asyncio.gather(*tasks, return_exceptions=True):
            assert isinstance(result, TimeoutError)
        await eventually(lambda: not any(c.parked for c in w._conns), "every request cancelled")
        assert ahead.compared == 0, f"the parked requests were walked {ahead.compared} times"
        w._core.steps.table(0).remove_waiter(text, ahead)


# -- steps ---------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_steps_are_separate_scopes(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        await w.step(1).send(key(), np.array([1]))
        await w.step(2).send(key(), np.array([2]))
        await w.send(key(), np.array([0]))
        assert (await p.step(2).recv(key(), timeout=5)).tolist() == [2]
        assert (await p.recv(key(), timeout=5)).tolist() == [0]
        assert (await p.step(1).recv(key(), timeout=5)).tolist() == [1]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("by", ["consumer", "producer"])
@pytest.mark.loop_timeout(15)
async def test_step_cleanup_aborts_the_step_on_both_nodes(cluster, mode, by) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        ws, ps = w.step(7), p.step(7)
        # both nodes take part in step 7
        await ws.send(key("x"), np.array([1]))
        assert (await ps.recv(key("x"), timeout=5)).tolist() == [1]
        on_ps = await pending(ps.recv(key("y"), timeout=10))
        on_w = await pending(ws.recv(back("z"), timeout=10))
        # another step is not affected
        other = await pending(p.step(8).recv(key("y"), timeout=10))
        cleaner = p if by == "consumer" else w
        await cleaner.step(7).cleanup("failed on purpose")
        for task in (on_ps, on_w):
            with pytest.raises(rvz.Aborted) as info:
                await task
            # the step and who cleaned it up lead, then the caller's text: on both nodes, in
            # both modes (a Recv-Driven consumer's led with "<producer> could not answer")
            said = str(info.value)
            assert said.startswith(f"step 7 was cleaned up by {cleaner.name} (incarnation "
                                   f"{cleaner.incarnation:#x}): failed on purpose"), said
        with pytest.raises(rvz.Aborted):
            await ws.send(key("x"), np.array([2]))
        with pytest.raises(rvz.Aborted):
            await ps.recv(key("x"), timeout=1)
        with pytest.raises(rvz.Aborted):
            await ps.send(back("z"), np.array([2]))
        with pytest.raises(rvz.Aborted):
            await ws.recv(back("z"), timeout=1)
        assert not other.done()
        await w.step(8).send(key("y"), np.array([8]))
        assert (await other).tolist() == [8]


@pytest.mark.loop_timeout(15)
async def test_cleanup_drops_held_and_pushed_values(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv", claim_timeout=None) as (w, p):
        await w.step(3).send(key("held"), np.zeros(1000), mode="recv")
        await w.step(3).send(key("pushed"), np.zeros(1000), mode="send")
        await eventually(lambda: queued(p, key("pushed"), 3) == 1, "the push arrived")
        assert w._held_count == 1
        await p.step(3).recv(key("pushed"), timeout=5)
        await w.step(3).cleanup()
        assert w._held_count == 0 and w._held_bytes == 0
        await eventually(lambda: 3 not in p._tables, "the consumer dropped step 3")
        with pytest.raises(rvz.Aborted):
            await p.step(3).recv(key("held"), timeout=1)


# -- node abort ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_node_abort_fails_pending_ops_with_cause(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        waits = [await pending(p.recv(key(f"k{i}"), timeout=10)) for i in range(2)]
        local = await pending(p.recv(key("l", src=PS), timeout=10))
        cause = RuntimeError("the real reason")
        p.abort(cause)
        assert p.state == "closed"
        for task in waits + [local]:
            with pytest.raises(rvz.Aborted) as info:
                await task
            assert info.value.__cause__ is cause
        with pytest.raises(rvz.Aborted) as info:
            await p.recv(key(), timeout=1)
        assert info.value.__cause__ is cause
        assert str(key()) in str(info.value)
        with pytest.raises(rvz.Aborted):
            await p.send(back(), np.arange(1))
        # the peer notices: its ops on the aborted node fail instead of hanging
        with pytest.raises(rvz.PeerLost):
            await w.recv(back(), timeout=5)


@pytest.mark.loop_timeout(15)
async def test_async_with_aborts_on_error(cluster) -> None:  # type: ignore[no-untyped-def]
    node = rvz.Node(cluster, "ps", 0)
    with pytest.raises(KeyError):
        async with node:
            raise KeyError("boom")
    assert node.state == "closed"
    with pytest.raises(rvz.Aborted) as info:
        await node.recv(key(), timeout=1)
    assert isinstance(info.value.__cause__, KeyError)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.loop_timeout(15)
async def test_key_naming_a_task_outside_the_cluster(cluster, mode) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, mode) as (w, p):
        stranger = key("stranger", src="/job:nope/replica:0/task:0/device:CPU:0")
        with pytest.raises(rvz.WrongEndpoint) as info:
            await p.recv(stranger, timeout=1)
        assert str(stranger) in str(info.value) and "/job:nope" in str(info.value)
        t = table(p)
        assert t is None or t.waiting(str(stranger)) == 0   # no waiter left behind
        lost = key("lost", dst="/job:ps/replica:0/task:9/device:CPU:0")
        with pytest.raises(rvz.WrongEndpoint) as info:
            await w.send(lost, np.arange(1))
        assert str(lost) in str(info.value)


@pytest.mark.loop_timeout(15)
async def test_remote_step_abort_names_the_peer(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "recv") as (w, p):
        await w.step(4).send(key(), np.arange(1))
        await p.step(4).recv(key(), timeout=5)
        waiting = await pending(w.step(4).recv(back(), timeout=10))
        await p.step(4).cleanup("custom reason")
        with pytest.raises(rvz.Aborted) as info:
            await waiting
        message = str(info.value)
        assert "custom reason" in message and p.name in message and str(back()) in message
        assert isinstance(info.value.__cause__, rvz.RemoteError)
        assert info.value.__cause__.peer == p.name


@pytest.mark.parametrize("consumer_first", [False, True])
async def test_default_modes_that_disagree_need_no_claim_timeout(cluster, consumer_first) -> None:
    # The producer node holds (Recv-Driven), the consumer node waits locally (Send-Driven)
    # and unclaimed values are never pushed: the consumer must ask, having learned the
    # producer's default mode from its HELLO.
    settings = {**FAST, "claim_timeout": None}
    async with rvz.Node(cluster, "worker", 0, "recv", **settings) as w, \
            rvz.Node(cluster, "ps", 0, "send", **settings) as p:
        if consumer_first:
            waiting = await pending(p.recv(key("x"), timeout=5))
            await w.send(key("x"), np.arange(4))
            got = await waiting
        else:
            await w.send(key("x"), np.arange(4))
            got = await p.recv(key("x"), timeout=5)
        assert got.tolist() == [0, 1, 2, 3]
        # and again once both sides know each other
        await w.send(key("x"), np.arange(2))
        assert (await p.recv(key("x"), timeout=5)).tolist() == [0, 1]
        assert not w._held_count
