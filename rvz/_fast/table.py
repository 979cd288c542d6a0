"""The per-key rendezvous table: where a value meets its receiver.

For each key the table holds a FIFO of values that wait for a receiver, or a FIFO of
waiters that wait for a value, never both.  A waiter is anything shaped like an
``asyncio.Future`` (``done``, ``set_result``, ``set_exception``): a local ``recv``'s
future, or the parked request of a remote consumer.  A waiter already done (cancelled, timed
out, its connection gone) is skipped, so a cancel never loses a value.

rvz runs on one event loop thread, so the table needs no lock: callbacks run from
``set_result`` after the table's state is already consistent.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import Aborted

EMPTY = object()  # what take() returns when no value is queued


class Table:
    """Per-key FIFO of values or waiters, with abort (TF LocalRendezvous)."""

    __slots__ = ("_values", "_waiters", "_abort_cause", "_abort_message")

    def __init__(self) -> None:
        self._values: dict[str, deque[Any]] = {}   # key -> values nobody received yet
        self._waiters: dict[str, deque[Any]] = {}  # key -> waiters no value reached yet
        self._abort_cause: Any = None
        self._abort_message: Any = None

    def aborted_error(self, key: str) -> Aborted:
        """A fresh ``Aborted`` for ``key`` carrying the abort's original cause."""
        err = Aborted(f"{self._abort_message} (key {key})")
        err.__cause__ = self._abort_cause
        return err

    @property
    def aborted(self) -> bool:
        return self._abort_message is not None

    def put(self, key: str, value: object) -> bool:
        """Give ``value`` to the oldest live waiter, else queue it.  True if it was taken."""
        if self._abort_message is not None:
            raise self.aborted_error(key)
        waiters = self._waiters.get(key)
        if waiters is not None:
            while waiters:
                waiter = waiters.popleft()
                if not waiter.done():
                    if not waiters:
                        del self._waiters[key]
                    waiter.set_result(value)
                    return True
            del self._waiters[key]
        values = self._values.get(key)
        if values is None:
            self._values[key] = deque((value,))
        else:
            values.append(value)
        return False

    def put_front(self, key: str, value: object) -> bool:
        """Return a value whose receiver went away after it was delivered.

        It goes to the next waiter or back to the head of the queue, so FIFO order holds.
        """
        if self._abort_message is not None:
            return False
        waiters = self._waiters.get(key)
        if waiters:
            return self.put(key, value)
        values = self._values.get(key)
        if values is None:
            self._values[key] = deque((value,))
        else:
            values.appendleft(value)
        return False

    def take(self, key: str) -> object:
        """Pop the oldest queued value of ``key``, or return ``EMPTY``."""
        if self._abort_message is not None:
            raise self.aborted_error(key)
        values = self._values.get(key)
        if values is None:
            return EMPTY
        value = values.popleft()
        if not values:
            del self._values[key]
        return value

    def take_or_wait(self, key: str, waiter: object) -> object:
        """Pop the oldest value of ``key``; if there is none, queue ``waiter`` and return EMPTY."""
        if self._abort_message is not None:
            raise self.aborted_error(key)
        values = self._values.get(key)
        if values is not None:
            value = values.popleft()
            if not values:
                del self._values[key]
            return value
        waiters = self._waiters.get(key)
        if waiters is None:
            self._waiters[key] = deque((waiter,))
        else:
            waiters.append(waiter)
        return EMPTY

    def remove_waiter(self, key: str, waiter: object) -> bool:
        """Drop one waiter (a cancelled or timed-out recv); later values skip it."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return False
        try:
            waiters.remove(waiter)
        except ValueError:
            return False
        if not waiters:
            del self._waiters[key]
        return True

    def waiting(self, key: str) -> int:
        """How many live waiters ``key`` has."""
        waiters = self._waiters.get(key)
        if waiters is None:
            return 0
        n = 0
        for waiter in waiters:
            if not waiter.done():
                n += 1
        return n

    def queued(self, key: str) -> int:
        values = self._values.get(key)
        return 0 if values is None else len(values)

    def restore(self, key: str, values: list) -> list:
        """Give back values, oldest first, that a batch had taken and no longer wants.

        They go to the key's live waiters in order, and what is left to the head of its
        queue, so FIFO order holds.  Returns the values that went back to the queue (nothing
        after an abort: they are dropped).
        """
        if self._abort_message is not None:
            return []
        n = len(values)
        i = 0
        while i < n and self.waiting(key):
            self.put(key, values[i])
            i += 1
        if i == n:
            return []
        rest = values[i:]
        queue = self._values.get(key)
        if queue is None:
            self._values[key] = deque(rest)
        else:
            queue.extendleft(reversed(rest))
        return rest

    def keys_waiting(self) -> list:
        return list(self._waiters)

    def fail_waiters(self, key: str, exc_factory: Any) -> int:
        """Fail every live waiter of ``key`` with ``exc_factory()``; the key stays usable."""
        waiters = self._waiters.pop(key, None)
        if waiters is None:
            return 0
        n = 0
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(exc_factory())
                n += 1
        return n

    def abort(self, message: str, cause: Any) -> list:
        """Fail every pending waiter and every later operation with ``Aborted``.

        Returns the ``(key, value)`` pairs that were queued and are now dropped, so the
        owner can release what they held.  A second abort keeps the first cause.
        """
        if self._abort_message is not None:
            return []
        self._abort_message = message
        self._abort_cause = cause
        dropped = []
        for key, values in self._values.items():
            for value in values:
                dropped.append((key, value))
        self._values.clear()
        waiters_by_key = self._waiters
        self._waiters = {}
        for key, waiters in waiters_by_key.items():
            for waiter in waiters:
                if not waiter.done():
                    waiter.set_exception(self.aborted_error(key))
        return dropped


class Slot:
    """One position of a ``Batch`` waiting in a key's queue, shaped like a future."""

    __slots__ = ("batch", "index", "filled")

    def __init__(self, batch: Batch, index: int) -> None:
        self.batch = batch
        self.index = index
        self.filled = False

    def done(self) -> bool:
        return self.filled or self.batch.future.done()

    def set_result(self, value: Any) -> None:
        self.filled = True
        batch = self.batch
        batch.values[self.index] = value
        batch.missing -= 1
        if batch.missing == 0 and not batch.future.done():
            batch.future.set_result(batch.values)

    def set_exception(self, exc: BaseException) -> None:
        if not self.batch.future.done():
            self.batch.future.set_exception(exc)


class Batch:
    """One ``recv_many`` on one table: the values it has and a future for the rest.

    All or nothing: ``restore()`` gives every value it took back to its key, in order, when
    the batch fails, times out or is cancelled.
    """

    __slots__ = ("table", "keys", "values", "missing", "future", "slots")

    def __init__(self, table: Table, keys: list, values: list, missing: int, future: Any) -> None:
        self.table = table
        self.keys = keys
        self.values = values
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
                if value is EMPTY:
                    self.slots.append(slot)
                    waiting.append(i)
                else:  # cannot happen on one thread, but costs nothing to handle
                    slot.set_result(value)
        return waiting

    def restore(self) -> list:
        """Undo the batch: drop its waiters and give its values back.

        Returns the ``(key, value)`` pairs that went back to a queue (their consumption is
        undone), not those another waiter took.
        """
        table = self.table
        for slot in self.slots:
            if not slot.filled:
                table.remove_waiter(self.keys[slot.index], slot)
        by_key: dict = {}
        values = self.values
        keys = self.keys
        for i in range(len(keys)):
            value = values[i]
            if value is not EMPTY:
                values[i] = EMPTY
                got = by_key.get(keys[i])
                if got is None:
                    by_key[keys[i]] = [value]
                else:
                    got.append(value)
        queued = []
        for key, got in by_key.items():
            for value in table.restore(key, got):
                queued.append((key, value))
        return queued


async def wait_value(table: Table, key: str, waiter: Any, loop: Any, timeout: Any,
                     describe: str) -> Any:
    """Await ``waiter`` (already queued in ``table``) with an optional timeout.

    If the caller is cancelled after the value was delivered, the value goes back to the
    head of the queue: a cancel after delivery changes nothing for the other receivers.
    """
    handle = None
    if timeout is not None:
        handle = loop.call_later(timeout, _expire, table, key, waiter, timeout, describe)
    try:
        return await waiter
    except BaseException:
        if waiter.done() and not waiter.cancelled():
            if waiter.exception() is None:
                table.put_front(key, waiter.result())
        else:
            table.remove_waiter(key, waiter)
        raise
    finally:
        if handle is not None:
            handle.cancel()


def _expire(table: Table, key: str, waiter: Any, timeout: Any, describe: str) -> None:
    if not waiter.done():
        table.remove_waiter(key, waiter)
        waiter.set_exception(TimeoutError(f"{describe} timed out after {timeout}s"))
