"""The batch API of the engine: ``send_many``, and the parts of ``recv_many`` that do not
wait (the routes checked first, the values taken at once, the requests of the keys that
wait).  Functions of a ``Core``: a batch does per key what ``Core.send`` and ``Core.recv``
do, with the route checks, the step's table and each producer's mode looked up once.
"""

from __future__ import annotations

from typing import Any

from .engine import Core, describe_value, nbytes_of
from .peers import MESSAGE_COST
from .table import EMPTY, Batch

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False


def described(items: list) -> list:
    """``(value, code, shape, nbytes)`` of the value of every ``(key, value)`` of a batch,
    made before any is sent: a value ``send`` would refuse (``TypeError``) fails the whole
    call, and each value is described once."""
    if COMPILED:  # arrays.pyx's C call, cimported in batches.pxd
        return [describe_c(item[1]) for item in items]  # type: ignore[name-defined]  # noqa: F821
    return [describe_value(item[1]) for item in items]


def send_many(core: Core, keys: list, values: list, mode: Any, step: Any, start: int) -> Any:
    """Send ``values[start:]`` (``described``) to ``keys[start:]`` until one must wait:
    returns ``(index, pending)`` of that one (see ``send``), or None when all went.
    Send-Driven runs of values to one peer go by ``push_many``; the rest as ``send``
    would."""
    n = len(keys)
    i = start
    pushing = core.check_mode(mode) == "send"
    while i < n:
        if pushing:
            j = push_many(core, keys, values, i, step)
            if j > i:
                i = j
                continue
        pending = core.send(keys[i], values[i][0], mode, step, None)
        if pending is not None:
            return (i, pending)
        i += 1
    return None


def push_many(core: Core, keys: list, values: list, start: int, step: Any) -> int:
    """Push ``values[start:]`` to one peer as far as ``push`` would write each at once
    (the same peer, an ``open_link``, credit for each, no parked request for its key),
    without ``send``'s work per item; the link's buffer packs the small ones into
    DATA_MANY frames.  Returns the index of the first item not pushed (``start`` when
    none was: the caller sends that one alone)."""
    route = core.own_route(keys[start], True)
    peer = route.peer
    if peer is None:
        return start
    conn = core.credit.open_link(peer)
    if conn is None:
        return start
    table = core.steps.table(step)
    n = len(keys)
    i = start
    while i < n:
        if i > start:
            route = core.own_route(keys[i], True)
            if route.peer is not peer:
                break
        if table.waiting(route.text):  # a consumer's request is parked: answer it
            break
        value, code, shape, nbytes = values[i]
        cost = nbytes + MESSAGE_COST
        if peer.credit < cost:
            break
        if i == start:
            core.steps.joined(step, peer)
        peer.credit -= cost
        conn.write_value(step, 0, route.encoded, value, code, shape, nbytes)
        i += 1
    return i


def check_routes(core: Core, keys: list, sending: bool) -> list:
    """Every key's route, checked before a batch touches anything."""
    return [core.own_route(key, sending) for key in keys]


def ask_many(core: Core, waiting: list, routes: list, mode: Any, step: Any) -> tuple:
    """The keys of a ``recv_many`` that wait (``waiting``: indexes into ``routes``) from
    their producers: Recv-Driven ones get a request each (not sent yet), and the
    Send-Driven producers with no connection are listed once each, with the first of
    their keys (the node dials them, to notice if they are gone).  Returns
    ``({peer: [requests]}, {peer: key to dial for})``.  The producer's mode is decided
    once per run of keys from one producer."""
    asks: dict = {}
    dial: dict = {}
    last = None
    ask = False
    for i in waiting:
        route = routes[i]
        peer = route.peer
        if peer is None:  # a local key: a local send fills it
            continue
        if peer is not last:
            last = peer
            core.steps.joined(step, peer)
            ask = core.must_ask(peer, mode)
            if not ask and peer not in dial and peer.unconnected():
                dial[peer] = route.text
        if ask:
            requests = asks.get(peer)
            if requests is None:
                asks[peer] = [core.requests.new_request(peer, step, route)]
            else:
                requests.append(core.requests.new_request(peer, step, route))
    return asks, dial


def take_many(core: Core, routes: list, step: Any, whole: bool = False) -> Any:
    """Take what is queued for a ``recv_many``: the list of values when every key had
    one, else a ``Batch`` (its missing slots are not registered yet).  ``whole``: a
    ``Batch`` in any case (one that misses nothing can still be undone)."""
    table = core.steps.table(step)
    n = len(routes)
    values = [EMPTY] * n
    stamps = [0] * n
    missing = 0
    for i in range(n):
        route = routes[i]
        value = table.take(route.text)
        if value is EMPTY:
            missing += 1
        else:
            values[i] = value
            stamps[i] = table.took
            if route.peer is not None:
                if COMPILED:
                    nbytes = nbytes_c(value)  # type: ignore[name-defined]  # noqa: F821
                else:
                    nbytes = nbytes_of(value)
                core.credit.consumed_from(route.peer, nbytes)
    if not missing and not whole:
        return values
    if missing:
        core.waits_consumer += 1
    return Batch(table, [r.text for r in routes], values, stamps, missing,
                 core.future())
