"""Receiving into the caller's buffer (``recv(key, into=buf)``): which buffers rvz writes
into, which values fit one, and how a value gets there.

A ``Target`` is one recv's buffer.  While the recv waits, a large TCP payload on its way to
it is read from the socket straight into the buffer (the decoder's ``land`` and ``adopt``):
only what came in the same read as its header is copied.  Any other value (one queued
before the recv, one below the decoder's ``direct_min``, one from a one-sided channel or
from this node) is copied in when the recv gets it.  A value that does not fit fails the
recv with ``BufferMismatch`` and stays first in its key's queue.

rvz writes into a buffer only while its recv waits: when the recv stops waiting (it is
cancelled, times out, or its step aborts) as a payload lands in the buffer, the rest of the
payload goes to memory of the node's own, with what had landed copied over (``unland``),
before the caller runs again.  The buffer then holds a part of that value; the value itself
goes to the next recv of its key.

Over a one-sided channel whose provider can register private memory (verbs), a Recv-Driven
recv offers its buffer itself as the destination of its request (``offer``: see
rvz/onesided/buffers.py); stopping the recv fences the buffer off (``stop``).
"""

from __future__ import annotations

import weakref
from typing import Any

import numpy as np

from ..errors import BufferMismatch
from .format import BYTES_CODE, CODES, DTYPES, foreign_array

_U8 = np.dtype(np.uint8)
_RAW_FORMATS = ("B", "b", "c")


def _describe(code: int, shape: tuple, nbytes: int) -> str:
    if code == BYTES_CODE:
        return f"a bytes value of {nbytes} bytes"
    return f"a {DTYPES[code]} value of shape {tuple(shape)} ({nbytes} bytes)"


class Target:
    """One recv's ``into=`` buffer: checked when the recv starts (``TypeError`` for a buffer
    rvz cannot write), filled when a value comes."""

    __slots__ = ("buf", "landings", "array", "code", "dest", "nbytes", "waiter", "decoder",
                 "landed_value", "meta", "prefix", "step", "key", "offer", "__weakref__")

    def __init__(self, buf: Any, landings: Landings) -> None:
        self.buf = buf
        self.landings = landings  # counts the bytes landed and copied (``stats()["into"]``)
        # A typed buffer (an ndarray, a tensor, a typed memoryview) takes values of its own
        # dtype and shape; a buffer of raw bytes takes any value of its byte size.
        array = None
        if isinstance(buf, np.ndarray):
            array = buf
        elif hasattr(buf, "__dlpack__") or hasattr(buf, "__array_interface__"):
            array = foreign_array(buf, "receive into")
        else:
            try:
                view = memoryview(buf)
            except TypeError:
                raise TypeError(f"into= takes a writable numpy array, CPU tensor or buffer, "
                                f"not {type(buf).__module__}.{type(buf).__qualname__}") from None
            if view.format not in _RAW_FORMATS:
                array = np.asarray(view)
            elif view.readonly or not view.c_contiguous:
                raise TypeError("into= takes a writable, contiguous buffer"
                                + (": this one is read-only" if view.readonly else ""))
        self.array = array
        if array is None:  # raw bytes
            self.code = -1
            self.dest: Any = view.cast("B") if view.ndim != 1 or view.format != "B" else view
            self.nbytes = self.dest.nbytes
        else:
            if not array.flags.writeable:
                raise TypeError(f"into= takes a writable buffer: this {array.dtype} array is "
                                "read-only")
            self.code = CODES.get(array.dtype.str, -1)
            if self.code < 0:
                raise TypeError(f"rvz receives no values of dtype {array.dtype}")
            self.nbytes = array.nbytes
            # Not C-contiguous (a column of a matrix, say): values are copied in.
            self.dest = (memoryview(array.reshape(-1).view(_U8))  # type: ignore[arg-type]
                         if array.flags.c_contiguous else None)
        self.waiter: Any = None  # the recv's future, while it waits
        self.decoder: Any = None  # the decoder a payload lands from, while it does
        self.landed_value: Any = None  # the value as the recv gets it: a view of the buffer
        self.meta: tuple = ()  # (code, shape) of the value that lands
        self.prefix = 0  # bytes of it that came before it could land, copied in
        self.step: Any = None  # the step and key its recv waits on (``Landings.expect``)
        self.key = ""
        self.offer: Any = None  # the buffer as a one-sided destination, while it is one
        # The request a recv sends now may offer this buffer (``Landings.asking``).
        landings.made = weakref.ref(self)

    # -- a payload landing here (called by the decoder) ----------------------------------

    def takes(self, code: int, shape: tuple, nbytes: int) -> bool:
        """Whether a payload with this header can land here (then it is the one that does)."""
        if self.dest is None or self.decoder is not None or not self._fits(code, shape, nbytes):
            return False
        self.meta = (code, shape)
        return True

    def landed(self) -> Any:
        """The payload landed whole: the value its recv gets, a view of the buffer; a copy
        if the recv no longer waits for it (it got an earlier value, or gave up)."""
        self.decoder = None
        landings = self.landings
        landings.copied += self.prefix
        landings.landed += self.dest.nbytes - self.prefix
        view = self._view()
        if self.waiter is None or self.waiter.done():
            return self._copy(view)
        self.landed_value = view
        return view

    def written(self, code: int, shape: tuple, first: bool) -> Any:
        """A one-sided write put a whole value of ``code`` and ``shape`` in the buffer: the
        buffer itself (landed) if its recv is the one the value goes to (``first``: no value
        of the key goes ahead of it); else a copy, which the buffer's recv never sees."""
        self.meta = (code, shape)
        self.prefix = 0
        view = self._view()
        waiter = self.waiter
        table = self.landings.tables.get(self.step)
        if (not first or waiter is None or waiter.done() or table is None
                or table.head_waiter(self.key) is not waiter):
            return self._copy(view)
        self.landings.landed += self.dest.nbytes
        self.landed_value = view
        return view

    def _view(self) -> Any:
        code, shape = self.meta
        if code == BYTES_CODE:
            return self.dest
        if self.array is not None:
            return self.array
        return np.frombuffer(self.dest, DTYPES[code]).reshape(shape)

    # -- the recv's side -------------------------------------------------------------------

    def stop(self) -> None:
        """The recv is done with the buffer: nothing more lands in it."""
        if self.decoder is not None:
            self.decoder.unland()
        if self.offer is not None:
            self.offer.fence()

    def fill(self, value: Any, key: str) -> Any:
        """The recv got ``value``: the buffer, holding it.  ``BufferMismatch`` if it does not
        fit (the caller puts the value back)."""
        if value is self.landed_value:
            return self.buf
        self.stop()
        if isinstance(value, np.ndarray):
            code, shape, nbytes = CODES.get(value.dtype.str, -1), value.shape, value.nbytes
        else:
            code, shape, nbytes = BYTES_CODE, (len(value),), len(value)
        if not self._fits(code, shape, nbytes):
            raise BufferMismatch(f"recv of {key}: {_describe(code, shape, nbytes)} does not fit "
                                 f"into= {self.describe()}; it stays queued for the next recv")
        self.landings.copied += nbytes
        if self.array is not None and code != BYTES_CODE:
            np.copyto(self.array, value, casting="no")
        elif code == BYTES_CODE:
            self.dest[:] = value
        else:
            self.dest[:] = np.ascontiguousarray(value).reshape(-1).view(_U8)
        return self.buf

    def own(self, value: Any) -> Any:
        """``value`` as it may go back to the queue once its recv failed: a copy if it is a
        view of the buffer, which is the caller's again."""
        if value is not self.landed_value:
            return value
        return self._copy(value)

    def _copy(self, view: Any) -> Any:
        """A value landed here, in memory of its own (``bytes`` or a new array)."""
        return bytes(view) if self.meta[0] == BYTES_CODE else np.array(view)

    def describe(self) -> str:
        if self.array is None:
            return f"a buffer of {self.nbytes} bytes"
        array = self.array
        return f"a {array.dtype} buffer of shape {array.shape} ({array.nbytes} bytes)"

    def fits(self, code: int, shape: tuple, nbytes: int) -> bool:
        """Whether a value of ``code``, ``shape`` and ``nbytes`` fits the buffer as it is,
        with no copy (a C-contiguous buffer)."""
        return self.dest is not None and self._fits(code, shape, nbytes)

    def _fits(self, code: int, shape: tuple, nbytes: int) -> bool:
        if self.array is None:
            return nbytes == self.nbytes
        if code == BYTES_CODE:  # bytes fill a 1-d uint8 array of their length
            return self.array.dtype == _U8 and self.array.shape == (nbytes,)
        return code == self.code and tuple(shape) == self.array.shape


class Landings:
    """A node's recvs that wait with an ``into=`` buffer, and the bytes that reached such
    buffers; the decoders' ``land`` (a ``Core`` holds one, as ``into``)."""

    __slots__ = ("tables", "waiting", "landed", "copied", "made")

    def __init__(self, tables: dict) -> None:
        self.tables = tables  # the node's step tables (``Steps.tables``)
        self.waiting: dict[Any, Target] = {}  # a waiting recv's future -> its buffer
        self.landed = 0  # bytes received straight into buffers
        self.copied = 0  # bytes copied into them
        self.made: Any = None  # a weak reference to the buffer of the recv that runs now

    def asking(self) -> bool:
        """Whether a recv with a buffer may be sending its request now: the last buffer made
        has not waited nor taken a value yet.  (A hint only: the buffer is offered once its
        recv waits, ``expect``; ``recv_many``'s buffers never are.)"""
        made = self.made
        if made is None:
            return False
        target = made()
        if target is None or target.waiter is not None:
            self.made = None
            return False
        return True

    def land(self, step: Any, request_id: Any, key: str, code: int, shape: tuple,
             nbytes: Any) -> Target | None:
        """Where a large DATA payload (admitted) is received: the buffer of the recv its
        value will reach, the oldest waiting, if that recv has one the value fits; else
        None (the decoder's own memory)."""
        if not self.waiting:
            return None
        table = self.tables.get(step)
        if table is None:
            return None
        target = self.waiting.get(table.head_waiter(key))
        if target is None or not target.takes(code, shape, nbytes):
            return None
        return target

    def expect(self, target: Target, waiter: Any, step: Any, key: str, table: Any,
               peer: Any) -> None:
        """A recv with ``into=`` waits (``waiter``, in ``table``): a large payload on its way
        to it may land in its buffer (``land``); one already arriving when it is next in
        line moves there, what came of it copied over (``Decoder.adopt``)."""
        target.waiter = waiter
        target.step = step
        target.key = key
        self.waiting[waiter] = target
        self.made = None
        if peer is not None and target.dest is not None:
            # Recv-Driven over a channel that can write into the buffer: offered as the
            # destination of the request this recv just sent (rvz/onesided/buffers.py).
            for conn in peer.live_connections():
                dataplane = conn.dataplane
                if dataplane is not None and dataplane.claim(target):
                    return
        # (``peer.arriving``: pushes of it whose payload is on its way; none when Recv-Driven)
        if (peer is None or not peer.arriving or target.dest is None
                or table.head_waiter(key) is not waiter):
            return
        for conn in peer.live_connections():
            decoder = conn.decoder
            if decoder is not None and decoder.arriving(step, key):
                decoder.adopt(target)
                return


def fill_taken(core: Any, target: Target, key: Any, step: Any, value: Any) -> Any:
    """A recv with ``into=`` took ``value`` from its queue: the buffer, holding it.  A value
    that does not fit goes back to the head of the queue (``BufferMismatch``)."""
    core.into.made = None
    route = core.own_route(key, False)
    table = core.steps.table(step)
    took = table.took
    try:
        return target.fill(value, route.text)
    except BufferMismatch:
        if not table.put_back(route.text, value, took) and route.peer is not None:
            core.unconsumed(route.src, value)
        raise
