"""The in-process table (TF LocalRendezvous semantics): rvz.Rendezvous and the raw Table."""

from __future__ import annotations

import asyncio

import pytest

import rvz
from rvz import _impl

from .conftest import key

K = key("local")
OTHER = key("other")


async def settle() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.loop_timeout(5)
async def test_send_before_recv() -> None:
    rv = rvz.Rendezvous()
    rv.send(K, "v1")
    assert rv.pending(K) == (1, 0)
    assert await rv.recv(K) == "v1"
    assert rv.pending(K) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_recv_before_send() -> None:
    rv = rvz.Rendezvous()
    task = asyncio.ensure_future(rv.recv(K))
    await settle()
    assert not task.done()
    assert rv.pending(K) == (0, 1)
    rv.send(K, "v1")
    assert await task == "v1"
    assert rv.pending(K) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_keys_are_independent_and_string_form_meets_key() -> None:
    rv = rvz.Rendezvous()
    rv.send(K, 1)
    rv.send(OTHER, 2)
    assert await rv.recv(str(OTHER)) == 2
    assert await rv.recv(str(K)) == 1


@pytest.mark.loop_timeout(5)
async def test_fifo_sends_first() -> None:
    rv = rvz.Rendezvous()
    for i in range(50):
        rv.send(K, i)
    assert [await rv.recv(K) for _ in range(50)] == list(range(50))


@pytest.mark.loop_timeout(5)
async def test_fifo_recvs_first() -> None:
    rv = rvz.Rendezvous()
    tasks = []
    for _ in range(50):
        tasks.append(asyncio.ensure_future(rv.recv(K)))
        await asyncio.sleep(0)  # each recv registers in order
    assert rv.pending(K) == (0, 50)
    for i in range(50):
        rv.send(K, i)
    assert await asyncio.gather(*tasks) == list(range(50))


@pytest.mark.loop_timeout(5)
async def test_cancel_removes_only_that_waiter() -> None:
    rv = rvz.Rendezvous()
    first = asyncio.ensure_future(rv.recv(K))
    await settle()
    second = asyncio.ensure_future(rv.recv(K))
    await settle()
    third = asyncio.ensure_future(rv.recv(K))
    await settle()
    second.cancel()
    await settle()
    assert second.cancelled()
    assert rv.pending(K) == (0, 2)
    rv.send(K, "a")
    rv.send(K, "b")
    assert await first == "a"
    assert await third == "b"
    assert rv.pending(K) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_cancel_of_first_waiter_next_send_goes_to_next() -> None:
    rv = rvz.Rendezvous()
    first = asyncio.ensure_future(rv.recv(K))
    await settle()
    second = asyncio.ensure_future(rv.recv(K))
    await settle()
    first.cancel()
    await settle()
    rv.send(K, "x")
    assert await second == "x"
    assert rv.pending(K) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_timeout_behaves_like_cancel() -> None:
    rv = rvz.Rendezvous()
    timed = asyncio.ensure_future(rv.recv(K, timeout=0.05))
    await settle()
    patient = asyncio.ensure_future(rv.recv(K))
    await settle()
    with pytest.raises(TimeoutError) as info:
        await timed
    assert type(info.value) is TimeoutError  # the built-in, not an rvz class
    assert str(K) in str(info.value)
    assert rv.pending(K) == (0, 1)
    rv.send(K, "v")
    assert await patient == "v"
    assert rv.pending(K) == (0, 0)


@pytest.mark.loop_timeout(5)
async def test_timeout_with_value_already_there_returns_it() -> None:
    rv = rvz.Rendezvous()
    rv.send(K, 7)
    assert await rv.recv(K, timeout=0.01) == 7


@pytest.mark.loop_timeout(5)
async def test_cancel_after_delivery_puts_value_back_at_head() -> None:
    rv = rvz.Rendezvous()
    first = asyncio.ensure_future(rv.recv(K))
    await settle()
    rv.send(K, "a")       # delivered to first's waiter ...
    rv.send(K, "b")       # ... and b is queued behind it
    first.cancel()        # ... but first is cancelled before it ran
    with pytest.raises(asyncio.CancelledError):
        await first
    assert rv.pending(K) == (2, 0)
    assert await rv.recv(K) == "a"   # not lost, and still ahead of b
    assert await rv.recv(K) == "b"


@pytest.mark.loop_timeout(5)
async def test_cancel_after_delivery_hands_value_to_next_waiter() -> None:
    rv = rvz.Rendezvous()
    first = asyncio.ensure_future(rv.recv(K))
    await settle()
    second = asyncio.ensure_future(rv.recv(K))
    await settle()
    rv.send(K, "a")
    first.cancel()
    with pytest.raises(asyncio.CancelledError):
        await first
    assert await asyncio.wait_for(second, 2) == "a"


@pytest.mark.loop_timeout(5)
async def test_abort_fails_pending_and_later_ops_with_cause() -> None:
    rv = rvz.Rendezvous()
    rv.send(OTHER, "dropped")
    waiters = [asyncio.ensure_future(rv.recv(K)) for _ in range(3)]
    await settle()
    cause = ValueError("the root cause")
    rv.abort(cause)
    assert rv.aborted
    for waiter in waiters:
        with pytest.raises(rvz.Aborted) as info:
            await waiter
        assert info.value.__cause__ is cause
        assert str(K) in str(info.value)
    with pytest.raises(rvz.Aborted) as info:
        rv.send(K, 1)
    assert info.value.__cause__ is cause
    with pytest.raises(rvz.Aborted) as info:
        await rv.recv(OTHER)  # its queued value was dropped by the abort
    assert info.value.__cause__ is cause
    assert str(OTHER) in str(info.value)
    # A second abort does not replace the first cause.
    rv.abort(RuntimeError("later"))
    with pytest.raises(rvz.Aborted) as info:
        await rv.recv(K)
    assert info.value.__cause__ is cause


@pytest.mark.loop_timeout(5)
async def test_empty_batches_fail_after_abort_as_any_call() -> None:
    # send_many([]) returned as if it had sent, and abort() without a cause said "None".
    rv = rvz.Rendezvous()
    rv.abort()
    with pytest.raises(rvz.Aborted, match="^rendezvous aborted$"):
        rv.send_many([])
    with pytest.raises(rvz.Aborted, match="^rendezvous aborted$"):
        await rv.recv_many([])


@pytest.mark.loop_timeout(5)
async def test_abort_is_immediate() -> None:
    rv = rvz.Rendezvous()
    waiter = asyncio.ensure_future(rv.recv(K))
    await settle()
    rv.abort(KeyError("x"))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert waiter.done()
    assert isinstance(waiter.exception(), rvz.Aborted)


async def test_abort_under_rvz_error() -> None:
    assert issubclass(rvz.Aborted, rvz.RvzError)


# -- the raw Table (compiled or pure Python, whichever is active) ------------------------------


class FakeWaiter:
    """A future-shaped object the table knows nothing more of."""

    def __init__(self) -> None:
        self.result: object = None
        self.exc: BaseException | None = None
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, value: object) -> None:
        assert not self._done
        self._done = True
        self.result = value

    def set_exception(self, exc: BaseException) -> None:
        assert not self._done
        self._done = True
        self.exc = exc


class TableWaiter(FakeWaiter, _impl.table.Waiter):
    """The same, as a ``Waiter`` (the engine's parked requests and ``recv_many``'s slots
    are): compiled, the table calls its methods through C, which must reach these."""


async def test_table_holds_values_or_waiters_never_both() -> None:
    table = _impl.table.Table()
    k = str(K)
    assert table.take(k) is _impl.table.EMPTY
    w1, w2 = FakeWaiter(), TableWaiter()
    assert table.take_or_wait(k, w1) is _impl.table.EMPTY
    assert table.take_or_wait(k, w2) is _impl.table.EMPTY
    assert (table.queued(k), table.waiting(k)) == (0, 2)
    assert table.put(k, 1) is True and w1.result == 1
    assert table.put(k, 2) is True and w2.result == 2
    assert (table.queued(k), table.waiting(k)) == (0, 0)
    assert table.put(k, 3) is False
    assert table.take_or_wait(k, FakeWaiter()) == 3
    assert (table.queued(k), table.waiting(k)) == (0, 0)


async def test_tables_match_a_model_under_random_operations() -> None:
    """Random puts, takes, waits, withdrawn or cancelled waiters and values put back at the
    front, on several keys of several tables, against a plain model of per-key FIFOs.  A
    key's queue comes and goes with its values and waiters (a lone waiter is kept without
    a queue), and emptied queues are reused across keys and tables: none may carry
    anything over."""
    import random

    rng = random.Random(7)
    tables = [_impl.table.Table() for _ in range(3)]
    keys = [f"k{i}" for i in range(5)]
    values: dict[tuple[int, str], list[object]] = {}   # the model: queued values ...
    waiters: dict[tuple[int, str], list[FakeWaiter]] = {}  # ... or live waiters, in order
    counter = 0
    for _ in range(20000):
        t, k = rng.randrange(len(tables)), rng.choice(keys)
        table, vs, ws = tables[t], values.setdefault((t, k), []), waiters.setdefault((t, k), [])
        op = rng.random()
        if op < 0.35:  # put: to the oldest waiter, else queued
            counter += 1
            taken = table.put(k, counter)
            assert taken == bool(ws)
            if ws:
                assert ws.pop(0).result == counter
            else:
                vs.append(counter)
        elif op < 0.6:  # take
            got = table.take(k)
            assert got == (vs.pop(0) if vs else _impl.table.EMPTY)
        elif op < 0.85:  # take, else wait (either kind of waiter)
            w = FakeWaiter() if rng.random() < 0.5 else TableWaiter()
            got = table.take_or_wait(k, w)
            if vs:
                assert got == vs.pop(0)
            else:
                assert got is _impl.table.EMPTY
                ws.append(w)
        elif op < 0.9:  # a waiter withdrawn (a cancelled recv)
            if ws:
                w = ws.pop(rng.randrange(len(ws)))
                assert table.remove_waiter(k, w) is True
        elif op < 0.95:  # a waiter done elsewhere and left in place: puts skip it
            if ws:
                ws.pop(rng.randrange(len(ws)))._done = True
        else:  # a value given back ahead of the others (to the oldest waiter, if any)
            counter += 1
            assert table.put_front(k, counter) == bool(ws)
            if ws:
                assert ws.pop(0).result == counter
            else:
                vs.insert(0, counter)
        assert (table.queued(k), table.waiting(k)) == (len(vs), len(ws))
    for (t, k), vs in values.items():
        assert [tables[t].take(k) for _ in vs] == vs
        assert tables[t].take(k) is _impl.table.EMPTY


async def test_table_skips_done_waiters_and_removes_one() -> None:
    table = _impl.table.Table()
    k = str(K)
    w1, w2, w3 = FakeWaiter(), FakeWaiter(), FakeWaiter()
    for w in (w1, w2, w3):
        table.take_or_wait(k, w)
    w1._done = True                 # cancelled elsewhere, still in the deque
    assert table.remove_waiter(k, w2) is True
    assert table.remove_waiter(k, w2) is False
    assert table.waiting(k) == 1
    assert table.put(k, "v") is True
    assert w3.result == "v" and w2.result is None
    assert table.keys_waiting() == []


async def test_table_gives_a_value_past_a_cancelled_lone_future() -> None:
    """With the loop's futures as waiters (what a node's recv parks), a lone waiter that
    was cancelled and is still in the table refuses the value, which is queued for the next
    recv; a live one takes it."""
    loop = asyncio.get_running_loop()
    table = _impl.table.Table()
    k = str(K)
    cancelled = loop.create_future()
    assert table.take_or_wait(k, cancelled) is _impl.table.EMPTY
    cancelled.cancel()
    assert table.put(k, 1) is False
    assert (table.queued(k), table.waiting(k)) == (1, 0)
    live = loop.create_future()
    assert table.take_or_wait(k, live) == 1
    assert table.take_or_wait(k, live) is _impl.table.EMPTY
    assert table.put(k, 2) is True and live.result() == 2


async def test_table_put_front_restores_order() -> None:
    table = _impl.table.Table()
    k = str(K)
    table.put(k, "b")
    table.put(k, "c")
    table.put_front(k, "a")
    assert [table.take(k) for _ in range(3)] == ["a", "b", "c"]
    w = FakeWaiter()
    table.take_or_wait(k, w)
    assert table.put_front(k, "z") is True and w.result == "z"


async def test_table_fail_waiters_keeps_key_usable() -> None:
    table = _impl.table.Table()
    k = str(K)
    w1, w2 = FakeWaiter(), FakeWaiter()
    table.take_or_wait(k, w1)
    table.take_or_wait(k, w2)
    assert table.fail_waiters(k, lambda: rvz.PeerLost("gone")) == 2
    assert isinstance(w1.exc, rvz.PeerLost) and isinstance(w2.exc, rvz.PeerLost)
    assert w1.exc is not w2.exc
    assert table.put(k, 1) is False and table.take(k) == 1


async def test_table_abort_returns_dropped_values_and_fails_waiters() -> None:
    table = _impl.table.Table()
    a, b = str(K), str(OTHER)
    table.put(a, 1)
    table.put(a, 2)
    w = FakeWaiter()
    table.take_or_wait(b, w)
    cause = OSError("disk on fire")
    dropped = table.abort("step 3 aborted", cause)
    assert sorted(dropped) == [(a, 1), (a, 2)]
    assert isinstance(w.exc, rvz.Aborted) and w.exc.__cause__ is cause
    assert "step 3 aborted" in str(w.exc) and b in str(w.exc)
    assert table.aborted
    for op in (lambda: table.put(a, 3), lambda: table.take(a),
               lambda: table.take_or_wait(a, FakeWaiter())):
        with pytest.raises(rvz.Aborted) as info:
            op()
        assert info.value.__cause__ is cause
    assert table.put_front(a, 9) is False
    assert table.abort("again", None) == []


@pytest.mark.loop_timeout(5)
async def test_waiter_timeout_and_cancel_give_the_value_back() -> None:
    """arm_timeout fails a parked waiter naming the key and its source; give_back returns
    a value delivered to a waiter whose recv was cancelled to the head of the queue."""
    tbl = _impl.table

    async def wait(table, k, waiter, timers, timeout):  # type: ignore[no-untyped-def]
        stamp = table.stamp
        handle = tbl.arm_timeout(timers, timeout, table, k, waiter, "a producer")
        try:
            return await waiter
        except BaseException:
            tbl.give_back(table, k, waiter, stamp)
            raise
        finally:
            if handle is not None:
                handle.cancel()

    loop = asyncio.get_running_loop()
    timers = _impl.deadlines.Deadlines(loop)
    table = tbl.Table()
    k = str(K)
    w1 = loop.create_future()
    table.take_or_wait(k, w1)
    with pytest.raises(TimeoutError) as info:
        await wait(table, k, w1, timers, 0.02)
    assert k in str(info.value) and "a producer" in str(info.value)
    assert table.waiting(k) == 0
    w2 = loop.create_future()
    table.take_or_wait(k, w2)
    task = asyncio.ensure_future(wait(table, k, w2, timers, None))
    await settle()
    table.put(k, "v")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert table.take(k) == "v"


@pytest.mark.loop_timeout(5)
async def test_key_strings_parsed_once_stay_exact_past_the_cache_bound(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A Rendezvous remembers the canonical form of key strings it parsed: a bad string still
    fails every time, and when more keys come than it keeps, it starts over without losing
    a value or mixing keys up."""
    monkeypatch.setattr(rvz.rendezvous, "TEXTS_MAX", 4)
    rv = rvz.Rendezvous()
    keys = [str(key(f"k{i}")) for i in range(10)]
    for rounds in range(2):
        for i, text in enumerate(keys):
            rv.send(text, (rounds, i))
        assert len(rv._texts) <= 4
    for i, text in enumerate(keys):
        assert [await rv.recv(text, timeout=1) for _ in range(2)] == [(0, i), (1, i)]
        assert rv.pending(key(f"k{i}")) == (0, 0)  # the Key and its string: one queue
    for _ in range(2):
        with pytest.raises(ValueError):
            rv.send("not a key", 1)
    assert "not a key" not in rv._texts


@pytest.mark.loop_timeout(10)
async def test_a_send_from_another_thread_is_refused_while_a_recv_waits() -> None:
    """A recv waits on the test's loop; a send from another thread handed it the value
    without waking the loop (it woke at the recv's timeout, or never; in debug mode the
    send raised half-way and the recv never woke).  Now such a call raises RuntimeError
    and changes nothing, and the way it names works."""

    rv = rvz.Rendezvous()
    waiting = asyncio.ensure_future(rv.recv(K, timeout=8))
    await settle()
    errors: list[BaseException] = []

    def other_thread() -> None:
        for call in (lambda: rv.send(K, "t"), lambda: rv.send_many([(K, "t")]),
                     lambda: rv.abort(ValueError("t"))):
            try:
                call()
            except BaseException as exc:
                errors.append(exc)

    await asyncio.to_thread(other_thread)
    assert len(errors) == 3 and all(isinstance(e, RuntimeError) for e in errors), errors
    assert "call_soon_threadsafe" in str(errors[0])
    assert rv.pending(K) == (0, 1) and not rv.aborted and not waiting.done()
    loop = asyncio.get_running_loop()
    await asyncio.to_thread(loop.call_soon_threadsafe, rv.send, K, "v")
    assert await asyncio.wait_for(waiting, 2) == "v"


def test_a_rendezvous_outlives_the_loop_it_waited_on() -> None:
    """Used by one ``asyncio.run`` after another (each recv waiting), from one thread."""
    rv = rvz.Rendezvous()

    async def exchange(value: str) -> str:
        waiting = asyncio.ensure_future(rv.recv(K, timeout=5))
        await settle()
        rv.send(K, value)
        return await waiting

    for loop in ("asyncio", "uvloop", "asyncio"):
        assert rvz.run(exchange(loop), loop=loop) == loop  # type: ignore[arg-type]
