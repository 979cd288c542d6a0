"""The Recv-Driven requests a consumer sent: each by id, the ones still outstanding per step
and key (a key's answers come in the order it asked), those held back past what the producer
parks, and the ids we cancelled whose producer may still answer them.

``Core`` holds one (``core.requests``) and calls it as recvs ask and answers come; the
frames go out on the ``Wire`` given, and a request with no ready connection yet goes to the
host (``Host.request_when_linked``).
"""

from __future__ import annotations

from collections import deque
from typing import Any

from . import codec as _codec
from .peers import SWEEP_SLACK, Peer, Request, Route
from .steps import Steps
from .table import Table
from .wire import Wire

encode_requests_split = _codec.encode_requests_split
encode_cancel = _codec.encode_cancel

# At most this many cancelled requests are remembered (``Requests.cancelled``): one whose
# producer never says what became of it (its connection closed first) goes at this cap,
# oldest first.
CANCELLED_MAX = 65536


class Requests:
    """Our requests to every peer, and what each producer parks of them."""

    def __init__(self, steps: Steps, host: Any) -> None:
        self.steps = steps                 # a step's map of requests lives as long as its table
        self.host = host                   # rvz._fast.host.Host: sends what waits for a link
        self.by_id: dict = {}              # request id -> Request
        self.outstanding: dict = {}        # step -> {key: request id, or a deque of them} (new_request)
        # Requests we cancelled, to the peer asked: the producer may have answered before
        # the CANCEL reached it, and such an answer is still one we asked for (not a push).
        # Each is forgotten when its answer or its ERROR comes ("cancelled": it was parked
        # and is dropped, no answer follows); ``cancel_order`` is their order, for the cap.
        self.cancelled: dict = {}
        self.cancel_order: deque = deque()
        self.last_request_id = 0  # request ids start at 1: a frame with id 0 is a push

    def table_dropped(self, step: Any) -> None:
        """``step``'s table went: its map of requests goes too when nothing is asked in it
        any more (else the last answer's ``_drop_key`` drops it)."""
        keys = self.outstanding.get(step)
        if keys is not None and not keys:
            del self.outstanding[step]

    def forget_cancelled_of(self, peer: Peer) -> None:
        """``peer``'s process was replaced: the requests we cancelled on it are never
        settled by the new one."""
        if self.cancelled:
            self.cancelled = {i: p for i, p in self.cancelled.items() if p is not peer}

    def ask_missing(self, peer: Peer, step: Any, route: Route, table: Table) -> None:
        """Request one value of ``route``'s key for each recv waiting in ``table`` that no
        request covers yet."""
        for _ in range(table.waiting(route.text) - self.outstanding_count(step, route.text)):
            self.request(peer, step, route)

    def reask(self, conn: Wire) -> None:
        """``conn`` closed with requests of ours on it: ask again, with new ids, once a
        connection to the same process is up.  The old ids count as cancelled, so an
        answer to one sent again after the reconnect is still taken as an answer; a key
        may then get a value more than its recvs asked for, which waits for the next one."""
        again = [r for r in self.by_id.values() if r.conn is conn]
        keys: dict = {}
        for request in again:
            self.drop(request.id)
            self.note_cancelled(request)
            keys[(request.step, request.key)] = request
        for (step, key), request in keys.items():
            table = self.steps.tables.get(step)
            if table is not None:
                for _ in range(table.waiting(key) - self.outstanding_count(step, key)):
                    self.request(request.peer, step, request.route)

    def drop(self, request_id: Any) -> Any:
        """Forget request ``request_id`` (answered, failed or cancelled) and return it, or
        None if it is not outstanding."""
        request = self.by_id.pop(request_id, None)
        if request is not None:
            self.forget_request(request_id, request.step, request.key)
        return request

    def new_request(self, peer: Peer, step: Any, route: Route) -> Request:
        self.last_request_id += 1  # (a C integer when compiled: no call to an iterator)
        request_id = self.last_request_id
        request = Request.__new__(Request)  # compiled: no argument tuple parsed by __init__
        request.init(request_id, peer, step, route)
        self.by_id[request_id] = request
        # ``outstanding``: per step, per key, a lone request's id as it is (the common case:
        # one recv waiting on a key), a deque of ids, oldest first, once a second one is
        # asked.  (Keyed by step, then key: no (step, key) tuple made and hashed for every
        # request and answer, and a step's requests are dropped together.)
        keys = self.outstanding.get(step)
        if keys is None:
            self.outstanding[step] = {route.text: request_id}
            return request
        key = route.text
        pending = keys.get(key)
        if pending is None:
            keys[key] = request_id
        elif type(pending) is deque:
            pending.append(request_id)
        else:
            keys[key] = deque((pending, request_id))
        return request

    def outstanding_count(self, step: Any, key: str) -> int:
        """How many requests we sent for ``key`` in ``step`` are not answered yet."""
        keys = self.outstanding.get(step)
        pending = None if keys is None else keys.get(key)
        if pending is None:
            return 0
        return len(pending) if type(pending) is deque else 1

    def drop_outstanding(self, step: Any) -> None:
        """Forget every request of ``step`` (the step was aborted)."""
        keys = self.outstanding.pop(step, None)
        if keys is None:
            return
        for pending in keys.values():
            for request_id in (pending if type(pending) is deque else (pending,)):
                self.by_id.pop(request_id, None)

    def request(self, peer: Peer, step: Any, route: Route) -> None:
        """Recv-Driven: ask ``peer`` for the next value of ``route``."""
        request = self.new_request(peer, step, route)
        conn = self.request_link(peer, request)
        if conn is None or not conn.ready or conn.closed:
            self.host.request_when_linked([request])
        elif peer.held_back or len(peer.asking) >= peer.parks:
            self.hold_back(peer, [request])  # it parks no more: sent as answers come
        else:
            self.send_request(conn, request)
            conn.requests_queued()

    def send_asks(self, peer: Peer, requests: list, conn: Any = None) -> bool:
        """Send new requests of one step to ``peer`` (a ``recv_many``'s), on ``request_link``
        (else on ``conn``, if given and ready): one frame for those that go on it.  Those
        past what ``peer`` parks wait in ``held_back``.  False, sending nothing, when no
        connection to ``peer`` is ready yet (the node sends them once it is linked)."""
        link = self.request_link(peer)
        if link is None or not link.ready or link.closed:
            if conn is None or not conn.ready or conn.closed:
                return False
            link = conn
        if peer.held_back or len(peer.asking) + len(requests) > peer.parks:
            self.hold_back(peer, requests)
        else:
            self.send_on(peer, link, requests)
        return True

    def hold_back(self, peer: Peer, requests: list) -> None:
        """Queue requests behind those already held back, then send what fits.

        A held-back request that is cancelled (its recv timed out) stays in the queue until
        its turn; a queue grown past twice its live requests is swept, so recvs that keep
        timing out behind a producer that parks no more cannot grow it without bound."""
        held = peer.held_back
        held.extend(requests)
        if len(held) > peer.held_back_mark:
            live = self.by_id
            kept = [r for r in held if live.get(r.id) is r]
            held.clear()
            held.extend(kept)
            peer.held_back_mark = max(SWEEP_SLACK, 2 * len(kept))
        self.send_held_back(peer)

    def send_held_back(self, peer: Peer) -> None:
        """Answers or cancels made room among the requests ``peer`` parks: send the held-back
        ones that fit (those cancelled or failed meanwhile are dropped).  Their order does
        not matter: every request of a key asks for its next value, and the table hands
        values to the key's recvs in the order they began."""
        held = peer.held_back
        conn = self.request_link(peer)
        if conn is None or not conn.ready or conn.closed:
            return  # the next link sends them (``Links._link_ready``)
        requests = self.by_id
        go: list = []
        room = peer.parks - len(peer.asking)
        while held and len(go) < room:
            request = held.popleft()
            if requests.get(request.id) is request:
                go.append(request)
        # One REQUESTS frame per run of one step (send_requests takes one step at a time).
        start = 0
        for i in range(1, len(go) + 1):
            if i == len(go) or go[i].step != go[start].step:
                self.send_on(peer, conn, go[start:i])
                start = i

    def send_on(self, peer: Peer, conn: Wire, requests: list) -> None:
        """Send requests of one step: on ``conn``, or where an earlier request of their key
        went (``key_link``); one frame for those that go on ``conn``."""
        if not requests:
            return
        rest = []
        for request in requests:
            other = self.key_link(request, conn)
            if other is conn:
                rest.append(request)
            else:
                self.send_request(other, request)
                other.requests_queued()
        if rest:
            self.send_requests(conn, rest)

    def request_link(self, peer: Peer, request: Any = None) -> Any:
        """The connection our requests to ``peer`` go on: the one it pushes on (where its
        last push or CREDIT 0 came), else our link; ``request``'s key keeps to ``key_link``.

        The two differ when both nodes dialled at once, and each took its own connection as
        its link.  A one-sided channel writes an answer on the request's connection (the
        destination the consumer offered is there), and nothing orders the completions of
        two channels.  So an answer on our link could overtake the key's pushes still unread
        on the producer's: a stuck producer's answer is often the key's next push, taken out
        of its queue (``unblock``), and a ``recv(mode="recv")`` of a key it pushes gets a
        later value of that key.  On the connection of its pushes the answer queues behind
        them.  (Over TCP the producer answers on its link anyway: ``answer``.)  Before one
        of its pushes is read we do not know that connection: a request sent then may still
        overtake the first pushes of a simultaneous dial."""
        conn = peer.pushes_on
        if conn is None or not conn.ready or conn.closed:
            conn = peer.link
        if request is not None:
            conn = self.key_link(request, conn)
        return conn

    def key_link(self, request: Request, conn: Any) -> Any:
        """``conn``, or the connection an earlier request of ``request``'s key, still not
        answered, went on: a key's answers arrive in the order it asked only on one
        connection, and ``request_link`` changes when the first push arrives on another."""
        keys = self.outstanding.get(request.step)
        pending = None if keys is None else keys.get(request.key)
        if type(pending) is deque:
            first = self.by_id.get(pending[0])
            if first is not None and first is not request:
                earlier = first.conn
                if earlier is not None and not earlier.closed:
                    return earlier
        return conn

    def send_requests(self, conn: Wire, requests: list) -> None:
        """Put requests (all of one step) on ``conn``: one frame for one, REQUESTS for many."""
        if len(requests) == 1:
            self.send_request(conn, requests[0])
        else:
            for request in requests:
                self._sent_on(conn, request)
            step = requests[0].step
            entries = [(r.id, r.route.encoded) for r in requests]
            for frame in encode_requests_split(step, entries):
                conn.write_frame(frame)
        conn.requests_queued()

    def send_request(self, conn: Wire, request: Request) -> None:
        """Put one request on ``conn`` (the caller then calls ``conn.requests_queued``)."""
        self._sent_on(conn, request)
        conn.write_request(request.step, request.id, request.route.encoded)

    def _sent_on(self, conn: Wire, request: Request) -> None:
        """``request`` goes out on ``conn``: a CANCEL must follow it there, and a one-sided
        connection offers the destination of its answer first."""
        request.conn = conn
        request.peer.asking[request.id] = conn
        if conn.dataplane is not None:
            conn.dataplane.on_request(request.step, request.id, request.key)

    def forget_request(self, request_id: Any, step: Any, key: str) -> None:
        keys = self.outstanding.get(step)
        if keys is None:
            return
        pending = keys.get(key)
        if pending is None:
            return
        if type(pending) is not deque:
            if pending == request_id:
                self._drop_key(step, keys, key)
            return
        try:
            pending.remove(request_id)
        except ValueError:
            pass
        if not pending:
            self._drop_key(step, keys, key)

    def asked_no_more(self, peer: Peer, request_id: Any) -> None:
        """``peer`` parks our request ``request_id`` no more (answered, failed or
        cancelled): a held-back request may take its place."""
        if peer.asking.pop(request_id, None) is not None and peer.held_back:
            self.send_held_back(peer)

    def _drop_key(self, step: Any, keys: dict, key: str) -> None:
        """``key`` has no outstanding request left in ``step``.  The step's map stays while
        its table does: a stream of recvs, each asking once, would otherwise make and free
        a dict per request.  (``requests`` is empty when nothing is asked: ``Node.recv``
        tests that.)"""
        del keys[key]
        if not keys and step not in self.steps.tables:
            del self.outstanding[step]

    def rebalance(self, step: Any, key: str, table: Table) -> None:
        """Cancel requests that no local waiter needs any more (newest first)."""
        keys = self.outstanding.get(step)
        if keys is None:
            return
        pending = keys.get(key)
        if pending is None:
            return
        if type(pending) is not deque:
            pending = keys[key] = deque((pending,))  # (rare: one shape below)
        # The waiters queued, not each asked whether it is done (``waiting``): that walked
        # all of the key's waiters at every recv, n recvs of one key cost n * n.  A waiter
        # done and still queued is a recv cancelled whose task has not run yet: it takes its
        # waiter out, then rebalances itself.
        surplus = len(pending) - (table.queued_waiters(key) if not table.aborted else 0)
        while surplus > 0 and pending:
            request = self.by_id.pop(pending.pop(), None)
            surplus -= 1
            if request is not None:
                conn = request.conn
                if conn is not None and not conn.closed:
                    conn.write_frame(encode_cancel(request.id))
                    self.asked_no_more(request.peer, request.id)
                    self.note_cancelled(request)
        if not pending:
            self._drop_key(step, keys, key)
        elif len(pending) == 1:
            keys[key] = pending[0]

    def note_cancelled(self, request: Request) -> None:
        """Remember ``request``, just cancelled, until its producer answers it or says it
        dropped it (``settled``).  The order of ids is swept of settled ones once it is
        twice as long as what is remembered (amortized O(1) a cancel)."""
        cancelled = self.cancelled
        order = self.cancel_order
        cancelled[request.id] = request.peer
        order.append(request.id)
        if len(order) > 2 * len(cancelled) + SWEEP_SLACK:
            self.cancel_order = order = deque([i for i in order if i in cancelled])
        if len(order) > CANCELLED_MAX:
            cancelled.pop(order.popleft(), None)

    def settled(self, peer: Any, request_id: Any) -> bool:
        """``peer`` answered, or said it dropped, request ``request_id`` that we cancelled:
        forget it.  False if it is not one of ours that we cancelled and asked ``peer``."""
        if self.cancelled.get(request_id) is not peer:
            return False
        del self.cancelled[request_id]
        return True
