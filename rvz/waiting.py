"""The slow paths of the public calls: a send that waits for room under ``hold_limit``
or for its push to leave, and a ``recv_many`` that waits for its missing values.

``Waiting`` is a part of ``rvz.node.Node`` (a base class); the fast paths that hand over to
it are compiled (``rvz._fast.calls``) or in ``Node``.
"""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from collections.abc import Sequence
from typing import Any

from . import _impl
from ._fast.into import Target
from .errors import BufferMismatch
from .nodestate import NodeState
from .runner import wait_for

_table = _impl.table
_seconds = _table.seconds  # a duration as a message says it


class Waiting(NodeState):
    """Sends and batches that must wait (see the module docstring)."""

    async def _send_wait(self, pending: Any, step: int, timeout: float | None,
                         total: float | None = None) -> None:
        """The rest of a send that could not complete at once (see ``Core.send``)."""
        said = timeout if total is None else total
        if isinstance(pending, tuple):  # Recv-Driven: wait for room under hold_limit
            route, value, nbytes, peer = pending
            core = self._core
            assert self._loop is not None
            end = None if timeout is None else self._loop.time() + timeout
            mine = core.holding.reserve_hold(peer, nbytes)
            try:
                # The step's table is looked up again after every wait: an empty one is
                # dropped at a heartbeat, and the request of the consumer that then asks
                # parks in the new one (kept, the old one hid it, and took the value where
                # no recv looks: both sides waited for ever).
                while core.hold_full(core.steps.table(step), route, nbytes, mine):
                    left = None if end is None else max(0.0, end - self._loop.time())
                    try:
                        if peer.unconnected():
                            # Room comes when consumers fetch.  Ours is dialled, as a
                            # Send-Driven recv's producer is, so that one gone (or never
                            # up) fails the send with PeerLost within connect_timeout
                            # instead of leaving it waiting for ever; a lost connection
                            # wakes us to look again (``_peer_lost``).
                            await wait_for(self._link(peer, route.text), left)
                            continue
                        await self._wait(core.holding.hold_waiters, left, "hold limit")
                    except (TimeoutError, asyncio.TimeoutError):
                        raise TimeoutError(f"send of {route.text} to {peer.name} timed out "
                                           f"after {_seconds(said)}s (hold limit: values not yet "
                                           f"fetched{self._held_summary()})") from None
            except BaseException:
                core.holding.wake_holders()  # the sends behind it look again (once ``finally`` ran)
                raise
            finally:
                core.holding.unreserve_hold(peer, mine)
            core.hold(core.steps.table(step), step, route, value, nbytes)
            return
        # A Send-Driven push waiting in its peer's queue (for the link, credit or socket).
        # A cancelled or timed-out push is cancelled, and leaves the queue at once.
        done = pending
        if done.done():
            return done.result()
        try:
            if timeout is None:
                await done
            else:
                await wait_for(done, timeout)
        except BaseException as exc:
            # Left in the queue behind a push that still waits (a send without a timeout,
            # say), each abandoned push would keep its value there until that one went:
            # a producer retrying on a timeout grew the queue by one value a try.
            dropped = self._core.credit.drop_push(done) if done.cancelled() else None
            if not isinstance(exc, asyncio.TimeoutError):
                raise
            what = (f"send of {dropped[1][2].text} to {dropped[0].name}"
                    if dropped is not None else "send")
            raise TimeoutError(f"{what} timed out after {_seconds(said)}s "
                               "(connection, push window or socket)") from None

    def _held_for(self) -> dict[Any, int]:
        """How many Recv-Driven values this node holds for each remote consumer."""
        held: dict[Any, int] = {}
        for _, table, route in self._held_keys():
            held[route.peer] = held.get(route.peer, 0) + table.queued(route.text)
        return held

    def _held_summary(self) -> str:
        """``"; held for <peer> (<state>): <n> values, ..."``, the three holding most: who
        fills hold_limit, when a send times out waiting for room (a consumer that is gone
        keeps its values held for its next incarnation, and they count).  From each
        consumer's count of what it holds against hold_limit, not from a walk of every key
        held: each send that times out says it (100k keys held took each 0.2-0.5 s)."""
        held = sorted(((peer, peer.held_count) for peer in self._core.peers.values()
                       if peer.held_count > 0), key=lambda item: -item[1])
        if not held:
            return ""
        parts = [f"{peer.name} ({'not connected' if peer.unconnected() else 'connected'}): "
                 f"{count} values" for peer, count in held[:3]]
        more = f" and {len(held) - 3} more consumers" if len(held) > 3 else ""
        return "; held for " + ", ".join(parts) + more

    async def _wait(self, waiters: deque[asyncio.Future[None]], timeout: float | None,
                    what: str) -> None:
        waiter = asyncio.get_running_loop().create_future()
        waiters.append(waiter)
        try:
            if timeout is None:
                await waiter
            else:
                await wait_for(waiter, timeout)
        except asyncio.TimeoutError:
            raise TimeoutError(f"{what}: timed out after {_seconds(timeout)}s") from None
        finally:
            try:
                waiters.remove(waiter)
            except ValueError:
                pass

    async def _recv_many_wait(self, batch: Any, routes: list[Any], mode: str | None, step: int,
                              timeout: float | None) -> list[Any]:
        core = self._core
        loop = self._loop
        assert loop is not None
        waiting = batch.wait()
        try:
            asks, dial = _impl.batches.ask_many(core, waiting, routes, mode, step)
        except BaseException:
            self._undo_batch(batch)
            raise
        for peer, text in dial.items():  # one link task a producer, not one a key
            self._spawn(self._link(peer, text))  # to notice if it is gone
        for peer, requests in asks.items():
            if not core.requests.send_asks(peer, requests):
                self._request_when_linked(requests)
        poll = self._poll
        if poll is not None and any(routes[i].peer is not None for i in waiting):
            poll.begin()
        else:
            poll = None
        try:
            return await _table.wait_batch(batch, core.timers, timeout, self._unconsume,
                                           functools.partial(self._batch_where, step))
        finally:
            if poll is not None:
                poll.end()
            if asks and not loop.is_closed():  # (closed: see NodeCalls.recv)
                table = batch.table
                for text in {routes[i].text for i in waiting}:
                    core.requests.rebalance(step, text, table)

    async def _recv_many_into(self, routes: list[Any], into: Sequence[Any], mode: str | None,
                              step: int, timeout: float | None) -> list[Any]:
        """``recv_many`` with ``into=``: the batch's values copied into their buffers, or
        all of them back in their queues if one does not fit."""
        targets = [None if buf is None else Target(buf, self._core.into) for buf in into]
        if len(targets) != len(routes):
            raise ValueError(f"recv_many got {len(routes)} keys and {len(targets)} into= "
                             "buffers: give one per key (None for a new value)")
        if not routes:
            self._check_empty_batch(step)
            return []
        batch = _impl.batches.take_many(self._core, routes, step, True)
        values = (batch.values if batch.missing == 0
                  else await self._recv_many_wait(batch, routes, mode, step, timeout))
        try:
            return [value if target is None else target.fill(value, route.text)
                    for target, value, route in zip(targets, values, routes, strict=True)]
        except BufferMismatch:
            self._undo_batch(batch)
            raise

    def _batch_where(self, step: int, keys: list[str]) -> str:
        """What a recv_many's timeout adds to name where it waited: the step and the
        producers of the keys still missing."""
        routes = [self._core.routes.route(key) for key in keys]
        peers = sorted({route.peer.name for route in routes if route.peer is not None})
        shown = ", ".join(peers[:3]) + (f" and {len(peers) - 3} more" if len(peers) > 3 else "")
        return (f" in step {step}" if step else "") + (f" from {shown}" if peers else "")

    def _undo_batch(self, batch: Any) -> None:
        """Give a batch's values back, oldest first, before it ever waited."""
        if not batch.future.done():
            batch.future.cancel()
        self._unconsume(batch.restore())

    def _unconsume(self, pairs: list[tuple[str, Any]]) -> None:
        """Values from peers went back to their queues: their consumption is undone."""
        core = self._core
        for key, value in pairs:
            route = core.routes.route(key)
            if route.peer is not None:
                core.unconsumed(route.src, value)
