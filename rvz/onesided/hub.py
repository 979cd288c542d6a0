"""The node's side of the one-sided transports: what HELLO offers and what a pair agrees on.

``Node(transport=...)``: ``"tcp"`` (no hub at all), ``"shm"``, ``"verbs"`` or ``"auto"``.
A node asking for ``shm`` or ``verbs`` fails at ``start()`` when its provider cannot work
here, with the reason (no pyverbs, no device, port down, no memfd); it never falls back.
``auto`` opens whatever works and says in the log what did not.

Every TCP connection of a hub offers, in its HELLO, an endpoint of each open provider plus
this host's identity.  When the peer's HELLO arrives both sides run the same ``decide()``
on the same facts, so they agree without another round trip:

* a side that asked for ``shm`` or ``verbs`` gets it or the connection fails with
  ``TransportError`` naming why (the peer runs tcp, is on another host, has no device);
* two ``auto`` sides use shm when they share the host (boot id, user and pid namespace),
  else verbs when both have a usable device, else TCP.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import TYPE_CHECKING, Any

from ..errors import TransportError
from .engine import Channel, Engine, Host, Options

if TYPE_CHECKING:
    from ..connection import Connection

log = logging.getLogger(__name__)

TRANSPORTS = ("tcp", "shm", "verbs", "auto")
ONESIDED = ("shm", "verbs")


def make_provider(name: str, loop: asyncio.AbstractEventLoop, options: Options) -> Any:
    if name == "shm":
        from .shm import ShmProvider
        return ShmProvider(loop, options.pipe_size)
    if name == "verbs":
        from .verbs import VerbsProvider
        return VerbsProvider(loop, device=options.device, port=options.port,
                             gid_index=options.gid_index, recv_depth=options.recv_depth,
                             send_depth=options.send_depth)
    raise ValueError(f"unknown one-sided provider {name!r}")


def _same_host(a: dict[str, Any], b: Any) -> bool:
    if not a or not isinstance(b, dict) or not a.get("boot"):
        return False
    return all(a.get(k) == b.get(k) for k in ("boot", "uid", "pidns"))


def decide(want: str, local: set[str], host: dict[str, Any], remote: Any,
           unavailable: dict[str, str] | None = None) -> tuple[str, str]:
    """``(transport, why)`` for one connection; the same answer on both sides.

    ``want``/``local``/``host``: this node's ``transport=``, the providers it offered and
    its host identity; ``remote``: the peer's ``os`` HELLO field (``None`` if it runs tcp).
    Raises ``TransportError`` when a side asked for something the pair cannot do.
    """
    if not isinstance(remote, dict):
        remote = {}
    remote_want = str(remote.get("want", "tcp"))
    offered = remote.get("ep")
    remote_names = set(offered) if isinstance(offered, dict) else set()
    remote_no = remote.get("no") if isinstance(remote.get("no"), dict) else {}
    same = _same_host(host, remote.get("host"))
    asked = {w for w in (want, remote_want) if w in ONESIDED}
    if len(asked) == 2:
        raise TransportError(f"this node asks for transport {want!r} and the peer for {remote_want!r}")
    if asked:
        (name,) = asked
        who = "this node" if want == name else "the peer"
        if name not in local:
            why = (unavailable or {}).get(name, f"this node runs transport={want!r}")
            raise TransportError(f"{who} asks for {name} but this node has none: {why}")
        if name not in remote_names:
            why = remote_no.get(name) or f"it runs transport={remote_want!r}"
            raise TransportError(f"{who} asks for {name} but the peer offers no {name}: {why}")
        if name == "shm" and not same:
            raise TransportError(f"{who} asks for shm but the peer is not on this host (boot id, "
                                 "user or pid namespace differ): shm needs both processes on one "
                                 "host, under one user")
        return name, f"{name} asked for by {who}"
    if "shm" in local and "shm" in remote_names and same:
        return "shm", "auto: same host"
    if "verbs" in local and "verbs" in remote_names:
        return "verbs", "auto: RDMA device on both sides"
    if remote_want == "tcp":
        return "tcp", "auto: the peer runs tcp"
    reasons = []
    if not same:
        reasons.append("the peer is on another host")
    for name in ("verbs",):
        if name not in local:
            reasons.append(f"no {name} here ({(unavailable or {}).get(name, 'not offered')})")
        elif name not in remote_names:
            reasons.append(f"no {name} on the peer ({remote_no.get(name, 'not offered')})")
    return "tcp", "auto: " + "; ".join(reasons or ["no common one-sided transport"])


class Hub:
    """The one-sided engines of one node and the transport each peer got."""

    def __init__(self, node: Host, options: dict[str, Any] | None) -> None:
        self.node = node
        self.want = node.transport
        self.options = Options(options)
        self.engines: dict[str, Engine] = {}
        self.unavailable: dict[str, str] = {}
        self.choices: dict[Any, str] = {}
        self._offers: weakref.WeakKeyDictionary[Connection, dict[str, Any]] = weakref.WeakKeyDictionary()
        loop = asyncio.get_running_loop()
        names = [self.want] if self.want in ONESIDED else list(ONESIDED)
        try:
            for name in names:
                try:
                    provider = make_provider(name, loop, self.options)
                    provider.open()
                    self.engines[name] = Engine(node, provider, self.options)
                except TransportError as exc:
                    if self.want == name:
                        raise TransportError(f"transport {name!r} is not available on "
                                             f"{node.name}: {exc}") from exc
                    self.unavailable[name] = str(exc)
                    log.info("rvz %s: transport %s unavailable: %s", node.name, name, exc)
        except BaseException:
            self.close()
            raise
        shm = self.engines.get("shm")
        self.host = shm.provider.host_info() if shm is not None else {}

    def offer(self, conn: Connection) -> dict[str, Any]:
        """The HELLO field of a new connection: an endpoint of every provider we have."""
        endpoints = {name: engine.endpoint() for name, engine in self.engines.items()}
        self._offers[conn] = endpoints
        return {"os": {"want": self.want, "host": self.host,
                       "ep": {name: ep.info() for name, ep in endpoints.items()},
                       "no": self.unavailable, "sb": self.options.slot_budget}}

    def on_hello(self, conn: Connection, fields: dict[str, Any]) -> None:
        """Agree on the connection's transport; attach its channel (or raise)."""
        endpoints = self._offers.pop(conn, None) or {}
        peer = conn.peer
        assert peer is not None
        try:
            remote: Any = fields.get("os")
            name, why = decide(self.want, set(endpoints), self.host, remote, self.unavailable)
            if name != "tcp":
                ep = endpoints.pop(name)
                try:
                    conn.dataplane = self.engines[name].attach(conn, ep, remote["ep"][name],
                                                               remote.get("sb"))
                except TransportError:
                    ep.close()
                    raise
        except TransportError as exc:
            err = TransportError(f"{self.node.name} <-> {peer.name}: {exc}")
            log.warning("rvz %s: no transport to %s: %s", self.node.name, peer.name, exc)
            raise err from exc
        finally:
            for ep in endpoints.values():
                ep.close()
        if self.choices.get(peer.id) != name:
            log.info("rvz %s: transport to %s is %s (%s)", self.node.name, peer.name, name, why)
        self.choices[peer.id] = name

    def transport_for(self, task_id: Any) -> str:
        """What the peer got, ``"auto"`` while no connection to it decided yet."""
        peer = self.node._peers.get(task_id)
        if peer is not None:
            for conn in peer.live_connections():
                if conn.ready:
                    channel = conn.dataplane
                    return channel.name if isinstance(channel, Channel) else "tcp"
        return self.choices.get(task_id, self.want)

    def busy(self) -> bool:
        return any(engine.busy() for engine in self.engines.values())

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()
        self.engines.clear()
