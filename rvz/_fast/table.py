"""The per-key rendezvous table: where a value meets its receiver.

For each key the table holds a FIFO of values that wait for a receiver, or a FIFO of
waiters that wait for a value, never both.  A waiter is anything shaped like an
``asyncio.Future`` (``done``, ``set_result``, ``set_exception``): a local ``recv``'s
future, or a ``Waiter`` (the parked request of a remote consumer, a ``recv_many``'s
slot).  A waiter already done (cancelled, timed out, its connection gone) is skipped, so a
cancel never loses a value.

rvz runs on one event loop thread, so the table needs no lock: callbacks run from
``set_result`` after the table's state is already consistent.

A value can come back after it was delivered (its recv was cancelled, or a batch failed
before it resumed).  Every take and every waiter gets a stamp, in the order values leave the
key's queue; a value that comes back is put ahead of the values never delivered, in stamp
order among those that came back, so FIFO holds however many come back in what order.  A
value that came back keeps its stamp when it is taken again (``took``): a fresh one would
place it behind the others that came back with it, should it come back once more.
"""

from __future__ import annotations

from asyncio import Future, InvalidStateError
from bisect import bisect_left
from collections import deque
from typing import Any
from weakref import WeakKeyDictionary

from ..errors import Aborted

EMPTY = object()  # what take() returns when no value is queued
SPARE = 1024  # emptied queues kept for reuse, across the process's tables

# A key's queue comes and goes with every value of a stream (a waiter, then its value):
# emptied deques are kept here for the next key rather than freed and made again.
# (One thread at a time per table; list.pop and list.append are atomic among threads.)
_spare: list = []


def check_timeout(timeout: Any) -> None:
    """Refuse a timeout that is neither None nor a number of seconds >= 0 (NaN too)."""
    if timeout is not None and not timeout >= 0:
        raise ValueError(f"timeout must be None or >= 0 seconds, not {timeout!r}")


def seconds(timeout: Any) -> str:
    """A duration for a message: at most three decimals (a timeout left over from a
    deadline is 9.896000000000186 seconds, said as 9.896)."""
    t = float(timeout)
    if t != 0 and abs(t) < 0.001:
        return f"{t:.1g}"
    return f"{t:.3f}".rstrip("0").rstrip(".")


def aborted_error(message: str, cause: Any, key: str, kind: Any = Aborted) -> Aborted:
    """The ``Aborted`` (``kind``: the class, an ``Aborted``) every operation on ``key`` of an
    aborted table (or step) fails with."""
    err = kind(message + naming(key) if key else message)
    err.__cause__ = cause
    return err


def naming(key: str) -> str:
    """What ``aborted_error`` adds to the message to name the key (a parked remote request
    strips it: the consumer names the key itself)."""
    return f" (key {key})"


class Waiter:
    """A waiter that is not an asyncio future: a ``recv_many``'s ``Slot`` here, a remote
    consumer's parked request in the engine.  Compiled, the table calls ``done`` and
    ``set_result`` of these as C methods; a future's are looked up by name on every call."""

    __slots__ = ()

    def done(self) -> bool:
        raise NotImplementedError

    def set_result(self, value: Any) -> None:
        raise NotImplementedError

    def set_exception(self, exc: BaseException) -> None:
        raise NotImplementedError


class Table:
    """Per-key FIFO of values or waiters, with abort (TF LocalRendezvous)."""

    __slots__ = ("_values", "_waiters", "_abort_cause", "_abort_message", "_abort_kind", "_back",
                 "stamp", "took", "puts", "_handed")

    def __init__(self) -> None:
        self._values: dict[str, deque[Any]] = {}   # key -> values nobody received yet
        # key -> waiters no value reached yet: the waiter itself while it is the only one
        # (the usual case: a recv waits, its value comes), a deque of them when there are more
        self._waiters: dict[str, Any] = {}
        self._abort_cause: Any = None
        self._abort_message: Any = None
        self._abort_kind: Any = Aborted
        # key -> stamps of the values at the head of its queue that came back (ascending)
        self._back: dict[str, list] = {}
        self.stamp = 0  # the last stamp given, to a take or a queued waiter
        self.took = 0   # the stamp of the value the last take returned (see ``take``)
        self.puts = 0   # values put (with ``stamp``, a mark of activity)
        self._handed: Any = None  # recv future -> stamp of the value it took (``handed``)

    def _queue(self, item: Any) -> deque:
        """A new queue holding ``item``, from the spares when there is one."""
        if _spare:
            queue = _spare.pop()
            queue.append(item)
            return queue
        return deque((item,))

    def _retire(self, queue: Any) -> None:
        """``queue`` is empty and out of the table: keep it for reuse."""
        if len(_spare) < SPARE:
            _spare.append(queue)

    def aborted_error(self, key: str) -> Aborted:
        """A fresh ``Aborted`` for ``key`` carrying the abort's original cause."""
        return aborted_error(self._abort_message, self._abort_cause, key, self._abort_kind)

    @property
    def aborted(self) -> bool:
        return self._abort_message is not None

    def put(self, key: str, value: object) -> bool:
        """Give ``value`` to the oldest live waiter, else queue it.  True if it was taken."""
        if self._abort_message is not None:
            raise self.aborted_error(key)
        self.puts += 1
        if self._waiters and self._hand(key, value) is not None:
            return True
        values = self._values.get(key)
        if values is None:
            self._values[key] = self._queue(value)
        else:
            values.append(value)
        return False

    def _hand(self, key: str, value: object) -> Any:
        """Give ``value`` to the oldest live waiter of ``key``, dropping those already done
        on the way; returns that waiter, or None if there was none (the caller queues it)."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return None
        if type(waiters) is not deque:  # one waiter
            del self._waiters[key]
            if type(waiters) is Future:
                # An asyncio future refuses a result once it is done (a cancelled recv's),
                # so it is not asked done() first: that is a method call on every delivery.
                # Other waiters (a parked request) are asked.
                try:
                    waiters.set_result(value)
                    return waiters
                except InvalidStateError:
                    return None
            if isinstance(waiters, Waiter):
                waiter = waiters
                if not waiter.done():
                    waiter.set_result(value)
                    return waiter
            elif not waiters.done():
                waiters.set_result(value)
                return waiters
            return None
        while waiters:
            other = waiters.popleft()
            if not other.done():
                if not waiters:
                    del self._waiters[key]
                    self._retire(waiters)
                other.set_result(value)
                return other
        del self._waiters[key]  # only waiters already done
        self._retire(waiters)
        return None

    def put_front(self, key: str, value: object) -> bool:
        """Return a value ahead of every other (to the next waiter, else the queue's head)."""
        return self.put_back(key, value, -1)

    def put_back(self, key: str, value: object, stamp: int) -> bool:
        """Return a value delivered under ``stamp`` whose receiver went away.

        It goes to the next waiter, or back into the queue ahead of the values never
        delivered and after those that came back with a smaller stamp.  True if a waiter
        took it.
        """
        if self._abort_message is not None:
            return False
        if key in self._waiters:
            waiter = self._hand(key, value)
            if waiter is not None:
                self.puts += 1
                self._restamp(waiter, stamp)
                return True
            # (only waiters already done: the value goes to its place in the queue)
        values = self._values.get(key)
        if values is None:
            values = self._values[key] = deque()
        stamps = self._back.get(key)
        if stamps is None:
            self._back[key] = [stamp]
            values.appendleft(value)
        else:
            i = bisect_left(stamps, stamp)
            stamps.insert(i, stamp)
            values.insert(i, value)
        return False

    def _restamp(self, waiter: Any, stamp: int) -> None:
        """``waiter`` took a value that came back under ``stamp``: should it come back once
        more, it goes back under that stamp, not under the waiter's own (a later one, which
        would place it behind values that came back after it was first taken)."""
        if type(waiter) is Slot:
            slot: Slot = waiter
            slot.batch.stamps[slot.index] = stamp
        elif type(waiter) is Future:  # a recv's; see ``handed``
            if self._handed is None:
                self._handed = WeakKeyDictionary()
            self._handed[waiter] = stamp
        # (a remote consumer's parked request: its value is written out, never given back)

    def handed(self, waiter: Any, stamp: int) -> int:
        """The stamp to give back the value of the recv future ``waiter``, queued under
        ``stamp``: the stamp of the value it took if that value had come back (``put_back``).
        (Weakly keyed: the entry goes with the future, when its recv completes.)"""
        if self._handed is None:
            return stamp
        return self._handed.pop(waiter, stamp)

    def _took_back(self, key: str, fresh: int) -> int:
        """The head of ``key``'s queue left: its stamp if it was a value that came back
        (which it takes along), else ``fresh``."""
        stamps = self._back.get(key)
        if stamps is None:
            return fresh
        stamp = stamps.pop(0)
        if not stamps:
            del self._back[key]
        return stamp

    def take(self, key: str) -> object:
        """Pop the oldest queued value of ``key``, or return ``EMPTY``; ``took`` is then the
        stamp to give it back under."""
        if self._abort_message is not None:
            raise self.aborted_error(key)
        values = self._values.get(key)
        if values is None:
            return EMPTY
        value = values.popleft()
        if not values:
            del self._values[key]
            self._retire(values)
        self.stamp += 1
        self.took = self._took_back(key, self.stamp) if self._back else self.stamp
        return value

    def take_or_wait(self, key: str, waiter: object) -> object:
        """Pop the oldest value of ``key``; if there is none, queue ``waiter`` and return EMPTY."""
        value = self.take(key)
        if value is EMPTY:
            self.wait(key, waiter)
        return value

    def wait(self, key: str, waiter: object) -> None:
        """Queue ``waiter`` for the next value of ``key`` (the caller's ``take`` found none)."""
        self.stamp += 1
        waiters = self._waiters.get(key)
        if waiters is None:
            self._waiters[key] = waiter
        elif type(waiters) is deque:
            waiters.append(waiter)
        else:  # a second waiter
            queue = self._queue(waiters)
            queue.append(waiter)
            self._waiters[key] = queue

    def head_waiter(self, key: str) -> Any:
        """The oldest waiter of ``key`` still waiting (the next value goes to it), or None."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return None
        for waiter in _each(waiters):
            if not waiter.done():
                return waiter
        return None

    def remove_waiter(self, key: str, waiter: object) -> bool:
        """Drop one waiter (a cancelled or timed-out recv); later values skip it."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return False
        if type(waiters) is not deque:
            if waiters is not waiter:
                return False
            del self._waiters[key]
            return True
        # The newest is looked at first: a consumer cancels its newest requests first
        # (``Requests.rebalance``), and a search from the oldest walked all of the key's waiters.
        # (``len - 1``: the compiled module takes no negative index.)
        if waiters[len(waiters) - 1] is waiter:
            waiters.pop()
        else:
            try:
                waiters.remove(waiter)
            except ValueError:
                return False
        if not waiters:
            del self._waiters[key]
            self._retire(waiters)
        return True

    def waiting(self, key: str) -> int:
        """How many live waiters ``key`` has."""
        if not self._waiters:  # (a producer's table has none: its sends ask this first)
            return 0
        waiters = self._waiters.get(key)
        if waiters is None:
            return 0
        n = 0
        for waiter in _each(waiters):
            if not waiter.done():
                n += 1
        return n

    def queued_waiters(self, key: str) -> int:
        """How many waiters ``key`` has queued, those already done among them (``waiting``
        asks each one)."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return 0
        return len(waiters) if type(waiters) is deque else 1

    def queued(self, key: str) -> int:
        values = self._values.get(key)
        return 0 if values is None else len(values)

    def queued_keys(self) -> list:
        """The keys that have values queued."""
        return list(self._values)

    def counts(self) -> tuple:
        """``(keys with values, values, keys with waiters, live waiters)``, for stats."""
        values = 0
        for queue in self._values.values():
            values += len(queue)
        waiters = 0
        for key in self._waiters:
            waiters += self.waiting(key)
        return (len(self._values), values, len(self._waiters), waiters)

    def empty(self) -> bool:
        """No value and no waiter: the table may be dropped (it is made again on use)."""
        return not self._values and not self._waiters and self._abort_message is None

    def keys_waiting(self) -> list:
        return list(self._waiters)

    def fail_waiters(self, key: str, exc_factory: Any) -> int:
        """Fail every live waiter of ``key`` with ``exc_factory()``; the key stays usable."""
        waiters = self._waiters.pop(key, None)
        if waiters is None:
            return 0
        n = 0
        for waiter in _each(waiters):
            if not waiter.done():
                waiter.set_exception(exc_factory())
                n += 1
        return n

    def abort(self, message: str, cause: Any, kind: Any = Aborted) -> list:
        """Fail every pending waiter and every later operation with ``Aborted`` (or ``kind``,
        a subclass: ``NodeClosed`` when the node closes).

        Returns the ``(key, value)`` pairs that were queued and are now dropped, so the
        owner can release what they held.  A second abort keeps the first cause.
        """
        if self._abort_message is not None:
            return []
        self._abort_message = message
        self._abort_cause = cause
        self._abort_kind = kind
        dropped = []
        for key, values in self._values.items():
            for value in values:
                dropped.append((key, value))
        self._values.clear()
        self._back.clear()
        waiters_by_key = self._waiters
        self._waiters = {}
        for key, waiters in waiters_by_key.items():
            for waiter in _each(waiters):
                if not waiter.done():
                    waiter.set_exception(self.aborted_error(key))
        return dropped


def _each(waiters: Any) -> Any:
    """The waiters of a key as an iterable (one is kept alone, more in a deque)."""
    return waiters if type(waiters) is deque else (waiters,)


class Slot(Waiter):
    """One position of a ``Batch`` waiting in a key's queue, shaped like a future."""

    __slots__ = ("batch", "index", "filled")

    def __init__(self, batch: Batch, index: int) -> None:
        self.batch = batch
        self.index = index
        self.filled = False


    def done(self) -> bool:
        # Only a filled slot is done.  A slot of a batch that already failed (cancelled, timed
        # out) stays live until the batch's ``restore`` takes it out of the queue: the values
        # the batch took go back then, so a value that comes meanwhile must not pass them to
        # a later waiter; it goes to this slot and back with them, in its place.
        return self.filled

    def set_result(self, value: Any) -> None:
        self.filled = True
        batch = self.batch
        batch.values[self.index] = value
        batch.missing -= 1
        if batch.missing == 0:
            # Every slot is filled, so none is in a queue: drop them. A slot refers to its
            # batch, so until then the batch's values live in a reference cycle, and large
            # arrays would keep their receive-pool blocks until the cyclic GC ran.
            batch.slots = []
            if not batch.future.done():
                batch.future.set_result(batch.values)

    def set_exception(self, exc: BaseException) -> None:
        if not self.batch.future.done():
            self.batch.future.set_exception(exc)


class Batch:
    """One ``recv_many`` on one table: the values it has and a future for the rest.

    All or nothing: ``restore()`` gives every value it took back to its key, in order, when
    the batch fails, times out or is cancelled.
    """

    __slots__ = ("table", "keys", "values", "stamps", "missing", "future", "slots")

    def __init__(self, table: Table, keys: list, values: list, stamps: list, missing: int,
                 future: Any) -> None:
        self.table = table
        self.keys = keys
        self.values = values
        self.stamps = stamps  # the stamp of each position's take (``took``) or waiter
        self.missing = missing
        self.future = future
        self.slots: list = []

    def wait(self) -> list:
        """Queue a waiter for every missing position; returns their indexes."""
        table = self.table
        keys = self.keys
        values = self.values
        waiting = []
        for i in range(len(keys)):
            if values[i] is EMPTY:
                slot = Slot(self, i)
                value = table.take_or_wait(keys[i], slot)
                self.stamps[i] = table.stamp if value is EMPTY else table.took
                if value is EMPTY:
                    self.slots.append(slot)
                    waiting.append(i)
                else:  # cannot happen on one thread, but costs nothing to handle
                    slot.set_result(value)
        return waiting

    def restore(self) -> list:
        """Undo the batch: drop its waiters and give its values back (see ``put_back``).

        Returns the ``(key, value)`` pairs that went back to a queue (their consumption is
        undone), not those another waiter took.
        """
        table = self.table
        keys = self.keys
        for slot in self.slots:
            if not slot.filled:
                table.remove_waiter(keys[slot.index], slot)
        values = self.values
        queued = []
        for i in range(len(keys)):
            value = values[i]
            if value is not EMPTY:
                values[i] = EMPTY
                if not table.put_back(keys[i], value, self.stamps[i]):
                    if not table.aborted:
                        queued.append((keys[i], value))
        self.slots = []  # none waits any more (see Slot.set_result)
        return queued


def arm_timeout(timers: Any, timeout: Any, table: Table, key: str, waiter: Any,
                source: Any, step: Any = 0) -> Any:
    """Fail ``waiter`` (queued in ``table``) with ``TimeoutError`` after ``timeout`` seconds;
    returns the deadline (``rvz._fast.deadlines``; ``timers``: the node's), or None without
    a timeout.  ``source`` names the producer, ``step`` the step (0: none to name)."""
    if timeout is None:
        return None
    return timers.arm(timeout, _expire, (table, key, waiter, timeout, source, step))


def give_back(table: Table, key: str, waiter: Any, stamp: int, target: Any = None) -> bool:
    """The recv awaiting ``waiter`` (queued under ``stamp``) failed or was cancelled: drop
    the waiter, or, if a value had already been delivered to it, return the value to the
    next waiter or to its place in the queue.  A cancel after delivery changes nothing for
    the other receivers.  True if the value went back to the queue.  ``target`` is the
    recv's ``into=`` buffer (``rvz._fast.into``): a value landed in it goes back as a copy."""
    if waiter.done() and not waiter.cancelled():
        if waiter.exception() is None:
            stamp = table.handed(waiter, stamp)
            value = waiter.result() if target is None else target.own(waiter.result())
            return not table.put_back(key, value, stamp) and not table.aborted
        return False
    table.remove_waiter(key, waiter)
    return False


async def wait_waiter(table: Table, key: str, waiter: Any, stamp: int, timers: Any, timeout: Any,
                      source: Any) -> Any:
    """Await ``waiter``, queued in ``table`` under ``stamp``, with an optional timeout; a
    failure or a cancel gives a value delivered meanwhile back (see ``give_back``).

    ``Node.recv`` does the same inline (one coroutine per recv less, and it also accounts
    for credit); this is the plain form.
    """
    handle = arm_timeout(timers, timeout, table, key, waiter, source)
    try:
        return await waiter
    except BaseException:
        give_back(table, key, waiter, stamp)
        raise
    finally:
        if handle is not None:
            handle.cancel()


async def wait_batch(batch: Batch, timers: Any, timeout: Any, undone: Any = None,
                     where: Any = None) -> list:
    """Await a ``Batch`` with an optional timeout.  All or nothing: on any failure it is
    restored (``Batch.restore``) and ``undone`` gets the pairs that went back to a queue.
    ``where(keys)`` adds to a timeout's message (the step, the producers of ``keys``)."""
    handle = None
    if timeout is not None:
        handle = timers.arm(timeout, expire_batch, (batch, timeout, where))
    try:
        return await batch.future
    except BaseException:
        if timers.loop.is_closed():
            raise  # collected after its loop closed: nothing can run any more (Node.recv)
        if not batch.future.done():
            batch.future.cancel()
        queued = batch.restore()
        if undone is not None:
            undone(queued)
        raise
    finally:
        if handle is not None:
            handle.cancel()


def _expire(table: Table, key: str, waiter: Any, timeout: Any, source: Any, step: Any) -> None:
    if not waiter.done():
        table.remove_waiter(key, waiter)
        where = (f" from {source}" if source else "") + (f" in step {step}" if step else "")
        waiter.set_exception(TimeoutError(f"recv of {key}{where} timed out after {seconds(timeout)}s"))


def expire_batch(batch: Batch, timeout: Any, where: Any = None) -> None:
    """The callback of a batch's timeout: fail it naming what it waits for."""
    if batch.future.done():
        return
    keys = [batch.keys[slot.index] for slot in batch.slots if not slot.filled]
    shown = ", ".join(keys[:3]) + (f" and {len(keys) - 3} more" if len(keys) > 3 else "")
    context = where(keys) if where is not None else ""
    batch.future.set_exception(TimeoutError(
        f"recv_many of {len(batch.keys)} keys{context} timed out after {seconds(timeout)}s waiting for "
        f"{shown}"))
