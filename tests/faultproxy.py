"""A user-space TCP fault proxy for tests: sits between two nodes on loopback and, on demand,
delays, stalls, cuts the stream in the middle of a frame, resets, or corrupts bytes.

    proxy = await FaultProxy.start(target_port)     # listens on 127.0.0.1:proxy.port
    proxy.faults.delay = 0.05                       # every chunk waits 50 ms, order kept
    proxy.set_stall(True)                           # stop forwarding (new connections too)
    proxy.faults.cut_after = 1000                   # forward 1000 more bytes, then close both
    proxy.faults.corrupt_next = True                # flip the first byte of the next chunk
    proxy.reset()                                   # RST every connection now
    await proxy.close()                             # stops listening, drops every connection

Memory is bounded: a direction reads at most ``CHUNK`` bytes ahead of what it delivered
(it waits for the writer to drain before reading again), so a stalled direction pushes back
on its sender through TCP flow control.  Everything it starts ends in ``close()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from typing import Any

CHUNK = 64 * 1024
HOST = "127.0.0.1"


class Faults:
    """What the proxy does to the bytes; the test changes it at any time."""

    def __init__(self) -> None:
        self.delay = 0.0                 # seconds each chunk waits before it is forwarded
        self.stall = False               # set through FaultProxy.set_stall
        self.cut_after: int | None = None  # forward this many more bytes, then close both sides
        self.corrupt_next = False        # flip the first byte of the next chunk (either way)
        self.refuse = False              # close new connections at once


class FaultProxy:
    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.faults = Faults()
        self.port = 0
        self.forwarded = 0               # bytes forwarded, both directions
        self.connections = 0             # connections accepted so far
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._unstall = asyncio.Event()
        self._unstall.set()

    @classmethod
    async def start(cls, target_port: int) -> FaultProxy:
        proxy = cls(target_port)
        proxy._server = await asyncio.start_server(proxy._accept, HOST, 0)
        proxy.port = proxy._server.sockets[0].getsockname()[1]
        return proxy

    @property
    def address(self) -> str:
        return f"{HOST}:{self.port}"

    def set_stall(self, stall: bool) -> None:
        self.faults.stall = stall
        if stall:
            self._unstall.clear()
        else:
            self._unstall.set()

    def reset(self) -> None:
        """Send RST on both sides of every connection."""
        for writer in list(self._writers):
            sock = writer.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            writer.transport.abort()
        self._writers.clear()

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        self.reset()
        self._unstall.set()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    # -- forwarding -----------------------------------------------------------------------------

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        if self.faults.refuse:
            writer.transport.abort()
            return
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(HOST, self.target_port), 5)
        except (OSError, asyncio.TimeoutError):
            writer.transport.abort()
            return
        self._writers.update((writer, up_writer))
        self._spawn(self._pump(reader, up_writer, writer))
        self._spawn(self._pump(up_reader, writer, up_writer))

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    other: asyncio.StreamWriter) -> None:
        faults = self.faults
        try:
            while True:
                await self._unstall.wait()
                data = await reader.read(CHUNK)
                if not data:
                    break
                await self._unstall.wait()   # a stall armed while we read holds this chunk
                if faults.delay:
                    await asyncio.sleep(faults.delay)
                if faults.corrupt_next:
                    faults.corrupt_next = False
                    data = bytes([data[0] ^ 0xFF]) + data[1:]
                cut = faults.cut_after
                if cut is not None:
                    if len(data) >= cut:
                        writer.write(data[:cut])
                        self.forwarded += cut
                        faults.cut_after = None
                        await writer.drain()
                        break
                    faults.cut_after = cut - len(data)
                writer.write(data)
                self.forwarded += len(data)
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError, RuntimeError):
            pass  # RuntimeError: the other side's transport was closed under our write
        finally:
            # Close both sides: a cut or a closed peer ends the connection in both directions.
            for w in (writer, other):
                self._writers.discard(w)
                with contextlib.suppress(Exception):
                    w.close()
