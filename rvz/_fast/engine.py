"""The protocol engine: what one message costs between the public API and the socket.

No sockets and no awaits here (the event loop is used only to create futures and schedule
callbacks); the connections (``rvz._fast.wire.Wire``) feed it every frame of a read in one
``Core.dispatch`` call, and the node calls it from its public API.

``Core`` is the node's protocol state.  It holds the parts that own their state:
``Steps`` (``rvz._fast.steps``: each step's table, the dead steps), ``Holding``
(``rvz._fast.holding``: held Recv-Driven values and their claims), ``Requests``
(``rvz._fast.requests``: the Recv-Driven requests we sent), ``Credit``
(``rvz._fast.credit``: the push window both ways, the pushes waiting for it, the numbering
of values), ``Routes`` (``rvz._fast.routes``: where each key goes, and the ``Peer`` of
each other node, ``rvz._fast.peers``), and keeps what spans them: the send and recv entry
points, answers, and dispatch.

Everything that dials, times out or spans several peers (connections, heartbeats, steps,
close) stays in ``rvz.node.Node``; this module calls up into it only through the methods
of ``rvz._fast.host.Host`` (``Core.host``).
"""

from __future__ import annotations

from asyncio import Future
from asyncio.events import _get_running_loop
from os import getpid
from threading import get_ident
from typing import Any

from numpy import ndarray

from ..errors import (
    Aborted,
    AuthError,
    KeyFormatError,
    ProtocolError,
    TransportError,
    WrongEndpoint,
)
from . import codec as _codec
from .credit import Credit
from .deadlines import Deadlines
from .format import FIELD, KEY, KEYS, KIND, MESSAGE, REQUEST_ID, STEP, VALUE, VALUES
from .holding import Holding
from .into import Landings
from .peers import MESSAGE_COST, Peer, Route
from .requests import Requests
from .routes import Routes
from .steps import Steps
from .table import EMPTY, Table, Waiter, check_timeout, naming
from .wire import Dispatcher, Wire

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

describe = _codec.describe
encode_requests_split = _codec.encode_requests_split
encode_cancel = _codec.encode_cancel
encode_error = _codec.encode_error
DATA = _codec.DATA
DATA_MANY = _codec.DATA_MANY
MAX_KEY = _codec.MAX_KEY
BYTES_CODE = _codec.BYTES_CODE
REQUEST = _codec.REQUEST
CREDIT = _codec.CREDIT
SEQ = _codec.SEQ
ACK = _codec.ACK
CANCEL = _codec.CANCEL
HELLO = _codec.HELLO
ERROR = _codec.ERROR
ABORT_STEP = _codec.ABORT_STEP
BYE = _codec.BYE
PING = _codec.PING
AUTH = _codec.AUTH



# The two modes.  The engine keeps only these two objects as modes (``canonical_mode``,
# ``Core.check_mode``), so that the per-message tests are identity tests.
RECV = "recv"
SEND = "send"


def canonical_mode(mode: Any) -> Any:
    """``RECV`` or ``SEND`` for a mode spelled either way; anything else unchanged."""
    if mode == RECV:
        return RECV
    if mode == SEND:
        return SEND
    return mode


def describe_value(value: Any) -> tuple:
    """``(value, code, shape, nbytes)`` of a value to send (arrays.pyx's C call, compiled)."""
    if COMPILED:
        return describe_c(value)  # type: ignore[name-defined]  # noqa: F821
    return describe(value)


def local_value(value: Any, code: int) -> Any:
    """What a recv of a key from this node to itself gets for a described value: a value
    of the type a peer's recv would get.  ``bytes`` for a ``bytes``-like value (a
    ``bytearray`` or ``memoryview`` is copied into its bytes, as the wire copies it), a
    plain ``ndarray`` view of an array subclass (``np.matrix``, ``np.memmap``); ``bytes``
    and plain arrays are handed over as they are."""
    if code == BYTES_CODE:
        return value if type(value) is bytes else bytes(value)
    if type(value) is not ndarray:
        return value.view(ndarray)
    return value


def thread_ident() -> int:
    """The calling thread's id (``threading.get_ident``; compiled, the C call itself)."""
    if COMPILED:
        return PyThread_get_thread_ident()  # type: ignore[name-defined]  # noqa: F821
    return get_ident()


def nbytes_of(value: Any) -> int:
    """Payload bytes of a value: what the push window and the hold limit count."""
    if COMPILED:  # arrays.pyx's C functions (*_c) are cimported in engine.pxd
        return nbytes_c(value)  # type: ignore[name-defined]  # noqa: F821
    n = getattr(value, "nbytes", None)
    return len(value) if n is None else int(n)


def wrong_loop(name: str, pid: int, loop: Any) -> str:
    """Why a call from here cannot run on node ``name``, started in process ``pid`` on
    ``loop`` (``Core.enter``): the advice differs with the state of
    the node's loop (a closed one, as pytest-asyncio's per-test loops leave behind, is
    the usual case)."""
    if pid != getpid():
        return (f"node {name} was started in process {pid}, and this process "
                f"({getpid()}) is a child forked from it: the node's connections are the "
                "parent's, and a child cannot use them; start a node of its own in the "
                "child (close() and abort() on the inherited one do nothing)")
    if loop.is_closed():
        return (f"node {name} was started on an event loop that is now closed: a "
                "node lives and dies with the loop that started it; start a new node on "
                "this loop")
    if not loop.is_running():
        return (f"node {name} belongs to an event loop that is not running: call it "
                "from a coroutine on that loop")
    return (f"node {name} runs on another thread's event loop; call it from that "
            "thread, e.g. asyncio.run_coroutine_threadsafe(node.recv(key), node_loop)")


class RemoteWaiter(Waiter):
    """A remote consumer's request parked in our table (a ``Waiter``)."""

    __slots__ = ("core", "conn", "step", "request_id", "route", "_done")

    def __init__(self, core: Core, conn: Wire, step: Any, request_id: Any, route: Route) -> None:
        self.init(core, conn, step, request_id, route)

    def init(self, core: Core, conn: Wire, step: Any, request_id: Any, route: Route) -> None:
        self.core = core
        self.conn = conn
        self.step = step
        self.request_id = request_id
        self.route = route
        self._done = False

    def done(self) -> bool:
        return self._done or self.conn.closed

    def cancel(self) -> None:
        self._done = True

    def set_result(self, value: Any) -> None:
        self._done = True
        self.conn.parked.pop(self.request_id, None)
        self.core.answer(self.conn, self.step, self.request_id, self.route, value)

    def set_exception(self, exc: BaseException) -> None:
        self._done = True
        self.conn.parked.pop(self.request_id, None)
        code = "aborted" if isinstance(exc, Aborted) else type(exc).__name__
        # The consumer's error names the key it asked for; the table's says it again.
        text = str(exc).removesuffix(naming(self.route.text))
        self.conn.write_frame(encode_error(self.request_id, self.step, self.route.text, code,
                                           text))


class Core(Dispatcher):
    """The node's protocol state and its per-message work (see the module docstring)."""

    def __init__(self, host: Any, cluster: Any, task_id: tuple, name: str, mode: str,
                 loop: Any, push_window: int, hold_limit: int, claim_timeout: Any,
                 max_parked: int = 65536, max_steps: int = 65536,
                 answer_backlog: int = 32 << 20, lost_hold_limit: Any = None) -> None:
        self.host = host                   # a rvz._fast.host.Host: the node that owns this core
        self.cluster = cluster
        self.id = task_id
        self.name = name
        self.mode = canonical_mode(mode)
        self.running = False               # sends and recvs accepted
        self.closed = False                # nothing is served any more
        self.push_window = push_window
        self.peers: dict = {}              # (job, task) -> Peer
        # the step registry: each step's table, the dead steps, who took part in each
        others = len(cluster.tasks()) - 1 if cluster is not None else 1
        self.steps = Steps(max_steps, others)
        # where each key goes: its two ends and the Peer at the other end
        self.routes = Routes(cluster, task_id, self.peers, push_window)
        # the Recv-Driven requests we sent: outstanding, held back, cancelled
        self.requests = Requests(self.steps, host)
        # the push window both ways: pushes spend it, what our recvs take returns it
        self.credit = Credit(self.peers, host)
        self.holding = Holding(hold_limit, lost_hold_limit, claim_timeout, self.steps.tables)
        self.max_parked = max_parked       # a peer's parked requests on one connection
        self.answer_backlog = answer_backlog  # unsent output beyond which answers wait
        self.waits_producer = 0            # how often a send had to wait (window, hold limit)
        self.waits_consumer = 0            # how often a recv had to wait for its value
        self.into = Landings(self.steps.tables)  # the recvs waiting with an into= buffer
        self.attach(loop, 0)

    # -- keys and tables ----------------------------------------------------------------

    def own_route(self, key: Any, sending: bool) -> Route:
        """The route of a key this node may send (its src) or receive (its dst) now."""
        route = self.routes.route(key)
        if not (route.from_me if sending else route.to_me):
            end = route.src if sending else route.dst
            op, role = ("send", "source") if sending else ("recv", "destination")
            raise WrongEndpoint(f"cannot {op} key {route.text} on {self.name}: its {role} is "
                                f"/job:{end[0]}/task:{end[1]}")
        if not self.running:
            self.host.check_running(route.text)
        return route

    def admit(self, conn: Wire, step: Any, request_id: Any, key: str, nbytes: Any) -> None:
        """Check a DATA frame at its header, before memory is allocated for its payload:
        its route, and for a push the window its producer must respect."""
        peer = conn.peer
        if peer is None or not conn.ready:
            raise ProtocolError("DATA before the handshake")
        try:
            route = self.routes.route(key)
        except (KeyFormatError, WrongEndpoint) as exc:
            raise ProtocolError(f"{peer.name} sent a key we cannot route: {exc}") from None
        if not route.to_me or route.peer is not peer:
            raise ProtocolError(f"{peer.name} sent key {key}, which does not route from it to "
                                f"{self.name}")
        if request_id:
            request = self.requests.by_id.get(request_id)
            if request is not None:
                if request.peer is not peer:
                    raise ProtocolError(f"{peer.name} answered request {request_id}, which "
                                        f"went to {request.peer.name}")
                return
            if self.requests.cancelled.get(request_id) is peer:
                return
        cost = nbytes + MESSAGE_COST  # not asked for: a push
        self.credit.check_window(peer, cost)
        peer.arriving += cost
        conn.arriving = cost

    def arrived(self, conn: Wire) -> None:
        """The push ``conn`` admitted has arrived, or never will (``Credit.arrived``)."""
        self.credit.arrived(conn)

    def attach(self, loop: Any, thread: int) -> None:
        """The event loop the node runs on, and the thread that runs it (Node.start's)."""
        self.loop = loop
        self.timers = None if loop is None else Deadlines(loop)  # the timeouts of waits
        self.credit.attach(loop)
        self.loop_thread = thread
        self.pid = getpid()  # a forked child's copy of the node says it is not its own
        self.loop_running: Any = None if loop is None else loop.is_running  # bound once
        # Compiled, when the loop's futures are plain asyncio futures (uvloop's and
        # asyncio's are), ``future`` calls the type with a keyword dict made here:
        # ``create_future`` spells ``loop=`` out, which builds a new dict for every future
        # (a third of its cost).  A loop with futures of its own keeps ``create_future``.
        plain = COMPILED and loop is not None and type(loop.create_future()) is Future
        self.future_kw = {"loop": loop} if plain else None

    def future(self) -> Any:
        """A new future of the node's loop (``loop.create_future()``, see ``attach``)."""
        if COMPILED and self.future_kw is not None:
            return PyObject_Call(Future, (), self.future_kw)  # type: ignore[name-defined]  # noqa: F821
        return self.loop.create_future()

    def check_mode(self, mode: Any) -> str:
        if mode is None:
            return self.mode
        if mode is RECV or mode is SEND:
            return mode
        canonical = canonical_mode(mode)
        if canonical is not RECV and canonical is not SEND:
            raise ValueError(f"mode must be 'recv' or 'send', not {mode!r}")
        return canonical

    # -- send -----------------------------------------------------------------------------

    def enter(self, timeout: Any) -> None:
        """The checks every public call of the node makes first: the calling thread and the
        timeout."""
        loop = self.loop
        # The exact test is "is our loop the running one", but on Python before 3.12 asking
        # for the running loop makes a getpid() system call: a fifth of a microsecond on
        # every send and recv. On the loop's own thread, while it runs, it is the running
        # loop (a thread runs one loop at a time), and that test costs no system call.
        if (loop is not None and (thread_ident() != self.loop_thread or not self.loop_running())
                and _get_running_loop() is not loop):
            raise RuntimeError(wrong_loop(self.name, self.pid, loop))
        if timeout is not None:
            check_timeout(timeout)

    def send(self, key: Any, value: Any, mode: Any, step: Any, timeout: Any) -> Any:
        """The synchronous part of ``Node.send`` (``enter`` first).

        Returns None when the value is queued, on the wire or in a table; a future when the
        push waits in its peer's queue (for the link, credit or the socket); or a
        ``(route, value, nbytes, peer)`` tuple when a Recv-Driven value must first wait for
        room under ``hold_limit`` (``Node`` waits, then calls ``hold`` with the step's table
        as it is then).
        """
        self.enter(timeout)
        route = self.own_route(key, True)
        value, code, shape, nbytes = describe_value(value)
        table = self.steps.table(step)
        peer = route.peer
        if peer is None:  # a key from this node to itself
            table.put(route.text, local_value(value, code))
            return None
        self.steps.joined(step, peer)
        mode = self.check_mode(mode)
        if mode is SEND and not table.waiting(route.text):
            return self.push(peer, step, route, value, code, shape, nbytes)
        # Recv-Driven (or a consumer already asked for it): a parked request takes it now.
        # Else wait for room under hold_limit *before* queuing it, so that a send that times
        # out or is cancelled did not send (one value alone may exceed the limit).
        if self.hold_full(table, route, nbytes):
            self.waits_producer += 1
            return (route, value, nbytes, peer)
        self.hold(table, step, route, value, nbytes)
        return None

    def hold_full(self, table: Table, route: Route, nbytes: int, mine: int = 0) -> bool:
        """Whether a Recv-Driven value of ``nbytes`` must (still) wait for room; ``mine``:
        what a waiting send reserved (``Holding.reserve_hold``).  A value its consumer
        already asked for goes at once (a parked request takes it, nothing is held)."""
        return self.holding.full(route.peer, nbytes, mine) and not self.asked_and_read(table, route)

    def asked_and_read(self, table: Table, route: Route) -> bool:
        """A request of ``route``'s key waits here and its consumer reads its answers: the
        value goes at once, whatever is held (nothing is, once it is answered).  An answer
        to a consumer that does not read waits in ``Wire.deferred`` and counts as held
        (``answer``): were it let through, a peer that asks and never reads would make us
        keep values without bound.  (Only asked when the limit is reached.)"""
        if not table.waiting(route.text):
            return False
        for conn in route.peer.live_connections():
            if conn.deferred:
                return False
        return True

    def hold(self, table: Table, step: Any, route: Route, value: Any, nbytes: int) -> None:
        """Keep a Recv-Driven value for its consumer (or hand it to its parked request)."""
        if table.put(route.text, value):
            return
        holding = self.holding
        holding.count_held(route.peer, nbytes)
        if holding.claim_timeout is not None:
            holding.claim(step, route.text, self.loop.time())

    def push(self, peer: Peer, step: Any, route: Route, value: Any, code: int, shape: tuple,
             nbytes: int) -> Any:
        """Send-Driven: write the value now (returns None), else queue it behind earlier
        pushes (returns the future its write completes)."""
        if self.credit.push(peer, step, route, value, code, shape, nbytes):
            return None
        self.waits_producer += 1
        if peer.credit < nbytes + MESSAGE_COST and peer.link is not None and peer.link.ready:
            peer.credit_stalls += 1  # the link is up: the consumer's window is full
        return self.credit.queue_push(self.future(), peer, step, route, value, code, shape,
                                      nbytes)

    def answer(self, conn: Wire, step: Any, request_id: Any, route: Route, value: Any) -> None:
        """Send ``value`` as the answer to a Recv-Driven request.

        Over TCP the answer goes on our link to the consumer, like everything else we send
        it: one ordered stream per direction, and an answer leaves in the same write as our
        own next request.  A one-sided channel keeps it on the request's connection, whose
        channel holds the destination the consumer offered.
        """
        value, code, shape, nbytes = describe_value(value)
        peer = conn.peer
        if peer is not None:
            link = peer.link
            if (conn.dataplane is None and link is not None and link is not conn and link.ready
                    and not link.closed and link.dataplane is None):
                conn = link
        # (Unless the transport paused us, it holds at most its high-water mark, which the
        # connection sets at or below answer_backlog: no call to ask it for every answer.)
        if conn.deferred or (conn.paused and conn.backlog() > self.answer_backlog):
            # The peer does not read what we send: its requests are answered once it has
            # (reading goes on, so nothing it sends can make us buffer without bound).  The
            # value counts as held meanwhile (``asked_and_read``).
            conn.deferred.append((step, request_id, route, value))
            self.holding.count_held(route.peer, nbytes)
            return
        if peer is not None:
            peer.credit -= nbytes + MESSAGE_COST  # answers are asked for: they never wait for credit
        conn.write_value(step, request_id, route.encoded, value, code, shape, nbytes)

    def undefer(self, conn: Wire) -> None:
        """The connection died with answers held back: their values go back to their keys
        (to the next request, or held again)."""
        deferred = conn.deferred
        conn.deferred = []
        for step, _, route, value in reversed(deferred):
            nbytes = nbytes_of(value)
            self.holding.released_held(route.peer, nbytes)  # (counted while deferred)
            if step in self.steps.dead_steps:
                continue
            table = self.steps.table(step)
            if not table.put_front(route.text, value):
                if table.queued(route.text):
                    self.holding.count_held(route.peer, nbytes)

    def answer_deferred(self, conn: Wire) -> None:
        """The connection drained: answer what waited for it, in order."""
        deferred = conn.deferred
        conn.deferred = []
        for i in range(len(deferred)):
            if conn.closed:  # the rest go back to their keys
                conn.deferred = deferred[i:] + conn.deferred
                self.undefer(conn)
                return
            step, request_id, route, value = deferred[i]
            self.holding.released_held(route.peer, nbytes_of(value))  # (counted while deferred)
            self.answer(conn, step, request_id, route, value)

    # -- recv -----------------------------------------------------------------------------

    def recv(self, key: Any, step: Any, mode: Any, timeout: Any) -> Any:
        """The synchronous part of ``Node.recv`` (one call, ``enter`` first; the route and
        the table are looked up once): the oldest queued value of ``key``; else a new future
        of the loop queued for the next value and, Recv-Driven, the producer asked for it.

        The latter returns the tuple ``(waiter, route, table, peer, dial, stamp)`` (a value
        is never a tuple): ``peer`` is None for a local key, ``dial`` says a Send-Driven
        consumer has no connection to the producer yet (the node then dials it, to notice
        if it is gone), and ``stamp`` is the waiter's place in the key's order (for
        ``give_back``).
        """
        self.enter(timeout)
        route = self.own_route(key, False)
        table = self.steps.table(step)
        value = table.take(route.text)
        peer = route.peer
        if value is not EMPTY:
            if peer is not None:
                self.credit.consumed_from(peer, nbytes_of(value))
            return value
        if peer is None:
            return self.new_waiter(table, route, None, False)
        self.steps.joined(step, peer)
        if self.must_ask(peer, mode):
            # The request leaves first, the waiter is made after: its answer can only come
            # once this task yields, and a round trip's latency runs from here to the write.
            self.requests.request(peer, step, route)
            return self.new_waiter(table, route, peer, False)
        return self.new_waiter(table, route, peer, peer.unconnected())

    def new_waiter(self, table: Table, route: Route, peer: Any, dial: bool) -> tuple:
        """A recv found nothing queued: its future waits in the table (``recv``'s tuple)."""
        waiter = self.future()
        self.waits_consumer += 1
        table.wait(route.text, waiter)
        return (waiter, route, table, peer, dial, table.stamp)

    def must_ask(self, peer: Peer, mode: Any) -> bool:
        """Whether a recv of a key from ``peer`` asks the producer for its value: Recv-Driven,
        and Send-Driven too while the producer is blocked on a window full of other keys'
        values (see ``unblock``, which asked for the recvs already waiting)."""
        return self.recv_mode(peer, mode) is RECV or peer.stuck

    def recv_mode(self, peer: Peer, mode: Any) -> str:
        """The mode a recv of a key from ``peer`` runs in.

        A node that holds its values (Recv-Driven by default) is asked for them even by a
        Send-Driven consumer: default modes that disagree still cost no claim_timeout.
        """
        if mode is None:
            return RECV if self.mode is RECV or peer.mode is RECV else SEND
        return self.check_mode(mode)

    def unblock(self, peer: Peer) -> None:
        """``peer`` waits for credit and we have none to return: the whole window is values
        not taken yet.  Recvs waiting here for its other keys would wait forever behind them
        (a Send-Driven deadlock), so they ask for their values, Recv-Driven: answers need
        no credit, and the producer takes them out of its push queue (``on_request``)."""
        for step, table in list(self.steps.tables.items()):
            for key in table.keys_waiting():
                route = self.routes.route(key)
                if route.peer is peer:
                    self.requests.ask_missing(peer, step, route, table)

    def check_stuck(self, peer: Peer) -> None:
        """``peer`` said it waits for credit and we have none to return: when we hold values
        of it that nobody took, the window is full of them, and we ``unblock``.  When we hold
        none, its pushes are still on their way (on a one-sided channel they can arrive after
        its CREDIT 0, which came over TCP), or so is the credit we returned last: the next
        push that arrives decides (``on_data``).  Asking now would turn the recv of a value
        already on its way into a request for the next one, whose destination a one-sided
        channel reserves at once: one tensor more of memory for nothing."""
        if peer.owe_now and not peer.stuck and peer.owed <= 0 and peer.unreturned > 0:
            peer.stuck = True
            self.unblock(peer)

    def drop_table(self, step: Any) -> Table | None:
        """Forget ``step``'s table (empty, expired or aborted) and return it; its map of
        requests goes too when nothing is asked in it any more (else the last answer's
        ``_drop_key`` drops it)."""
        table = self.steps.drop(step)
        self.requests.table_dropped(step)
        return table

    # -- frames from peers ----------------------------------------------------------------

    def dispatch(self, conn: Wire, events: list) -> None:
        """Handle every frame decoded from one read (or one batch of completions)."""
        for event in events:
            kind = event[KIND]
            try:
                if not conn.ready and kind != HELLO and kind != AUTH and kind != ERROR:
                    raise ProtocolError(f"{conn.peer_name()} sent a frame of type {kind} before "
                                        "completing its handshake")
                if kind == DATA:
                    self.on_data(conn, event[STEP], event[REQUEST_ID], event[KEY], event[VALUE])
                elif kind == DATA_MANY:
                    self.on_data_many(conn, event[STEP], event[KEYS], event[VALUES])
                elif kind == REQUEST:
                    self.on_request(conn, event[STEP], event[REQUEST_ID], event[KEY])
                elif kind == CREDIT:
                    self.on_credit(conn, event[FIELD])
                elif kind == SEQ:
                    conn.rx_seq = event[FIELD]
                elif kind == ACK:
                    self.credit.on_ack(conn, event[FIELD])
                elif kind == CANCEL:
                    self.on_cancel(conn, event[FIELD])
                elif kind == PING:
                    pass
                elif kind == HELLO:
                    self.host.on_hello(conn, event[FIELD])
                elif kind == AUTH:
                    self.host.on_auth(conn, event[FIELD])
                elif kind == ERROR:
                    self.host.on_error(conn, event[FIELD])
                elif kind == ABORT_STEP:
                    self.host.on_abort_step(conn, event[STEP], event[MESSAGE])
                elif kind == BYE:
                    conn.bye_received = True
            except (AuthError, ProtocolError, TransportError, KeyFormatError, WrongEndpoint,
                    OverflowError, MemoryError, ValueError, TypeError) as exc:
                conn.frame_failed(exc)  # that connection ends; never the event loop
                return

    def on_data(self, conn: Wire, step: Any, request_id: Any, key: str, value: Any) -> None:
        peer = conn.peer
        if peer is None:
            raise ProtocolError("DATA before HELLO")
        if conn.rx_seq != 0:
            seq = conn.rx_seq
            conn.rx_seq = seq + 1
            if not self.credit.fresh(peer, seq):
                return  # sent again after a reconnect: we have it
        asked = False
        route = None
        if request_id:
            request = self.requests.by_id.get(request_id)
            if request is not None and request.peer is not peer:
                # Only the producer asked may answer: another peer's "answer" would take
                # the request from it and bypass the push window.
                raise ProtocolError(f"{peer.name} answered request {request_id}, which went "
                                    f"to {request.peer.name}")
            self.requests.asked_no_more(peer, request_id)
            if request is not None:
                del self.requests.by_id[request_id]
                asked = True
                self.requests.forget_request(request_id, step, key)
                if request.key == key:
                    route = request.route  # checked when it was asked for
            elif self.requests.settled(peer, request_id):
                asked = True
        if route is None:
            route = self.arriving_route(peer, key)
        cost = nbytes_of(value) + MESSAGE_COST
        if asked:
            peer.answered += cost
        else:
            self.credit.check_window(peer, cost)
            peer.pushes_on = conn  # (``request_link``)
        peer.unreturned += cost
        table = self.steps.remote_table(step, conn.peer)
        if table is None:
            self.credit.consumed_from(peer, nbytes_of(value))  # dropped: the step is gone
            return
        self.steps.joined(step, peer)
        if table.put(route.text, value):
            self.credit.consumed_from(peer, nbytes_of(value))
        elif peer.owe_now:  # it waits for credit, and this value was not taken
            self.check_stuck(peer)

    def on_data_many(self, conn: Wire, step: Any, keys: list, values: list) -> None:
        """A DATA_MANY frame: Send-Driven pushes of one step, as many DATA frames would be,
        with the window checked and the step's table found once.  Every key is checked
        before any value is queued."""
        peer = conn.peer
        if peer is None:
            raise ProtocolError("DATA before HELLO")
        n = len(keys)
        if n == 0:
            return  # nothing to queue: no step table is made for it either
        if conn.rx_seq != 0:
            seq = conn.rx_seq
            conn.rx_seq = seq + n
            if seq == peer.rx_floor + 1 and not peer.rx_above:
                peer.rx_floor = seq + n - 1  # in order, as nearly always
            else:
                fresh = [i for i in range(n) if self.credit.fresh(peer, seq + i)]
                if len(fresh) < n:  # sent again after a reconnect: drop what we have
                    keys = [keys[i] for i in fresh]
                    values = [values[i] for i in fresh]
                    n = len(keys)
                    if n == 0:
                        return
        routes = [self.arriving_route(peer, key) for key in keys]
        cost = 0
        for i in range(n):
            cost += nbytes_of(values[i]) + MESSAGE_COST
        self.credit.check_window(peer, cost)
        peer.unreturned += cost
        peer.pushes_on = conn  # (``request_link``)
        table = self.steps.remote_table(step, conn.peer)
        if table is None:  # dropped: the step is gone
            for i in range(n):
                self.credit.consumed_from(peer, nbytes_of(values[i]))
            return
        self.steps.joined(step, peer)
        for i in range(n):
            route = routes[i]
            if table.put(route.text, values[i]):
                self.credit.consumed_from(peer, nbytes_of(values[i]))
        if peer.owe_now:  # it waits for credit: were these values taken?
            self.check_stuck(peer)

    def arriving_route(self, peer: Peer, key: str) -> Route:
        """The route of a key ``peer`` sent us data for; it must run from that peer to us."""
        route = self.routes.route(key)
        if not route.to_me or route.peer is not peer:
            raise ProtocolError(f"{peer.name} sent key {key} to {self.name}; the key routes from "
                                f"/job:{route.src[0]}/task:{route.src[1]} to "
                                f"/job:{route.dst[0]}/task:{route.dst[1]} (cluster specs differ?)")
        return route

    def on_request(self, conn: Wire, step: Any, request_id: Any, key: str) -> None:
        route = self.routes.route(key)
        peer = conn.peer
        if peer is None:
            raise ProtocolError("REQUEST before HELLO")
        if not route.from_me or route.peer is not peer:
            # Only the key's destination may fetch it, and never a key local to this node.
            conn.check_backlog()
            conn.write_frame(encode_error(
                request_id, step, key, "WrongEndpoint",
                f"{self.name} cannot answer {peer.name}'s request for key {key}: it routes "
                f"from /job:{route.src[0]}/task:{route.src[1]} to "
                f"/job:{route.dst[0]}/task:{route.dst[1]}"))
            return
        dead = self.steps.dead_steps.get(step)
        if dead is not None or self.closed:
            conn.check_backlog()  # an error reply is output as any other
            conn.write_frame(encode_error(request_id, step, key, "aborted",
                                          dead or f"node {self.name} closed"))
            return
        table = self.steps.remote_table(step, conn.peer)
        self.steps.joined(step, peer)
        # A push of this key still waiting for credit came before any value of it held
        # here: Recv-Driven values nobody asked for within claim_timeout are pushed oldest
        # first (``Heartbeat._push_unclaimed``; close() too), and a Send-Driven consumer asks for
        # its pushes when the window is full of other keys' values (``unblock``).  That push
        # answers; a held value answered first would reach the consumer before it.
        value = self.credit.unqueue_push(peer, step, route.text) if peer.queue else EMPTY
        held = value is EMPTY
        if held:
            waiter = RemoteWaiter.__new__(RemoteWaiter)  # compiled: a C call, no argument tuple
            waiter.init(self, conn, step, request_id, route)
            value = table.take_or_wait(route.text, waiter)
        if value is not EMPTY and self.holding.claim_timeout is not None:
            # The consumer pulls this key: its values held before now are not pushed at
            # claim_timeout (``Heartbeat._push_unclaimed``), which could reorder them.  A request
            # that finds nothing held (it parks: a consumer-first exchange) can spare no
            # value, as every value held later is held after it, and the claims of values
            # taken earlier are covered by the requests that took them: it records nothing
            # (a tuple, a clock read and a dict insert less per parked request).
            self.holding.pulled(step, route.text, self.loop.time())
        if value is EMPTY:
            # A reused id would replace the parked waiter of that id, which then escaped
            # max_parked and outlived the connection in its key's queue.
            reused = request_id in conn.parked
            if reused or len(conn.parked) >= self.max_parked:
                table.remove_waiter(route.text, waiter)
                if reused:
                    raise ProtocolError(f"{peer.name} reused request id {request_id} while "
                                        "its request was parked")
                raise ProtocolError(f"{peer.name} has more than {self.max_parked} requests "
                                    "parked (max_parked)")
            conn.parked[request_id] = waiter
            if self.holding.hold_waiters:  # a send of this key waiting for room can go now
                self.holding.wake_holders()
        else:
            if held:
                self.holding.released_held(peer, nbytes_of(value))
            self.answer(conn, step, request_id, route, value)

    def unconsumed(self, src: tuple, value: Any) -> None:
        """A value we counted as consumed went back to its queue (a cancelled recv)."""
        peer = self.peers.get(src)
        if peer is not None:
            self.credit.unconsumed(peer, nbytes_of(value))

    def on_credit(self, conn: Wire, nbytes: Any) -> None:
        peer = conn.peer
        if peer is not None and self.credit.returned(peer, conn, nbytes):
            self.check_stuck(peer)

    # -- exactly once across reconnects -------------------------------------------------------

    def new_incarnation(self, peer: Peer, window: int) -> None:
        """``peer`` is a new process: nothing of the old one counts (``Peer.new_incarnation``),
        nor the requests we cancelled on it, which the new one never settles."""
        peer.new_incarnation(window)
        self.requests.forget_cancelled_of(peer)

    def identified(self, conn: Wire, task_id: tuple) -> Peer:
        """``conn``, accepted here, is from ``task_id`` (its HELLO says so): it is bound to
        that peer."""
        peer = self.routes.peer(task_id)
        conn.peer = peer
        return peer

    def accepted(self, peer: Peer, conn: Wire, incarnation: Any, parks: int, mode: str) -> None:
        """``conn`` completed its handshake with ``peer`` (its process ``incarnation``, which
        parks up to ``parks`` requests and defaults to ``mode``): it is ready."""
        peer.incarnation = incarnation
        peer.parks = parks
        peer.mode = mode
        conn.ready = True
        self.holding.regroup(peer, False)  # back (or new): what we hold for it counts in full

    def link(self, peer: Peer, conn: Wire) -> None:
        """``conn`` carries our traffic to ``peer`` from now on: what an earlier connection
        carried and ``peer`` did not acknowledge goes again on it."""
        peer.link = conn
        self.credit.resend(peer, conn)

    def set_running(self, running: bool) -> None:
        """Whether the node runs: send and recv work only while it does."""
        self.running = running

    def stop(self, forked: bool = False) -> None:
        """The node is closed: every operation fails from now on (in a ``forked`` child,
        from the thread check on: ``wrong_loop`` says why)."""
        self.running = False
        self.closed = True
        if forked:
            self.loop_thread = 0

    def on_cancel(self, conn: Wire, request_id: Any) -> None:
        parked = conn.parked.pop(request_id, None)
        if parked is not None:
            parked.cancel()
            table = self.steps.tables.get(parked.step)
            if table is not None:
                table.remove_waiter(parked.route.text, parked)
            # Say that no answer follows, so the consumer can forget the id (``settled``); a
            # request answered already needs no word: its answer is on its way.
            conn.check_backlog()
            conn.write_frame(encode_error(request_id, parked.step, "", "cancelled", ""))
