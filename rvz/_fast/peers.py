"""Who is at the other end: a key's ``Route`` (its two ends, computed once per key), each
other node's ``Peer`` (its connections and everything counted per peer: the push window both
ways, the values held for it, the numbering of values) and our outstanding requests (``Request``).

Plain state with a few helpers; the engine (``rvz._fast.engine``) decides what changes it.
"""

from __future__ import annotations

from collections import deque
from typing import Any

from ..errors import KeyFormatError
from . import codec as _codec

MAX_KEY = _codec.MAX_KEY
# What one message costs in the push window beyond its payload: it bounds the count of tiny
# (or empty) messages in flight, not only their bytes.  Both ends use the same figure.  The
# hold limit counts held Recv-Driven values the same way: 256 MiB of 64-byte values would
# otherwise be four million arrays, each with more memory around it than in it.
MESSAGE_COST = 64
UNACKED = 4  # items of ``Peer.unacked`` a value: step, request_id, key, value
# What a peer that does not say its max_parked in HELLO parks (that option's default; a
# Python global, which the node reads too).
DEFAULT_PARKS = 65536
# The lists swept of dead entries (a peer's held-back requests, the order of cancelled
# request ids, a lost consumer's due claims) are swept once they are this much longer
# than what they must keep: often enough to stay bounded, rarely enough to cost O(1) an entry.
SWEEP_SLACK = 1024


class Route:
    """What the node needs to know of a key, computed once per key string: its two ends,
    whether they are this node, and the ``Peer`` at the other end (None for a local key)."""

    __slots__ = ("text", "encoded", "src", "dst", "from_me", "to_me", "peer")

    def __init__(self, text: str, src: tuple, dst: tuple, me: tuple, peer: Any) -> None:
        self.text = text
        self.encoded = text.encode("utf-8")  # as it goes on the wire
        if len(self.encoded) > MAX_KEY:
            raise KeyFormatError(f"key of {len(self.encoded)} bytes is longer than the "
                                 f"{MAX_KEY} bytes rvz carries: {text[:80]}...")
        self.src = src
        self.dst = dst
        # ``Routes.task_of`` hands out the node's own id for its own tasks: mostly one test
        self.from_me = src is me or src == me
        self.to_me = dst is me or dst == me
        self.peer = peer


class Peer:
    """Another node: its connections, the push window it granted us, and what we owe it."""

    __slots__ = ("id", "name", "address", "out", "inbound", "incarnation", "mode",
                 "link", "credit", "asked", "queue", "owed", "owed_scheduled", "owe_now",
                 "stuck", "pushes_on", "joined_step", "steps_opened", "window", "unreturned", "answered",
                 "parks", "asking", "held_back", "held_back_mark", "lost", "held_bytes",
                 "held_count", "credit_stalls", "hold_reserved", "arriving", "tx_seq", "unacked",
                 "unacked_head", "credit_in", "credited", "rx_floor", "rx_above", "acked_sent",
                 "__weakref__")

    def __init__(self, task_id: tuple, address: str, window: int) -> None:
        self.id = task_id
        self.name = f"/job:{task_id[0]}/replica:0/task:{task_id[1]}"
        self.address = address
        self.out: Any = None                        # the connection we dialled
        self.inbound: set = set()                   # connections it dialled to us
        self.incarnation: Any = None
        self.mode = ""                              # its default mode, from its HELLO
        # The connection our requests and pushes use: the first ready one either side
        # dialled, so both directions share one socket (an answer and the next request leave
        # in one write).  It only changes when it dies, which keeps pushes in order.
        self.link: Any = None
        # The push window between us: the smaller of the two nodes' push_window options
        # (each says its own in HELLO).  Both sides use it, the producer to wait for credit,
        # the consumer to refuse a producer that does not.
        self.window = window
        self.credit = window                        # bytes we may still push to it
        # As its consumer: bytes (payload + MESSAGE_COST each) of DATA it sent us that we
        # have not credited back yet.  It survives reconnects (a producer cannot reset it by
        # reconnecting); only a new incarnation of the peer does.
        self.unreturned = 0
        # Of ``unreturned``, about how much came as answers to our requests (``check_window``).
        self.answered = 0
        # As its consumer: what its pushes whose header we admitted and whose payload is
        # still arriving will cost, on all of its connections (``Core.admit``).  It counts
        # against the window with ``unreturned``, so parallel large pushes on several
        # connections are bounded before their memory is reserved.
        self.arriving = 0
        self.asked = False                          # we asked it for credit it holds back
        # Pushes waiting for the link, credit or the socket, in call order:
        # (done future, step, route, value, dtype code, shape, nbytes).
        self.queue: deque = deque()
        self.owed = 0                               # bytes of its values we consumed, to return
        self.owed_scheduled = False
        self.owe_now = False                        # it asked: return credit at the next consumption
        # It waits for credit and the window is full of its values nobody took: our recvs
        # of its keys ask for their values, Recv-Driven, until we return credit (``unblock``).
        self.stuck = False
        # The connection its last push or CREDIT 0 came on: its link, where it pushes and
        # where our requests go (``request_link``).
        self.pushes_on: Any = None
        self.joined_step: Any = None                # the step it was last added to (a cache)
        self.steps_opened = 0                       # tables its frames made (``remote_table``)
        # As its consumer: it parks at most ``parks`` of our requests (its max_parked, from
        # its HELLO) and closes the connection past that.  ``asking`` maps each request of
        # ours it may hold parked (sent, neither answered nor cancelled) to its connection;
        # the requests past the limit wait here, in ``held_back``, and go as answers come
        # (``send_held_back``): a recv_many of more keys than it parks is not a violation.
        self.parks = DEFAULT_PARKS
        self.asking: dict = {}
        self.held_back: deque = deque()
        self.held_back_mark = SWEEP_SLACK          # its length that makes ``hold_back`` sweep it
        # As its producer: the Recv-Driven values we hold for it (payload bytes, count) and
        # the room our sends waiting to hold more for it reserved (``Core.reserve_hold``).
        # While it is ``lost`` (no ready connection: never connected yet, or every
        # connection closed) they are counted apart as well, in ``Core.lost_*``
        # (``Core.regroup``): they hold back the sends to other consumers only beyond
        # ``lost_hold_limit``.
        self.lost = True
        self.held_bytes = 0
        self.held_count = 0
        self.credit_stalls = 0             # pushes that waited for its credit (stats)
        self.hold_reserved = 0
        # Exactly-once delivery across reconnects of one incarnation (``Credit.resend``).
        # As its producer: the number of the last value we sent it, and the values it has
        # not acknowledged yet, ``unacked[unacked_head:]`` (UNACKED items a value, flat: no
        # tuple lives on for the garbage collector to walk until the ACK), kept to be sent
        # again after a reconnect; the credit it returned, as its running total (a CREDIT
        # lost with a connection is made up by the next one).
        self.tx_seq = 0
        self.unacked: list = []
        self.unacked_head = 0
        self.credit_in = 0
        # As its consumer: the credit we returned (running total); every value numbered
        # ``rx_floor`` or below arrived, and so did those in ``rx_above`` (a copy that
        # comes again is dropped); ``acked_sent`` is the last ACK we sent.
        self.credited = 0
        self.rx_floor = 0
        self.rx_above: set = set()
        self.acked_sent = 0

    def live_connections(self) -> list:
        conns = [c for c in self.inbound if not c.closed]
        out = self.out
        if out is not None and not out.closed:
            conns.append(out)
        # The connection we dialled can be the link before ``out`` is set: uvloop runs its
        # protocol's callbacks (HELLO both ways included) before create_connection returns.
        link = self.link
        if link is not None and not link.closed and link is not out and link not in self.inbound:
            conns.append(link)
        return conns

    def kept(self) -> int:
        """How many values we keep for it until it acknowledges them."""
        return (len(self.unacked) - self.unacked_head) // UNACKED

    def keep(self, step: Any, request_id: Any, key: Any, value: Any) -> None:
        """Keep a value we sent it until it acknowledges it (``Credit.resend``)."""
        unacked = self.unacked
        unacked.append(step)
        unacked.append(request_id)
        unacked.append(key)
        unacked.append(value)

    def acked(self, values: int) -> None:
        """The oldest ``values`` of those kept were acknowledged: stop keeping them."""
        head = self.unacked_head + UNACKED * values
        if 2 * head >= len(self.unacked):  # most of the list is acknowledged: drop that part
            del self.unacked[:head]
            head = 0
        self.unacked_head = head

    def unconnected(self) -> bool:
        """No live connection to it (a live link answers without building the list)."""
        link = self.link
        return (link is None or link.closed) and not self.live_connections()

    def dialled(self, conn: Any) -> None:
        """``conn``, a connection we dialled, completed its handshake."""
        self.out = conn

    def dropped(self, conn: Any) -> None:
        """``conn`` closed: it carries nothing to or from this peer any more."""
        if self.out is conn:
            self.out = None
        if self.link is conn:
            self.link = None
        self.inbound.discard(conn)

    def forget_links(self, keep: Any) -> None:
        """The peer was lost: of its connections only ``keep`` (a new incarnation's, or
        None) stays, with the requests it parks; what tracked the lost link is reset.
        Values it has not acknowledged are kept, with their credit, for the same process
        coming back (``Core.new_incarnation`` resets both for a new one).  What we owe it
        is kept and goes on the next connection, so ``unreturned`` stays right."""
        if self.out is not keep:
            self.out = None
        self.inbound = {c for c in self.inbound if c is keep}
        if self.link is not keep:
            self.link = None
        self.asking = {i: c for i, c in self.asking.items() if c is keep}
        if keep is None:
            self.held_back.clear()
        self.asked = False
        self.owe_now = False
        self.stuck = False
        self.pushes_on = None

    def new_incarnation(self, window: int) -> None:
        """The peer is a new process: nothing of the old one counts (its credit, what it
        owed us or we owed it, the values we kept for it and the numbers of its values)."""
        self.unreturned = 0
        self.answered = 0
        self.owed = 0
        self.window = window
        self.credit = window
        self.credit_in = 0
        self.credited = 0
        self.tx_seq = 0
        self.unacked = []
        self.unacked_head = 0
        self.rx_floor = 0
        self.rx_above.clear()
        self.acked_sent = 0

    def take_queue(self) -> Any:
        """The pushes queued for this peer; its queue is empty after."""
        queue = self.queue
        self.queue = deque()
        return queue

    def left_step(self, step: Any) -> None:
        """``step`` is gone: if it joined that one last, it has joined none."""
        if self.joined_step == step:
            self.joined_step = None

    def __repr__(self) -> str:
        return f"<Peer {self.name} at {self.address}>"


class Request:
    """A Recv-Driven request we sent and that has not been answered yet."""

    __slots__ = ("id", "peer", "step", "key", "route", "conn")

    def __init__(self, request_id: int, peer: Peer, step: Any, route: Route) -> None:
        self.init(request_id, peer, step, route)

    def init(self, request_id: int, peer: Peer, step: Any, route: Route) -> None:
        self.id = request_id
        self.peer = peer
        self.step = step
        self.key = route.text
        self.route = route     # its answer's route (the key checked once, when asked)
        self.conn: Any = None  # where it went: a CANCEL must follow it there
