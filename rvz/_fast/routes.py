"""Where each key goes: its ``Route`` (its two ends, whether they are this node, and the
``Peer`` at the other end), computed once per key string, the task of each device name,
checked against the cluster once, and the ``Peer`` of each other task, made on first use.
"""

from __future__ import annotations

from typing import Any

from ..errors import WrongEndpoint
from . import keys as _keys
from .peers import Peer, Route

try:  # Cython's own module; a compiled build sees the constant True
    import cython
    COMPILED = cython.compiled
except ImportError:  # pure Python without Cython installed
    COMPILED = False

# Bounds of the caches: past them a cache starts again (keys change every step).
_ROUTE_CACHE_MAX = 1 << 16
_DEVICES_MAX = 4096


class Routes:
    """The routes of one node (``me``) in ``cluster``."""

    def __init__(self, cluster: Any, me: tuple, peers: dict, push_window: int) -> None:
        self.cluster = cluster
        self.me = me                       # this node's (job, task)
        self.peers = peers                 # the core's (job, task) -> Peer
        self.push_window = push_window     # a new peer's window until its HELLO says its own
        self.by_key: dict = {}             # key text -> Route
        self.devices: dict = {}            # device name -> (job, task)

    def route(self, key: Any) -> Route:
        """The ``Route`` of ``key`` (a ``Key`` or its string), computed once per key string."""
        text = key if type(key) is str else str(key)
        route = self.by_key.get(text)
        if route is None:
            # Keys change every step (frame:iter), devices do not: those are parsed once,
            # and a key string already in canonical form is not parsed into a Key at all.
            if type(key) is not str:
                devices = None
            elif COMPILED:
                devices = canonical_devices_c(text)  # type: ignore[name-defined]  # noqa: F821
            else:
                devices = _keys.canonical_devices(text)
            if devices is not None:
                canonical = text
                src_device, dst_device = devices
            else:
                parsed = _keys.as_key(key)
                canonical = str(parsed)
                src_device, dst_device = parsed.src, parsed.dst
            src = self.task_of(src_device, canonical)
            dst = self.task_of(dst_device, canonical)
            route = Route(canonical, src, dst, self.me, None)
            if route.from_me != route.to_me:  # else a key from this node to itself, or a
                route.peer = self.peer(dst if route.from_me else src)  # stranger's
            if len(self.by_key) >= _ROUTE_CACHE_MAX:
                self.by_key.clear()
            self.by_key[text] = route
        return route

    def task_of(self, device: str, key: str) -> tuple:
        """``(job, task)`` of a device name, checked against the cluster once per device."""
        task_id = self.devices.get(device)
        if task_id is None:
            task_id = _keys.parse_device(device)
            if task_id == self.me:
                task_id = self.me  # one object: a route's from_me / to_me is an identity test
            try:  # here, before a recv queues its waiter: not a KeyError from deep inside
                self.cluster.address(*task_id)
            except KeyError:
                raise WrongEndpoint(f"key {key} names /job:{task_id[0]}/task:{task_id[1]}, "
                                    f"which is not in the cluster {self.cluster!r}") from None
            if len(self.devices) >= _DEVICES_MAX:
                self.devices.clear()
            self.devices[device] = task_id
        return task_id

    def peer(self, task_id: tuple) -> Peer:
        """The ``Peer`` of another task, made on first use."""
        peer = self.peers.get(task_id)
        if peer is None:
            peer = Peer(task_id, self.cluster.address(*task_id), self.push_window)
            self.peers[task_id] = peer
        return peer
