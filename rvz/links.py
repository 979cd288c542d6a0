"""Connections to peers: accepting them (over TLS too), dialling with retry and backoff,
the link each peer's traffic uses, reconnecting after a broken one, and what a lost peer
fails.

``Links`` is a part of ``rvz.node.Node`` (its base class), kept in a module of its own: the
node keeps the public API and the life cycle.  It is also what the connections tell the node
(``rvz.connection.Owner``: ``connection_made``, ``connection_lost``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import ssl as _ssl
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from . import _impl
from .cluster import split_address
from .connection import Connection, TlsAccept
from .errors import AuthError, NodeClosed, PeerLost, ProtocolError, RvzError, TransportError
from .nodestate import NodeState
from .runner import wait_for

if TYPE_CHECKING:
    pass

log = logging.getLogger("rvz.node")  # one logger for the node and its links
_codec = _impl.codec


# What stats() counts of the ways connections end ("errors"), and of lost peers.
ERROR_KINDS = ("protocol", "auth", "timeout", "reset", "peer_lost")


def _error_kind(reason: BaseException | None) -> str | None:
    """How a connection that ``reason`` closed counts in ``stats()["errors"]``; None for an
    end that is no error (ours, the peer's goodbye, a lost peer counted as such)."""
    if isinstance(reason, AuthError):
        return "auth"
    if isinstance(reason, ProtocolError):
        return "protocol"
    if isinstance(reason, (TimeoutError, asyncio.TimeoutError)):  # (an OSError too)
        return "timeout"
    if isinstance(reason, OSError):
        return "reset"
    return None


def _transient(reason: BaseException | None) -> bool:
    """A connection lost this way may come back to the same process: reset or closed
    without BYE (not a timeout, a protocol violation or a failed handshake)."""
    return isinstance(reason, OSError) and not isinstance(reason, TimeoutError)


class Links(NodeState):
    """Connections and links of a node (see the module docstring)."""

    def _accepted(self) -> Connection | TlsAccept:
        """The protocol of a connection the server accepted."""
        if self._ssl_server is not None:
            return TlsAccept(self)
        return self._connection(outbound=False)

    def tls_accepted(self, transport: Any) -> None:
        """A TLS node accepted a connection (``TlsAccept``; nothing is read yet): refuse it
        at once if it is one unidentified connection too many, else start its handshake.

        The handshake runs on a duplicate of the socket, through the loop's own path for
        an accepted socket (create_server(ssl=...)'s, which hands the connection to its
        protocol only when the handshake is done); the plain transport lets go of it."""
        plain = transport.get_extra_info("socket")
        sock = None
        if plain is not None and not self._refusing() and (
                self._unidentified() < self.max_unidentified):
            try:
                sock = socket.socket(fileno=os.dup(plain.fileno()))
            except OSError:  # out of descriptors: refused like one too many
                pass
        transport.abort()  # (closes its descriptor only: the connection lives on in ``sock``)
        if sock is None:
            return
        conn = self._connection(outbound=False)
        self._handshaking.add(conn)
        self._spawn(self._start_tls(conn, sock))

    async def _start_tls(self, conn: Connection, sock: socket.socket) -> None:
        # Within hello_timeout; then the HELLO has hello_timeout again (connection_made).
        assert self._loop is not None
        try:
            await self._loop.connect_accepted_socket(
                lambda: conn, sock, ssl=self._ssl_server,
                ssl_handshake_timeout=self.hello_timeout or None)
        except (OSError, asyncio.TimeoutError) as exc:  # ssl.SSLError is an OSError
            log.debug("%s: a TLS handshake failed: %r", self.name, exc)
        finally:
            self._handshaking.discard(conn)  # (connection_made did, if it completed)

    def _connection(self, outbound: bool, peer: Any = None) -> Connection:
        decoder = _codec.Decoder(max_payload=self.max_payload, pool=self._recv_pool)
        return Connection(self, self._core, decoder, outbound, peer)

    def _refusing(self) -> bool:
        """abort() ran: a connection whose dial or accept completes now is failed at once,
        and says nothing (its task was cancelled too late, or its protocol started in the
        loop pass after).  Left open, it would tell the peer this node is alive until its
        peer_timeout."""
        return self._state == "closed" and not self._said_bye

    def hello_fields(self, conn: Connection) -> dict[str, Any]:
        """What this node says in the HELLO of a new connection."""
        conn.nonce, fields = self._handshake.hello(mode=self.mode, win=self.push_window,
                                                   park=self.max_parked)
        if self._onesided is not None:
            fields.update(self._onesided.offer(conn))  # one-sided endpoints it may use
        return fields

    def connection_made(self, conn: Connection) -> None:
        """A connection opened (either side dialled); ``Connection`` calls this."""
        self._handshaking.discard(conn)  # its TLS handshake is done: counted here from now on
        self._conns.add(conn)
        assert self._loop is not None
        conn.opened = self._loop.time()
        if self._refusing():
            conn.fail(self._closed_error(self._close_cause or NodeClosed(self.name)))
            return
        if not conn.outbound and self._unidentified() > self.max_unidentified:
            # Before a byte is written: a dialler that read our HELLO would take the
            # connection as ready and send on it.  It sees a reset, and dials again.
            conn.fail(ProtocolError(f"more than {self.max_unidentified} connections have "
                                    "not completed their handshake (max_unidentified)"))
            return
        conn.write_frame(_codec.encode_hello(self.hello_fields(conn)))
        if self._said_bye:
            # A dial (ours or the peer's) that completed while close() drains: our HELLO is
            # out, so the peer may already count it ready; it must end with BYE as well.
            self._say_bye(conn)
            conn.close()

    def _unidentified(self) -> int:
        """Accepted connections whose handshake is not complete (``max_unidentified``),
        those still in their TLS handshake too.  Refused ones count as well: they hold their
        buffers until the peer reads the ERROR and hangs up (or ``hello_timeout``), and a
        flood of them costs as much as silent ones."""
        return len(self._handshaking) + sum(
            1 for c in self._conns if not c.ready and not c.outbound and not c.closed)

    def connection_lost(self, conn: Connection) -> None:
        """A connection closed; fails what depended on it (``Connection`` calls this)."""
        self._conns.discard(conn)
        kind = _error_kind(conn.close_reason)
        if kind is not None:
            self._errors[kind] += 1
        if isinstance(conn.close_reason, AuthError) and not conn.outbound:
            self._repeats.log("refused", logging.WARNING,
                              f"{self.name} refused a connection: {conn.close_reason}")
        waiter = conn.hello_waiter
        if waiter is not None and not waiter.done():
            waiter.set_exception(conn.lost_error())
        peer = conn.peer
        if peer is None:
            return
        peer.dropped(conn)
        # The peer's traffic counters outlive the connection (stats() and the exported
        # metrics are totals, which never go down).
        counts = self._closed_traffic.setdefault(peer, [0, 0, 0, 0])
        counts[0] += int(conn.decoder.bytes_in)
        counts[1] += int(conn.bytes_out)
        counts[2] += int(conn.decoder.frames)
        counts[3] += int(conn.frames_out)
        core = self._core
        for parked in conn.parked.values():
            parked.cancel()
            table = core.steps.tables.get(parked.step)
            if table is not None:  # a waiter that will never answer: out of its key's queue
                table.remove_waiter(parked.route.text, parked)
        conn.parked.clear()
        if conn.deferred:
            core.undefer(conn)
        if peer.asking:  # what it parked of ours on that connection it parks no more
            for request_id in [i for i, c in peer.asking.items() if c is conn]:
                core.requests.asked_no_more(peer, request_id)
        # No ready connection to it left: what we hold for it counts apart.  (Its dialled
        # connection reaches ``peer.out`` only once the dial returns: asked of the node.)
        core.holding.regroup(peer, not any(c.peer is peer and c.ready and not c.closed for c in self._conns))
        if self._state == "closed" or isinstance(conn.close_reason, PeerLost) or (
                conn.closed_here and not isinstance(conn.close_reason, ProtocolError)):
            return  # our own close, or the loss was already handled by _peer_lost
        if conn.bye_received:
            if not peer.live_connections():
                err = PeerLost(f"peer {peer.name} closed")
                err.__cause__ = NodeClosed(f"{peer.name} said goodbye")
                self._peer_lost(peer, err)
        elif conn.ready and _transient(conn.close_reason):
            self._reconnect(peer, conn)
        elif conn.ready:
            err = PeerLost(f"lost the connection to {peer.name} at {peer.address}: "
                           f"{conn.close_reason}")
            err.__cause__ = conn.close_reason
            self._peer_lost(peer, err)

    def _reconnect(self, peer: Any, conn: Connection) -> None:
        """A ready connection to ``peer`` broke (reset, or closed without BYE): nothing in
        flight on it is lost.  Our requests on it are asked again and the values it carried
        that ``peer`` has not acknowledged are sent again, on another connection to the
        same process or on a new one; operations go on waiting meanwhile.  If no new
        connection is made within ``connect_timeout`` (or the peer refuses one: its process
        is gone), what waits on it fails with ``PeerLost``."""
        core = self._core
        core.requests.reask(conn)
        link = peer.link
        if link is not None and link.ready and not link.closed:
            if conn.data_out:  # it carried values (on its stream or its one-sided channel)
                core.credit.resend(peer, link)
            return
        for other in peer.live_connections():
            if other.ready:
                self._link_ready(peer, other)  # sends again what peer did not acknowledge
                return
        if self._state != "closed" and not self._dialling(peer):
            log.info("%s: lost the connection to %s (%s): reconnecting", self.name, peer.name,
                     conn.close_reason)
            self._new_dial(peer, after=conn.close_reason)

    def _start_link(self, peer: Any) -> None:
        """Make sure a connection to ``peer`` is on its way (without waiting for it)."""
        if not self._dialling(peer):
            self._spawn(self._link(peer))

    def _request_when_linked(self, requests: list[Any]) -> None:
        self._spawn(self._send_when_linked(requests))

    async def _send_when_linked(self, requests: list[Any]) -> None:
        first = requests[0]
        conn = await self._link(first.peer, first.key)
        core = self._core
        live = [r for r in requests if r.id in core.requests.by_id]  # not cancelled meanwhile
        if live:
            # (On a connection that closed meanwhile nothing goes: the loss fails them.)
            core.requests.send_asks(first.peer, live, conn)

    async def _link(self, peer: Any, key: str | None = None) -> Connection:
        """The connection our traffic to ``peer`` uses, dialled on first use (with retry/backoff)."""
        conn = peer.link
        if conn is not None and not conn.closed and conn.ready:
            return conn
        for conn in peer.live_connections():
            if conn.ready:
                self._link_ready(peer, conn)
                return conn
        if self._state == "closed":
            raise self._closed_error(self._close_cause or NodeClosed(self.name))
        dialling = self._dials.get(peer.id)
        if dialling is None or dialling.done():
            dialling = self._new_dial(peer)
        try:
            return await asyncio.shield(dialling)
        except PeerLost as exc:
            if key is None:
                raise
            err = PeerLost(f"{exc} (key {key})")
            raise err from exc.__cause__

    async def _dial(self, peer: Any, result: asyncio.Future[Connection],
                    after: BaseException | None = None) -> None:
        """Connect to ``peer``, retrying with backoff until ``connect_timeout``.  ``after``:
        the loss of a connection this dial replaces; a refusal then means the peer's process
        is gone, and fails at once."""
        assert self._loop is not None
        host, port = split_address(peer.address)
        deadline = self._loop.time() + self.connect_timeout
        delay = 0.01
        last: BaseException | None = None
        while True:
            if after is not None and self._dialled_us(peer, result):
                return
            try:
                _, conn = await wait_for(self._loop.create_connection(
                    lambda: self._connection(outbound=True, peer=peer), host, port,
                    ssl=self._ssl_client,
                    server_hostname=host if self._ssl_client is not None else None),
                    max(0.01, deadline - self._loop.time()))
                if not conn.ready:  # HELLO may already have arrived
                    if conn.closed:  # ... and failed it (e.g. no common transport)
                        raise conn.lost_error()
                    hello = self._loop.create_future()
                    conn.hello_waiter = hello
                    await wait_for(hello, max(0.01, deadline - self._loop.time()))
                peer.dialled(conn)
                if peer.link is None or peer.link.closed:
                    self._link_ready(peer, conn)
                if not result.done():
                    result.set_result(conn)
                return
            except (OSError, asyncio.TimeoutError, RvzError) as exc:
                last = exc
            remaining = deadline - self._loop.time()
            if self._state == "closed" or remaining <= 0:
                break
            if isinstance(last, (TransportError, AuthError, _ssl.SSLError)) or isinstance(
                    last.__cause__, (TransportError, AuthError)) or (
                    after is not None and isinstance(last, ConnectionRefusedError)):
                # The pair cannot agree on a transport, a secret or a certificate:
                # retrying will not change that.
                break
            await asyncio.sleep(min(delay, remaining))  # the last try is at the deadline
            delay = min(delay * 2, 0.5)
        err: RvzError
        cause = last.__cause__ if last is not None and isinstance(last.__cause__, AuthError) else last
        if isinstance(cause, AuthError):
            err = AuthError(f"{cause} (at {peer.address})")
        elif isinstance(last, _ssl.SSLError):
            err = TransportError(f"TLS with {peer.name} at {peer.address} failed: {last}")
        elif after is not None:
            err = PeerLost(f"lost the connection to {peer.name} at {peer.address} ({after}) "
                           f"and could not connect again: {last!r}")
        else:
            err = PeerLost(f"could not connect to {peer.name} at {peer.address} within "
                           f"{self.connect_timeout}s: {last!r}")
        err.__cause__ = last
        # A first dial too: while ours was refused, the peer (a restarted process, say) may
        # have dialled us, and failing would fail that live connection and its recvs.
        if self._dialled_us(peer, result):
            return
        if not result.done():
            result.set_exception(err)
            result.exception()  # retrieved: waiters get it through the shield
        # A first dial's error reaches whoever waited for it: logged only for debugging.
        # A lost connection that could not be made again fails what waited on it.
        self._peer_lost(peer, err, level=None if after is not None else logging.DEBUG)

    def _dialling(self, peer: Any) -> bool:
        """A dial to ``peer`` is under way."""
        dial = self._dials.get(peer.id)
        return dial is not None and not dial.done()

    def _new_dial(self, peer: Any, after: BaseException | None = None) -> asyncio.Future[Connection]:
        """Dial ``peer`` in the background (``after`` a connection lost for that reason):
        the future of the connection, or of the error that ends the dial."""
        assert self._loop is not None
        dial: asyncio.Future[Connection] = self._loop.create_future()
        self._dials[peer.id] = dial
        self._spawn(self._dial(peer, dial, after=after))
        return dial

    def _dialled_us(self, peer: Any, result: asyncio.Future[Connection]) -> bool:
        """``peer`` has a ready connection, which it dialled while we tried to connect (again):
        our dial ends with it (it may not fail what that connection now carries)."""
        for conn in peer.live_connections():
            if conn.ready:
                if peer.link is None or peer.link.closed:
                    self._link_ready(peer, conn)
                if not result.done():
                    result.set_result(conn)
                return True
        return False

    def _link_ready(self, peer: Any, conn: Connection) -> None:
        self._core.link(peer, conn)
        if peer.queue:
            assert self._loop is not None
            self._loop.call_soon(self._core.credit.pump, peer)
        if peer.held_back:
            self._core.requests.send_held_back(peer)

    def _peer_lost(self, peer: Any, err: RvzError, keep: Connection | None = None,
                   level: int | None = None) -> None:
        """Fail everything that waits on ``peer``; the next operation dials it again.

        ``keep`` is a fresh connection from the peer's new incarnation, which survives; then
        only what depended on the old process fails: requests it held (and the recvs behind
        them).  Recvs and pushes issued since may be served by the new process.
        """
        core = self._core
        if not isinstance(err.__cause__, NodeClosed):
            self._errors["peer_lost"] += 1
        if level is None:
            level = logging.INFO if isinstance(err.__cause__, NodeClosed) else logging.WARNING
        if isinstance(err.__cause__, AuthError):  # refused at each try: said in sum
            self._repeats.log(f"refused by {peer.name}", level, f"{self.name}: {err}")
        else:
            log.log(level, "%s: %s", self.name, err)
        for conn in peer.live_connections():
            if conn is not keep:
                conn.fail(err)
        # The held-back requests fail below with the recvs behind them (unless a new
        # incarnation, ``keep``, can serve them).
        peer.forget_links(keep)
        if core.holding.hold_waiters:  # a send waiting for room may wait on this peer: it dials
            core.holding.wake_holders()

        def lost(key: str) -> RvzError:
            exc = type(err)(f"{err} (key {key})")
            exc.__cause__ = err.__cause__
            return exc

        stale: set[tuple[int, str]] = set()  # (step, key) of requests the old process held
        for request_id, request in list(core.requests.by_id.items()):
            if request.peer is peer and (keep is None or request.conn not in (None, keep)):
                stale.add((request.step, request.key))
                core.requests.drop(request_id)
                if keep is None and request.conn is not None:
                    # The same process may come back and send its answer again: an answer.
                    core.requests.note_cancelled(request)
        for step, table in core.steps.tables.items():
            for key in table.keys_waiting():
                if core.routes.route(key).src == peer.id and (keep is None or (step, key) in stale):
                    table.fail_waiters(key, lambda key=key: lost(key))
        if keep is None:
            self._fail_queued_pushes(peer, lost)

    def _fail_queued_pushes(self, peer: Any, error: Callable[[str], BaseException],
                            step: int | None = None) -> None:
        """Fail the pushes waiting in ``peer``'s queue (only ``step``'s, if given); the
        rest keep their order and are pumped again."""
        queue = peer.take_queue()
        queued = self._core.credit.queued_pushes
        for item in queue:
            done, route = item[0], item[2]
            if step is not None and item[1] != step:
                peer.queue.append(item)
                continue
            queued.pop(done, None)
            if not done.done():
                done.set_exception(error(route.text))
        if step is not None and peer.queue and len(peer.queue) < len(queue):
            self._core.credit.pump(peer)  # the one that waited for credit may have been failed
