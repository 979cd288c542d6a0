"""Node's per-message calls, ``send`` and ``recv``: where an application's call enters the
engine.

``rvz.Node`` subclasses ``NodeCalls`` and owns everything else (peers, dialling, steps, the
batch calls, the slow paths these two hand back to it).  They live here, not in node.py,
so that they are compiled: a call is then a C coroutine that reaches ``Core.send`` and
``Core.recv`` through C calls on a typed ``_core``, with no interpreted frame.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .into import Target, fill_taken
from .table import arm_timeout, give_back

if TYPE_CHECKING:
    from ..types import KeyLike, Mode, SendValue
    from .engine import Core


class NodeCalls:
    """The compiled base of ``rvz.Node``: ``_core`` is its engine, ``_loop`` its running loop
    (None before ``start``), ``_poll`` its ``rvz.poll.BusyPoll`` (None: off).  The slow paths
    call back into ``Node`` (``_send_wait``, ``_spawn``, ``_link``)."""

    _core: Core
    _loop: Any
    _poll: Any

    async def send(self, key: KeyLike, value: SendValue, *, mode: Mode | None = None,
                   step: int = 0, timeout: float | None = None) -> None:
        """Send ``value`` (a numpy array or bytes) on ``key``; the key's src must be this node.

        Returns once the value is queued: locally, in our table for the consumer to fetch
        (Recv-Driven), or on the wire (Send-Driven).  Waits only for backpressure; a send
        that fits the push window completes without suspending.
        """
        pending = self._core.send(key, value, mode, step, timeout)
        if pending is not None:
            await self._send_wait(pending, step, timeout)  # type: ignore[attr-defined]

    async def recv(self, key: KeyLike, *, mode: Mode | None = None, step: int = 0,
                   timeout: float | None = None, into: Any = None) -> Any:
        """Receive the next value of ``key`` (FIFO); the key's dst must be this node.

        A value already queued is returned without suspending.  ``timeout`` raises
        ``TimeoutError``; cancelling the awaiting task cancels just this recv.  Remote
        failures raise ``PeerLost`` or ``Aborted`` with the original cause.

        ``into``: a writable CPU array, tensor or buffer the value is written into, and
        which is returned (see rvz/_fast/into.py, and README's "Receiving into a buffer").
        """
        core = self._core
        target = None if into is None else Target(into, core.into)
        got = core.recv(key, step, mode, timeout)
        if type(got) is not tuple:
            if target is None:
                return got
            return fill_taken(core, target, key, step, got)
        # Nothing queued: wait here (one coroutine per recv, no nested one).
        waiter, route, table, peer, dial, stamp = got
        if dial:
            self._spawn(self._link(peer, route.text))  # type: ignore[attr-defined]  # to notice if it is gone
        text = route.text
        handle = None if timeout is None else arm_timeout(
            core.timers, timeout, table, text, waiter, peer.name if peer is not None else None, step)
        poll = self._poll if peer is not None else None  # (a local value needs no polling)
        if poll is not None:
            poll.begin()
        try:
            if target is None:
                return await waiter
            core.into.expect(target, waiter, step, text, table, peer)
            return target.fill(await waiter, text)
        except BaseException:
            if target is not None:
                target.stop()
            if self._loop.is_closed():
                # Collected after its loop was closed under it (its task left pending):
                # nothing can run or be written any more, so nothing is given back and no
                # CANCEL is sent (``peer = None`` skips the rebalance below).
                peer = None
                raise
            # The value may have been delivered just before the failure: it goes back to the
            # queue, where it is unconsumed again (its credit is returned when it is taken),
            # or to the next waiter, which consumed it (the credit already counted stands).
            if give_back(table, text, waiter, stamp, target) and peer is not None:
                core.unconsumed(route.src, waiter.result())
            raise
        finally:
            if handle is not None:
                handle.cancel()
            if poll is not None:
                poll.end()
            if target is not None:
                core.into.waiting.pop(waiter, None)
            if peer is not None and core.requests.by_id:  # (nothing to rebalance otherwise)
                core.requests.rebalance(step, text, table)
