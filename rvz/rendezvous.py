"""``rvz.Rendezvous``: the in-process table (TF LocalRendezvous) as a public API."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from threading import get_ident
from typing import Any

from . import _impl
from .types import KeyLike, SendValue, Value

_table = _impl.table
_keys = _impl.keys
_deadlines = _impl.deadlines

# Key strings whose canonical form a Rendezvous remembers (all forgotten when it is full:
# keys change every step, so old ones are not worth an eviction order).
TEXTS_MAX = 65536


class Rendezvous:
    """Keyed FIFO exchange inside one process, on the running event loop.

    ``send`` never blocks; ``recv`` returns at once when a value is queued and otherwise
    waits for the next ``send`` of that key.  ``abort(exc)`` fails every pending and every
    later operation with ``rvz.Aborted`` whose ``__cause__`` is ``exc``.  Values are handed
    over as they are (the table alone: nothing is copied, converted or checked); keys and
    timeouts are checked as a node checks them.

    It is not thread-safe: a recv that waits ties it to its running loop, and while that
    loop runs every call from another thread raises ``RuntimeError`` (a value handed to
    a waiter from there would not wake its loop); use ``loop.call_soon_threadsafe(rv.send,
    key, value)`` there.
    """

    def __init__(self) -> None:
        self._table = _table.Table()
        # key string -> its canonical form.  Parsing a key string was most of the cost of a
        # send and a recv; a string that failed to parse is not kept, so it fails every time.
        self._texts: dict[str, str] = {}
        # The loop of the last recv that waited, and the thread that runs it (``_bind``).
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._timers: Any = None  # the timeouts of recvs waiting on that loop

    def _check_thread(self) -> None:
        """RuntimeError on a thread other than that of the loop a recv waits on."""
        if self._thread is not None and get_ident() != self._thread:
            loop = self._loop
            if loop is not None and loop.is_running():
                raise RuntimeError(
                    "this rvz.Rendezvous is used by an event loop of another thread, and is "
                    "not thread-safe: call it from that thread, e.g. "
                    "loop.call_soon_threadsafe(rv.send, key, value)")

    def _bind(self) -> asyncio.AbstractEventLoop:
        """The running loop, which a recv is about to wait on; see ``_check_thread``."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._check_thread()
            self._loop = loop
            self._thread = get_ident()
            self._timers = _deadlines.Deadlines(loop)
        return loop

    def _text(self, key: Any) -> str:
        if type(key) is str:
            text = self._texts.get(key)
            if text is None:
                text = str(_keys.as_key(key))
                if len(self._texts) >= TEXTS_MAX:
                    self._texts.clear()
                self._texts[key] = text
            return text
        return str(_keys.as_key(key))  # a Key keeps its string form

    def send(self, key: KeyLike, value: SendValue) -> None:
        """Queue ``value`` on ``key``; never blocks (the next ``recv`` of the key takes it)."""
        if self._thread is not None:
            self._check_thread()
        self._table.put(self._text(key), value)

    async def recv(self, key: KeyLike, timeout: float | None = None) -> Value:
        """The next value of ``key`` (FIFO), waiting up to ``timeout`` seconds for a ``send``.

        Raises ``TimeoutError`` when the time is up and ``rvz.Aborted`` after ``abort``.
        """
        _table.check_timeout(timeout)
        text = self._text(key)
        table = self._table
        if self._thread is not None:
            self._check_thread()
        value = table.take(text)
        if value is not _table.EMPTY:
            return value
        loop = self._bind()
        waiter = loop.create_future()
        table.take_or_wait(text, waiter)
        return await _table.wait_waiter(table, text, waiter, table.stamp, self._timers, timeout,
                                        None)

    def send_many(self, items: Iterable[tuple[KeyLike, SendValue]]) -> None:
        """``send`` each ``(key, value)`` pair, in order; every key is checked before any
        value is queued."""
        checked = [(self._text(key), value) for key, value in items]
        if self._thread is not None:
            self._check_thread()
        if not checked and self._table.aborted:
            raise self._table.aborted_error("")  # an empty batch fails as any call would
        put = self._table.put
        for text, value in checked:
            put(text, value)

    async def recv_many(self, keys: Iterable[KeyLike], timeout: float | None = None) -> list[Value]:
        """The next value of each key, in the order of ``keys`` (a key may repeat).

        All or nothing: on a timeout, a cancellation or an abort, the values already taken
        go back to the head of their keys' queues, in order.
        """
        _table.check_timeout(timeout)
        texts = [self._text(key) for key in keys]
        table = self._table
        if self._thread is not None:
            self._check_thread()
        if not texts and table.aborted:
            raise table.aborted_error("")  # as any other call after abort()
        values = []
        stamps = []
        for text in texts:
            values.append(table.take(text))
            stamps.append(table.took)
        missing = sum(1 for v in values if v is _table.EMPTY)
        if not missing:
            return values
        loop = self._bind()
        batch = _table.Batch(table, texts, values, stamps, missing, loop.create_future())
        batch.wait()
        return await _table.wait_batch(batch, self._timers, timeout)

    def abort(self, exc: BaseException | None = None, message: str | None = None) -> None:
        """Fail every pending and every later operation with ``rvz.Aborted`` (``__cause__``
        is ``exc``)."""
        if self._thread is not None:
            self._check_thread()
        default = "rendezvous aborted" + ("" if exc is None else f": {exc!r}")
        self._table.abort(message or default, exc)

    @property
    def aborted(self) -> bool:
        """Whether ``abort`` was called."""
        return bool(self._table.aborted)

    def pending(self, key: KeyLike) -> tuple[int, int]:
        """``(queued values, waiting receivers)`` of ``key``."""
        text = self._text(key)
        return self._table.queued(text), self._table.waiting(text)

