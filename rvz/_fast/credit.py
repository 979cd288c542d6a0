"""Where credit is counted: the push window between this node and each peer, both ways.

As a producer, a push spends the consumer's credit (``push``, ``pump``), waits in the peer's
queue when there is none, and gets it back from the consumer's CREDIT (``returned``).  As a
consumer, what our recvs take is owed back and returned in batches of a quarter window
(``consumed_from``, ``flush_credit_now``), and a producer that pushes beyond the window it
was granted is refused (``check_window``).  The numbering of values (``fresh``, ``on_ack``,
``resend``) travels with the credit: an ACK goes with each CREDIT, and what a producer keeps
until it is acknowledged is bounded by the window.
"""

from __future__ import annotations

from typing import Any

from ..errors import ProtocolError
from . import codec as _codec
from .peers import MESSAGE_COST, SWEEP_SLACK, Peer, Route
from .table import EMPTY
from .wire import Wire

encode_credit = _codec.encode_credit
encode_ack = _codec.encode_ack


class Credit:
    """The push window of every peer, and the pushes waiting for it."""

    def __init__(self, peers: dict, host: Any) -> None:
        self.peers = peers                 # the core's (job, task) -> Peer
        self.host = host                   # rvz._fast.host.Host: links a peer a push waits for
        self.loop: Any = None              # the node's loop (``attach``): credit goes back from it
        # The done future of every push in a peer's queue -> that peer: ``drop_push`` looks
        # for a push only there, and only if it is still queued (a burst of sends timing
        # out, whose pushes the pump had mostly dropped already, scanned every queue whole
        # for each of them).
        self.queued_pushes: dict = {}

    def attach(self, loop: Any) -> None:
        """The event loop the node runs on (``Core.attach``)."""
        self.loop = loop

    def returned(self, peer: Peer, conn: Any, nbytes: Any) -> bool:
        """A CREDIT frame from ``peer``, on ``conn``: its running total of what it returned,
        or 0 when it waits for credit we hold back in a batch (then True: the caller checks
        whether we are stuck too)."""
        if nbytes == 0:  # the producer waits for credit we hold back in a batch
            peer.owe_now = True
            peer.pushes_on = conn  # its link: where it pushes and says it waits
            self.flush_credit_now(peer)
            return True
        # A running total: one that adds nothing (it came again, or late) changes nothing.
        if nbytes > peer.credit_in:
            peer.credit = min(peer.credit + (nbytes - peer.credit_in), peer.window)
            peer.credit_in = nbytes
        peer.asked = False
        if peer.queue:
            self.pump(peer)
        return False

    def arrived(self, conn: Wire) -> None:
        """The push ``conn`` admitted has arrived, or never will (the connection closed):
        what it reserved of its peer's window is free again."""
        cost = conn.arriving
        if cost != 0:
            conn.arriving = 0
            conn.peer.arriving -= cost

    def check_window(self, peer: Peer, cost: Any) -> None:
        """A push of ``cost`` arrives: refuse a producer that ignores the window we granted.

        The producer may push while its credit covers the message, or one message of any
        size when it has nothing unreturned.  What it cannot know when it reconnects (what
        we still had not credited) is allowed for: the limit is twice the window.  Answers
        to our requests do not count: they need no credit, and on a one-sided connection
        one sent after a push may arrive before it (the push waiting for slots, the answer
        written straight into its destination), so the producer had not counted it when
        it pushed.  ``answered`` holds their bytes until that much credit went back (an
        upper bound on what of ``unreturned`` was pushed: the limit never tightens).
        Pushes still arriving on any of its connections (``arriving``) count as well: a
        producer that starts large pushes on several connections at once gets one.
        """
        before = peer.unreturned - peer.answered + peer.arriving
        # (``cost`` alone stays a Python int: from a frame's header it may exceed any C type)
        if before > 0 and cost > 2 * peer.window - before:
            raise ProtocolError(f"{peer.name} pushed beyond the push window: {before} bytes "
                                f"unreturned, {cost} more, window {peer.window}")

    def push(self, peer: Peer, step: Any, route: Route, value: Any, code: int, shape: tuple,
             nbytes: int) -> bool:
        """Send-Driven: write the value to its consumer now if the link, its credit and the
        socket allow; False if it must wait (``queue_push``)."""
        conn = self.push_link(peer, nbytes)
        if conn is None:
            return False
        peer.credit -= nbytes + MESSAGE_COST
        conn.write_value(step, 0, route.encoded, value, code, shape, nbytes)
        return True

    def push_link(self, peer: Peer, nbytes: int) -> Any:
        """The link a push of ``nbytes`` is written to at once (``open_link``, and the
        credit allows it; a value larger than the whole window goes when all of it is
        back), else None: the push would wait in the peer's queue."""
        conn = self.open_link(peer)
        cost = nbytes + MESSAGE_COST
        if conn is not None and (peer.credit >= cost or peer.credit >= peer.window):
            return conn
        return None

    def open_link(self, peer: Peer) -> Any:
        """The link a push to ``peer`` may be written to now (handshake done, open, not
        paused, no earlier push queued before it), else None."""
        conn = peer.link
        if (conn is not None and not peer.queue and conn.ready and not conn.closed
                and not conn.paused and not conn.closed_here):
            return conn
        return None

    def queue_push(self, done: Any, peer: Peer, step: Any, route: Route, value: Any, code: int,
                   shape: tuple, nbytes: int) -> Any:
        """Queue a push behind earlier ones; ``done`` (a future) completes when it is
        written (``pump``)."""
        peer.queue.append((done, step, route, value, code, shape, nbytes))
        self.queued_pushes[done] = peer
        self.pump(peer)
        return done

    def drop_push(self, done: Any) -> Any:
        """Take the queued push behind ``done``, which its send gave up (timed out or was
        cancelled), out of its peer's queue; returns ``(peer, item)``, or None when it is
        not queued (any more).  Done pushes are otherwise dropped only when they reach the
        queue's head.  One that was at the head may have held back the ones behind it
        (waiting for credit it alone needed): they are pumped."""
        peer = self.queued_pushes.pop(done, None)
        if peer is None:
            return None
        queue = peer.queue
        i = 0
        for item in queue:
            if item[0] is done:
                del queue[i]
                if i == 0 and queue:
                    self.pump(peer)
                return (peer, item)
            i += 1
        return None

    def pump(self, peer: Peer) -> None:
        """Write queued pushes while the link, credit and socket allow; else arrange a wake-up."""
        queue = peer.queue
        while queue:
            item = queue[0]
            done = item[0]
            if done.done():  # cancelled or timed out before it went out
                queue.popleft()
                self.queued_pushes.pop(done, None)
                continue
            conn = peer.link
            if conn is not None and conn.closed_here:
                return  # we said BYE on it, so nothing may follow: close() fails what is left
            if conn is None or conn.closed or not conn.ready:
                self.host.start_link(peer)  # the node pumps again once linked
                return
            if conn.paused:
                conn.on_resume = self.pump_later  # resume_writing pumps again
                return
            nbytes = item[6]
            cost = nbytes + MESSAGE_COST
            if not (peer.credit >= cost or peer.credit >= peer.window):
                if not peer.asked:  # the consumer may be holding back a batch: ask for it
                    peer.asked = True
                    conn.write_frame(encode_credit(0))
                return  # on_credit pumps again
            queue.popleft()
            self.queued_pushes.pop(done, None)
            peer.credit -= cost
            route = item[2]
            conn.write_value(item[1], 0, route.encoded, item[3], item[4], item[5], nbytes)
            done.set_result(None)

    def pump_later(self, conn: Any) -> None:
        if conn.peer is not None:
            self.pump(conn.peer)

    def consumed_from(self, peer: Peer, nbytes: int) -> None:
        """A value of ``nbytes`` from ``peer`` left our table: grant it the space again."""
        peer.owed += nbytes + MESSAGE_COST
        # Credit goes back in batches of a quarter window (one frame per many messages),
        # or at once when the producer said it is waiting for it.
        if (peer.owe_now or peer.owed >= peer.window >> 2) and not peer.owed_scheduled:
            peer.owed_scheduled = True
            self.loop.call_soon(self.flush_credit, peer)

    def unconsumed(self, peer: Peer, nbytes: int) -> None:
        """A value of ``nbytes`` we counted as consumed went back to its queue (a
        cancelled recv)."""
        peer.owed -= nbytes + MESSAGE_COST

    def flush_credit(self, peer: Peer) -> None:
        peer.owed_scheduled = False
        self.flush_credit_now(peer)

    def flush_credit_now(self, peer: Any) -> None:
        if peer is None or peer.owed <= 0:
            return
        conns = peer.live_connections()
        if conns:
            peer.owe_now = False
            peer.stuck = False
            peer.credited += peer.owed
            if conns[0].dataplane is not None:  # one-sided: with the data, one wake-up less
                conns[0].dataplane.send_credit(peer.credited)
            else:
                conns[0].write_frame(encode_credit(peer.credited))
            if peer.rx_floor != peer.acked_sent:
                peer.acked_sent = peer.rx_floor
                conns[0].write_frame(encode_ack(peer.rx_floor))
            peer.unreturned -= peer.owed
            peer.answered = peer.answered - peer.owed if peer.answered > peer.owed else 0
            peer.owed = 0

    def unqueue_push(self, peer: Peer, step: Any, text: str) -> Any:
        """Take the oldest push of key ``text`` out of ``peer``'s queue (its ``send``
        completes), or return ``EMPTY``.  Pushes of that key ahead of it are already on the
        wire, so the consumer still sees the key's values in order: over TCP the answer goes
        on our link, and on a one-sided channel the request came on it, where the consumer
        read our pushes or our CREDIT 0 (``request_link``)."""
        queue = peer.queue
        i = 0
        for item in queue:
            if item[1] == step and item[2].text == text and not item[0].done():
                del queue[i]
                self.queued_pushes.pop(item[0], None)
                item[0].set_result(None)
                return item[3]
            i += 1
        return EMPTY

    def fresh(self, peer: Peer, seq: Any) -> bool:
        """Value number ``seq`` of ``peer`` arrived: False if we had it already."""
        floor = peer.rx_floor
        above = peer.rx_above
        if seq == floor + 1:
            floor = seq
            while above and floor + 1 in above:
                floor += 1
                above.discard(floor)
            peer.rx_floor = floor
            return True
        if seq <= floor or seq in above:
            return False
        # Beyond a gap: the values before it are still on their way (another connection,
        # or sent again after a reconnect).  A producer leaves gaps only that wide.
        if len(above) > 2 * peer.window // MESSAGE_COST + SWEEP_SLACK:
            raise ProtocolError(f"{peer.name} numbered its values with gaps wider than its "
                                "push window")
        above.add(seq)
        return True

    def on_ack(self, conn: Wire, seq: Any) -> None:
        """The consumer has every value numbered ``seq`` or below: stop keeping them."""
        peer = conn.peer
        if seq > peer.tx_seq:
            raise ProtocolError(f"{peer.name} acknowledged value {seq}; we sent {peer.tx_seq}")
        fresh = seq - (peer.tx_seq - peer.kept())
        if fresh > 0:
            peer.acked(fresh)

    def resend(self, peer: Peer, conn: Wire) -> None:
        """Send ``peer`` again, on ``conn``, every value it has not acknowledged, oldest
        first (a connection that carried them closed); it drops the copies it has."""
        kept = peer.kept()
        if kept and conn.ready and not conn.closed and not conn.closed_here:
            conn.resend(peer.tx_seq - kept + 1, peer.unacked[peer.unacked_head:])

    def resync(self, peer: Peer, conn: Wire, window: int) -> None:
        """A new connection to the same incarnation of ``peer``, which grants ``window``
        now: tell it again the credit we returned and the values we have (either may have
        been lost with the last one)."""
        if window != peer.window:
            peer.credit += window - peer.window
            peer.window = window
        if peer.credited > 0:
            conn.write_frame(encode_credit(peer.credited))
        if peer.rx_floor > 0:
            peer.acked_sent = peer.rx_floor
            conn.write_frame(encode_ack(peer.rx_floor))

    def drop_unacked(self, peer: Peer) -> None:
        """``peer`` refused what we sent (a protocol error): send none of it again.  The
        credit those values held comes back (what it had not credited of them it allows
        for, as after any reconnect: twice the window)."""
        peer.unacked = []
        peer.unacked_head = 0
        peer.credit = peer.window
