"""What the engine hands up to the node: a peer's HELLO and AUTH (the verdicts are
``rvz.handshake``'s; binding the connection to its peer and replacing a restarted process
are here), a peer's ERROR frames and its step clean-ups.

``Peering`` is a part of ``rvz.node.Node`` (a base class), in a module of its own.
"""

from __future__ import annotations

import logging
from typing import Any

from . import _impl
from .connection import Connection
from .errors import Aborted, AuthError, PeerLost, ProtocolError, RemoteError, RvzError, WrongEndpoint
from .handshake import check_certificate
from .nodestate import NodeState, TaskId

log = logging.getLogger("rvz.node")
nbytes_of = _impl.engine.nbytes_of

# A peer needs one or two connections (each side may dial); a few more cover reconnects
# whose old connection is not known dead yet.  More is a peer holding sockets open.
_MAX_INBOUND_PER_PEER = 8
_ABORT_TEXT_MAX = 1024  # characters of a peer's step clean-up message that are kept


class Peering(NodeState):
    """A node's side of its peers' handshakes, errors and step clean-ups."""

    def _in_cluster(self, task_id: TaskId) -> bool:
        try:
            self.cluster.address(*task_id)
        except KeyError:
            return False
        return True

    def _on_hello(self, conn: Connection, fields: dict[str, Any]) -> None:
        """The peer's HELLO: accepted now, or answered with our AUTH (rvz.handshake)."""
        self._handshake.hello_on(self._core, conn, fields, self._accept_peer)

    def _on_auth(self, conn: Connection, fields: dict[str, Any]) -> None:
        """The peer's proof that it holds the secret, bound to this connection's nonces."""
        self._handshake.auth_on(conn, fields, self._accept_peer)

    def _accept_peer(self, conn: Connection) -> None:
        """The handshake is complete: bind the connection to its peer and open it."""
        hello = conn.hello
        incarnation, window = hello.incarnation, min(hello.window, self.push_window)
        peer = conn.peer
        self._check_certificate(conn, peer)
        self._handshake.check_replaced(
            peer.id, incarnation, peer.incarnation,
            any(c.ready and not c.bye_received for c in peer.live_connections()))
        if not conn.outbound:
            if len([c for c in peer.inbound if not c.closed]) >= _MAX_INBOUND_PER_PEER:
                raise ProtocolError(f"{peer.name} opened more than {_MAX_INBOUND_PER_PEER} "
                                    "connections")
            peer.inbound.add(conn)
        if self._onesided is not None:  # agree on the transport; TransportError fails conn
            self._onesided.on_hello(conn, hello.fields)
        if peer.incarnation != incarnation:
            self._replace_incarnation(peer, conn, incarnation, window)
        else:
            self._core.credit.resync(peer, conn, window)
        self._core.accepted(peer, conn, incarnation, hello.parks, hello.mode)
        if peer.link is None or peer.link.closed:
            # The first ready connection either side dialled carries our traffic: a push
            # to a consumer that dialled us need not wait for a dial of our own.
            self._link_ready(peer, conn)
        waiter = conn.hello_waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)
        if peer.mode == "recv" and self.mode == "send":
            self._ask_holder(peer)

    def _check_certificate(self, conn: Connection, peer: Any) -> None:
        """With ``tls_identity``, the peer's TLS certificate must name the task it claims."""
        if self.tls_identity:
            transport = getattr(conn, "transport", None)
            check_certificate(transport.get_extra_info("peercert") if transport else None,
                              peer.id)

    def _replace_incarnation(self, peer: Any, conn: Connection, incarnation: int,
                             window: int) -> None:
        """``peer`` is a new process (``incarnation``), or a replaced one taken back: fail
        what depended on the one it replaces and drop everything kept for that one."""
        old = peer.incarnation
        if old is not None:
            self._handshake.replaced(peer.id, old)
            err = PeerLost(f"peer {peer.name} restarted (new incarnation)")
            err.__cause__ = ConnectionResetError(f"{peer.name} restarted")
            self._peer_lost(peer, err, keep=conn)
            self._core.steps.forget_dead_of(peer.id, old)
            self._drop_values_of(peer, old)
        self._core.new_incarnation(peer, window)  # nothing of the old process counts

    def _drop_values_of(self, peer: Any, incarnation: int) -> None:
        """Drop the values ``peer``'s replaced processes pushed here that nobody took.

        Called as its new incarnation is accepted, before any frame of that one is read, so
        every value from that task still queued came from a process that is gone.  Kept,
        a peer restarting again and again while nobody receives made the node hold up to a
        push window per incarnation, for ever.  Their steps' tables, empty now, go at the
        next heartbeats.  (A recv of such a value fails or times out as for any value a
        crashed process never sent.)"""
        core = self._core
        count = nbytes = 0
        for table in list(core.steps.tables.values()):
            for key in table.queued_keys():
                if core.routes.route(key).src != peer.id:
                    continue
                for _ in range(table.queued(key)):
                    nbytes += nbytes_of(table.take(key))
                    count += 1
        if count:
            self._repeats.log("replaced-values", logging.WARNING,
                              f"{self.name}: dropped {count} value(s) ({nbytes} bytes) that "
                              f"{peer.name} incarnation {incarnation:#x} pushed and nobody "
                              "received: a newer incarnation replaced it")

    def _ask_holder(self, peer: Any) -> None:
        """Request what we already wait for from a peer we just learned holds its values."""
        core = self._core
        for step, table in list(core.steps.tables.items()):
            for key in table.keys_waiting():
                route = core.routes.route(key)
                if route.src == peer.id:
                    core.requests.ask_missing(peer, step, route, table)

    def _on_error(self, conn: Connection, fields: dict[str, Any]) -> None:
        core = self._core
        if not conn.ready or (conn.outbound and fields.get("code") == "auth"):
            # A refused handshake says ERROR: before it is complete here, or after, when the
            # listener refused us (without a secret each side takes the other's HELLO as it
            # comes, so a dialler may already have taken the connection).
            if fields.get("code") == "auth":
                raise AuthError(f"{conn.peer_name()} refused this node: "
                                f"{str(fields.get('msg', ''))[:500]}")
            raise ProtocolError(f"{conn.peer_name()} sent an ERROR frame before "
                                "completing its handshake")
        request_id = fields.get("req", 0)
        if not isinstance(request_id, int):  # int("x") would raise into the event loop
            raise ProtocolError(f"{conn.peer_name()} sent an ERROR frame whose request id "
                                f"is not a number: {fields!r}")
        if request_id == 0 and fields.get("code") == "protocol":
            # It closes this connection for something we sent: not a broken link.  What it
            # did not acknowledge is not sent again (it would be refused again).
            core.credit.drop_unacked(conn.peer)
            conn.close_because(ProtocolError(f"{conn.peer_name()} closed the connection: "
                                             f"{str(fields.get('msg', ''))[:500]}"))
            return
        core.requests.asked_no_more(conn.peer, request_id)
        request = core.requests.by_id.get(request_id)
        if request is None:
            # One we cancelled: the producer dropped it (code "cancelled") or failed it
            # first; nothing of it follows.  Else a stray answer.
            core.requests.settled(conn.peer, request_id)
            return
        if request.peer is not conn.peer:
            return  # about a request we did not send to this peer
        core.requests.drop(request_id)
        peer_name = conn.peer_name()
        message = str(fields.get("msg", ""))
        code = str(fields.get("code", ""))
        cause = RemoteError(message, peer_name, code)
        table = core.steps.tables.get(request.step)
        if table is None:
            return
        cls: type[RvzError] = {"aborted": Aborted, "WrongEndpoint": WrongEndpoint}.get(code, RemoteError)

        def error() -> RvzError:
            # An abort leads with its step and who cleaned it up, as a Send-Driven recv's
            # does (cleanup_step); other failures lead with the producer that could not answer.
            exc = cls(f"{message} (key {request.key})" if cls is Aborted
                      else f"{peer_name} could not answer key {request.key}: {message}")
            exc.__cause__ = cause
            return exc

        table.fail_waiters(request.key, error)

    def _on_abort_step(self, conn: Connection, step: int, message: str) -> None:
        name = conn.peer_name()
        if step == 0:  # no node sends it (cleanup_step(0) is refused): a broken peer
            raise ProtocolError(f"{name} tried to abort step 0, the step of plain send/recv")
        # Kept for every dead step (up to Steps.dead_max of them): a peer's text is cut to a
        # length that names a reason, not one that fills memory.
        message = message[:_ABORT_TEXT_MAX]
        # Said once: a message relayed from node to node already names who started it.
        incarnation = conn.peer.incarnation if conn.peer is not None else None
        text = (message if " by /job:" in message
                else f"{message} (by {name}, incarnation {incarnation:#x})")
        self._abort_step(step, text, RemoteError(message, name), origin=conn.peer)
