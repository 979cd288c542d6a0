"""Two protocol engines joined in memory: the engine's tests without a socket or a node.

``Pair`` makes a producer (worker/0) and a consumer (ps/0), each a ``Core`` with one
``MemWire`` to the other, and runs the real handshake (``rvz.handshake``) between them.  What
a wire writes waits in its transport's ``outbox`` until ``deliver`` hands it to the other side,
so a test decides when bytes arrive: an answer that crosses a cancel, a credit that comes
late.  ``Side`` subclasses the engine's ``NodeCalls`` (compiled in the compiled leg), so its
``send`` and ``recv`` enter the engine as ``rvz.Node``'s do.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any

import rvz
from rvz import _impl
from rvz.handshake import Handshake

engine = _impl.engine
codec = _impl.codec

CLUSTER = rvz.ClusterSpec({"worker": ["127.0.0.1:1"], "ps": ["127.0.0.1:2"]})
WORKER = ("worker", 0)
PS = ("ps", 0)


def key(name: str = "t") -> str:
    """A key worker/0 sends and ps/0 receives."""
    return str(rvz.Key(src="/job:worker/replica:0/task:0/device:CPU:0",
                       dst="/job:ps/replica:0/task:0/device:CPU:0", name=name))


class MemTransport:
    """Keeps what the wire writes, for ``Pair.deliver``."""

    def __init__(self) -> None:
        self.outbox = bytearray()
        self.closing = False

    def write(self, data: Any) -> None:
        self.outbox += data

    def writelines(self, parts: Any) -> None:
        for part in parts:
            self.outbox += part

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self.closing


class MemWire(_impl.wire.Wire):  # type: ignore[misc,name-defined]
    """A connection with no socket: ``failed`` is the error that closed it, if any."""

    def __init__(self, core: Any, outbound: bool, peer: Any) -> None:
        super().__init__(core, outbound, peer, codec.Decoder())
        self.transport = MemTransport()
        self.failed: BaseException | None = None
        self.nonce = b""   # ours, in our HELLO
        self.hello: Any = None  # the peer's, checked (rvz.handshake.Hello)

    def fail(self, reason: BaseException) -> None:
        if self.failed is None:
            self.failed = reason
        self.close_because(reason)

    def close(self) -> None:
        self.closed = True
        self.transport.closing = True


class Side(_impl.calls.NodeCalls):  # type: ignore[misc,name-defined]
    """One node reduced to its engine, its handshake and the calls the engine makes upward
    (``rvz._fast.host.Host``), which it records in ``calls``."""

    def __init__(self, task_id: tuple[str, int], mode: str, loop: asyncio.AbstractEventLoop, *,
                 secret: bytes | None = None, push_window: int = 1 << 20,
                 hold_limit: int = 1 << 20, max_parked: int = 64, incarnation: int = 1) -> None:
        name = f"/job:{task_id[0]}/replica:0/task:{task_id[1]}"
        self._core = engine.Core(self, CLUSTER, task_id, name, mode, None, push_window,
                                 hold_limit, None, max_parked, 1024, 1 << 20, None)
        self._core.attach(loop, threading.get_ident())
        self._core.set_running(True)
        self._loop = loop
        self._poll = None
        self.core = self._core
        self.mode = mode
        self.push_window = push_window
        self.max_parked = max_parked
        self.handshake = Handshake(task_id, incarnation, secret, default_window=push_window,
                                   default_parks=_impl.peers.DEFAULT_PARKS,
                                   in_cluster=lambda t: t in (WORKER, PS))
        self.calls: list[tuple[str, Any]] = []
        self.tasks: set[asyncio.Task[Any]] = set()
        self.wire: Any = None

    # -- the engine's calls upward (Host) ----------------------------------------------------

    def check_running(self, key: str | None = None) -> None:
        self.calls.append(("check_running", key))

    def start_link(self, peer: Any) -> None:
        self.calls.append(("start_link", peer.id))

    def request_when_linked(self, requests: list[Any]) -> None:
        self.calls.append(("request_when_linked", [r.id for r in requests]))

    def on_hello(self, conn: Any, fields: dict[str, Any]) -> None:
        self.handshake.hello_on(self.core, conn, fields, self.accept)

    def on_auth(self, conn: Any, fields: dict[str, Any]) -> None:
        self.handshake.auth_on(conn, fields, self.accept)

    def on_error(self, conn: Any, fields: dict[str, Any]) -> None:
        self.calls.append(("on_error", fields))

    def on_abort_step(self, conn: Any, step: int, message: str) -> None:
        self.calls.append(("on_abort_step", (step, message)))

    def accept(self, conn: Any) -> None:
        """What ``Node._accept_peer`` does for a first connection to a new process."""
        hello, peer = conn.hello, conn.peer
        if not conn.outbound:
            peer.inbound.add(conn)
        self.core.new_incarnation(peer, min(hello.window, self.push_window))
        self.core.accepted(peer, conn, hello.incarnation, hello.parks, hello.mode)
        self.core.link(peer, conn)

    # -- what NodeCalls hands back to its node -----------------------------------------------

    def _spawn(self, coro: Coroutine[Any, Any, Any], delivery: bool = False) -> None:
        task = self._loop.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    async def _link(self, peer: Any, key: str | None = None) -> Any:
        return self.wire

    async def _send_wait(self, pending: Any, step: int, timeout: float | None) -> None:
        assert not isinstance(pending, tuple), "the pair does not model a full hold_limit"
        await asyncio.wait_for(pending, timeout)

    def hello(self, conn: Any) -> None:
        conn.nonce, fields = self.handshake.hello(mode=self.mode, win=self.push_window,
                                                  park=self.max_parked)
        conn.write_frame(codec.encode_hello(fields))


class Pair:
    """A producer and a consumer joined by in-memory wires; ``await Pair.open(...)``."""

    def __init__(self, producer: Side, consumer: Side) -> None:
        self.producer, self.consumer = producer, consumer
        producer.wire = MemWire(producer.core, True, producer.core.routes.peer(PS))
        consumer.wire = MemWire(consumer.core, False, None)

    @classmethod
    async def open(cls, mode: str = "recv", *, secret: bytes | None = None,
                   producer: dict[str, Any] | None = None,
                   consumer: dict[str, Any] | None = None) -> Pair:
        loop = asyncio.get_running_loop()
        pair = cls(Side(WORKER, mode, loop, secret=secret, **(producer or {})),
                   Side(PS, mode, loop, secret=secret, **(consumer or {})))
        pair.producer.hello(pair.producer.wire)
        pair.consumer.hello(pair.consumer.wire)
        await pair.settle()
        assert pair.producer.wire.ready and pair.consumer.wire.ready, "the handshake did not end"
        return pair

    def deliver(self, src: Side) -> int:
        """Hand what ``src`` wrote so far (flushed) to the other side; the bytes handed."""
        wire = src.wire
        wire.flush()
        data = bytes(wire.transport.outbox)
        del wire.transport.outbox[:]
        dst = self.consumer if src is self.producer else self.producer
        view, at = memoryview(data), 0
        while at < len(data) and not dst.wire.closed:
            buffer = dst.wire.get_buffer(len(data) - at)
            n = min(len(buffer), len(data) - at)
            buffer[:n] = view[at:at + n]
            dst.wire.buffer_updated(n)
            at += n
        return len(data)

    async def settle(self, rounds: int = 20) -> None:
        """Let the loop run and deliver both ways until nothing more is written."""
        for _ in range(rounds):
            for _ in range(3):
                await asyncio.sleep(0)
            moved = self.deliver(self.producer) + self.deliver(self.consumer)
            if not moved and not self.producer.wire.transport.outbox \
                    and not self.consumer.wire.transport.outbox:
                for _ in range(3):
                    await asyncio.sleep(0)
                if not (self.producer.wire.transport.outbox or self.consumer.wire.transport.outbox):
                    return

    async def recv(self, key: str, **options: Any) -> Any:
        """The consumer's ``recv``, with bytes delivered both ways until it completes."""
        task = asyncio.ensure_future(self.consumer.recv(key, **options))
        for _ in range(50):
            await self.settle()
            if task.done():
                break
        return await asyncio.wait_for(task, 1)

    def close(self) -> None:
        for side in (self.producer, self.consumer):
            for task in side.tasks:
                task.cancel()
