"""Closing a node: the graceful ``close`` (deliver, say BYE, wait for the peers to read to
the end), ``abort``, and what both fail.

``Closing`` is a part of ``rvz.node.Node`` (a base class), in a module of its own.
"""

from __future__ import annotations

import asyncio
import logging

from .connection import Connection
from .errors import NodeClosed, RvzError
from .nodestate import NodeState, started
from .runner import wait_for

log = logging.getLogger("rvz.node")


class Closing(NodeState):
    """``close`` and ``abort`` of a node (see the module docstring)."""

    async def close(self) -> None:
        """Graceful close: deliver what was sent, then say BYE and close.

        Pushes already accepted are flushed, and Recv-Driven values still held for remote
        consumers are pushed to them (their recvs find them in their own tables), in both
        cases for at most ``linger`` seconds.  What cannot be delivered by then is dropped
        and counted in one log line.  A close() that is cancelled (an ``asyncio.wait_for``
        around it timed out, say) closes the rest at once, as ``abort()`` does.
        """
        if self._forked_from is not None:
            return  # the parent's node: nothing of it is this child's to close (_disown)
        self._entry(None)  # from another thread it raises RuntimeError and changes nothing
        if self._state in ("new", "closed"):
            self._state = "closed"
            self._core.stop()
            return
        if self._state == "closing":
            while self._state != "closed":
                await asyncio.sleep(0.01)
            return
        self._set_state("closing")
        try:
            await self._close_gracefully()
        except BaseException as exc:
            # Left half-closed, the node would keep its server, its heartbeats and its
            # connections, and every later close() (``async with``'s own) would wait forever.
            why = ("close() was cancelled" if isinstance(exc, asyncio.CancelledError)
                   else f"close() failed: {exc!r}")
            self.abort(NodeClosed(f"node {self.name}: {why}"))
            raise

    async def _close_gracefully(self) -> None:
        core = self._core
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.linger
        self._closing_pushes = self._push_held()
        # Not every background task: a dial retrying toward a dead peer would hold the close
        # for the whole linger although it delivers nothing.
        while loop.time() < deadline and (core.holding.held_count or self._deliveries or any(
                p.queue for p in core.peers.values()) or (
                self._onesided is not None and self._onesided.busy())):
            await asyncio.sleep(min(0.005, max(0.0, deadline - loop.time())))
            if self._state == "closed":
                return  # abort() was called meanwhile: it closed everything
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            if not conn.closed and conn.ready:
                core.credit.flush_credit_now(conn.peer)
        # BYE on every open connection, those still in their handshake too.  Ours is not
        # complete until we read the peer's HELLO, but the peer completes its own when it
        # reads ours (sent at connection_made), and from then on it takes an end without BYE
        # for a lost peer: it fails every connection to us, among them the one still
        # carrying the values pushed above.  BYE after our HELLO is always in order; a peer
        # whose own handshake is not complete either (it waits for our AUTH) refuses it as a
        # protocol error, on a connection it never counted ready: that fails nothing else.
        self._said_bye = True
        for conn in list(self._conns):
            if not conn.closed:
                self._say_bye(conn)
        for conn in list(self._conns):
            if not conn.closed:
                try:
                    await wait_for(conn.drain(), max(0.05, deadline - loop.time()))
                except (asyncio.TimeoutError, RvzError):
                    pass
                conn.close()
        # conn.close() only half-closes: wait until each peer has read everything and closed
        # its side (a silent peer for at most peer_timeout), then cut what is left.
        handshake = loop.time() + self.peer_timeout
        while any(c.closed_here and not c.closed for c in self._conns) and loop.time() < handshake:
            await asyncio.sleep(0.005)
        if self._state == "closed":
            return  # aborted while the peers read to the end
        cause = NodeClosed(f"node {self.name} was closed")
        for conn in list(self._conns):
            if not conn.closed:
                conn.fail(cause)
        # Counted once: still queued now, or pushed at close and already failed.
        undelivered = sum(len(p.queue) for p in core.peers.values()) + sum(
            1 for d in self._closing_pushes
            if d.done() and not d.cancelled() and d.exception() is not None)
        self._finish(cause)
        if undelivered:
            log.warning("%s: closed after a linger of %ss with %d values undelivered",
                        self.name, self.linger, undelivered)
        # Give the transports one iteration to run their close callbacks.
        await asyncio.sleep(0)

    def _say_bye(self, conn: Connection) -> None:
        """Write BYE as ``conn``'s last frame.  Nothing may follow it: the peer's decoder
        takes any frame after BYE as a protocol error, and fails every connection to us.
        A dial, a request or a credit finishing while close() drains would write one, so
        the connection counts as closed here from now on (its writes are dropped)."""
        conn.say_bye()

    def abort(self, exc: BaseException | None = None) -> None:
        """Close at once: every pending and later operation fails with ``NodeClosed`` (an
        ``Aborted``) whose ``__cause__`` is ``exc``.  From another thread, schedule it on
        the node's loop (``loop.call_soon_threadsafe(node.abort)``)."""
        if self._forked_from is not None:
            return  # the parent's node (_disown)
        self._entry(None)
        if self._state == "closed":
            return
        cause = exc if exc is not None else NodeClosed(f"node {self.name} was aborted")
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.fail(cause)
        self._finish(cause)

    def _finish(self, cause: BaseException) -> None:
        started.discard(self)
        core = self._core
        self._close_cause = cause
        self._state = "closed"
        core.stop()
        if self._tick_handle is not None:
            self._tick_handle.cancel()
        self._repeats.flush(force=True)
        message = f"node {self.name} closed"
        for step in list(core.steps.tables):
            self._drop_table(step, message, cause, NodeClosed)
        for peer in core.peers.values():
            self._fail_queued_pushes(peer, lambda key: self._closed_error(cause))
        for waiter in core.holding.hold_waiters:
            if not waiter.done():
                waiter.set_exception(self._closed_error(cause))
        core.holding.hold_waiters.clear()
        for task in list(self._tasks):
            task.cancel()
        if self._onesided is not None:
            self._onesided.close()  # pool blocks under live arrays stay until those die

    def _closed_error(self, cause: BaseException) -> NodeClosed:
        err = NodeClosed(self._closed_text(cause, "closed"))
        err.__cause__ = cause
        return err

    def _closed_text(self, cause: BaseException, how: str) -> str:
        """Why this node is closed: the node once, then the cause (ours names it already)."""
        text = str(cause)
        prefix = f"node {self.name}"
        return text if text.startswith(prefix) else f"{prefix} {how}: {text}"
