"""A hostile peer for tests: a raw rvz protocol client, and a victim node in its own process.

``Hostile`` connects to a node's port on loopback, says HELLO as any identity, does the
AUTH step when given a secret (or skips or forges it), sends any bytes (frames built with
``rvz._impl.codec`` or by hand with ``frame``) and reads frames back through a
``codec.Decoder``.  Every wait is bounded by a timeout.

``victim(...)`` runs a node in a subprocess (``python tests/hostile.py CONFIG_JSON``) so that
its memory can be measured apart from the test's: it answers JSON-line commands on stdin
(``stats``, ``send``, ``recv``, ``logs``, ``reset_peak``) and is always killed on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import os
import socket
import ssl as _ssl
import struct
import sys
import tempfile
from collections.abc import AsyncIterator
from typing import Any

import msgpack
import numpy as np

import rvz
from rvz import _impl

codec = _impl.codec
VERSION = codec.VERSION
AUTH = 12                      # the AUTH frame type of the handshake
AUTH_LABEL = b"rvz-auth-2"
# The frame layout as the tests spell it, apart from rvz's codec on purpose (a test of the
# codec must not read the wire through the codec), once for every test that builds or reads
# frames by hand:
HEADER = struct.Struct("<BBHIQ")      # version, type, flags, metadata length, payload length
DATA_FIXED = struct.Struct("<QQHBB")  # DATA metadata: step, request id, key length, dtype, ndim
MANY_FIXED = struct.Struct("<QI")     # DATA_MANY (and REQUESTS) metadata: step, count
READ_PAYLOAD_MAX = 64 << 20    # a test never expects a larger frame from a node
MiB = 1 << 20
GiB = 1 << 30


def device(job: str, task: int) -> str:
    return f"/job:{job}/replica:0/task:{task}/device:CPU:0"


def key_text(name: str, src: tuple[str, int], dst: tuple[str, int], incarnation: int = 1) -> str:
    """A canonical key string from task ``src`` to task ``dst``."""
    return str(rvz.Key(src=device(*src), dst=device(*dst), name=name, incarnation=incarnation))


def identity(job: str, task: int, incarnation: int) -> bytes:
    return f"{job}:{task}:{incarnation}".encode()


def auth_mac(secret: str | bytes, sender_nonce: bytes, receiver_nonce: bytes,
             sender: bytes, receiver: bytes, *, dialled: bool) -> bytes:
    """The MAC of the handshake: HMAC-SHA256 over the sender's side (``dialled``: it
    dialled, else it accepted), both nonces and both identities."""
    key = secret.encode() if isinstance(secret, str) else secret
    side = b"D" if dialled else b"A"
    return hmac.new(key, AUTH_LABEL + side + sender_nonce + receiver_nonce + sender + receiver,
                    hashlib.sha256).digest()


def frame(ftype: int, meta: bytes = b"", payload_len: int | None = None, *,
          version: int = VERSION, flags: int = 0) -> bytes:
    """A frame header and its metadata, by hand (any field may lie)."""
    return HEADER.pack(version, ftype, flags, len(meta), 0 if payload_len is None else payload_len) + meta


def encode_auth(mac: Any) -> bytes:
    return frame(AUTH, msgpack.packb({"mac": mac}, use_bin_type=True))


def data_header(step: int, request_id: int, key: str, code: int, shape: tuple[int, ...],
                payload_len: int) -> bytes:
    """A DATA header whose shape and payload length may be anything (no checks)."""
    wire = key.encode()
    meta = DATA_FIXED.pack(step, request_id, len(wire), code, len(shape))
    meta += struct.pack("<" + "Q" * len(shape), *shape) + wire
    return frame(codec.DATA, meta, payload_len)


def data_frame(step: int, request_id: int, key: str, value: Any) -> bytes:
    """A whole, valid DATA frame carrying ``value`` (an array or bytes)."""
    value, code, shape, nbytes = codec.describe(value)
    return (codec.encode_data(step, request_id, key.encode(), code, shape, nbytes)
            + bytes(codec.payload_view(value)))


def hello_fields(job: str, task: int, incarnation: int, *, mode: str = "recv",
                 nonce: bytes | None = None, auth: bool | None = None,
                 **extra: Any) -> dict[str, Any]:
    fields: dict[str, Any] = {"v": VERSION, "job": job, "task": task, "inc": incarnation,
                              "order": sys.byteorder, "mode": mode}
    if nonce is not None:
        fields["n"] = nonce
    if auth is not None:
        fields["auth"] = auth
    fields.update(extra)
    return fields


def mem_status(pid: int | str = "self") -> dict[str, int]:
    """VmSize, VmPeak, VmRSS and VmHWM of a process, in bytes (from /proc)."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name in ("VmSize", "VmPeak", "VmRSS", "VmHWM"):
                out[name] = int(rest.split()[0]) * 1024
    return out


class Hostile:
    """One raw connection to a node (see the module docstring)."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = codec.Decoder()
        self.node_hello: dict[str, Any] = {}
        self.nonce = b""
        self.identity = b""
        self.node_auth: bytes | None = None   # the MAC the node sent us, if any
        self.eof = False
        self.numbering: list[Any] = []  # SEQ and ACK events read_event passed over

    @classmethod
    async def connect(cls, address: str, *, ssl: _ssl.SSLContext | None = None,
                      rcvbuf: int | None = None, timeout: float = 5.0) -> Hostile:
        host, port = address.rsplit(":", 1)
        if rcvbuf is None:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(host, int(port), ssl=ssl), timeout)
        else:  # a small receive buffer: a reader that never reads stalls the node soon
            sock = socket.socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
            sock.setblocking(False)
            try:
                await asyncio.wait_for(asyncio.get_running_loop().sock_connect(sock, (host, int(port))),
                                       timeout)
            except BaseException:
                sock.close()
                raise
            reader, writer = await asyncio.open_connection(sock=sock, ssl=ssl)
        return cls(reader, writer)

    # -- writing ------------------------------------------------------------------------

    async def send(self, data: bytes, timeout: float = 10.0) -> bool:
        """Write ``data``; False if the node has closed the connection meanwhile."""
        if self.writer.is_closing():  # uvloop raises on a write after the close, asyncio not
            return False
        try:
            self.writer.write(data)
        except (ConnectionError, OSError):
            return False
        # drain() races the close: on Python 3.10 a drain already waiting when the node
        # resets the connection may never wake, though the stream has seen the reset.
        drain = asyncio.ensure_future(self.writer.drain())
        closed = asyncio.ensure_future(self.writer.wait_closed())
        try:
            done, _ = await asyncio.wait({drain, closed}, timeout=timeout,
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (drain, closed):
                task.cancel()
            if closed.done() and not closed.cancelled():
                closed.exception()  # the reset it ended with is the node's close: seen
        if not done:
            raise asyncio.TimeoutError(f"the node read nothing for {timeout}s")
        if drain not in done:
            return False
        try:
            drain.result()
            return True
        except (ConnectionError, OSError):
            return False

    async def flood(self, chunks: Any, timeout: float = 20.0) -> int:
        """Write every chunk of an iterable until the node closes; the number written."""
        written = 0
        for chunk in chunks:
            if not await self.send(chunk, timeout):
                break
            written += 1
        return written

    # -- reading ------------------------------------------------------------------------

    async def read_event(self, timeout: float = 5.0) -> Any:
        """The next frame as a decoder event, ``("AUTH", fields)`` for AUTH, or None at EOF.
        SEQ and ACK frames (the numbering of values, which a raw peer does not keep) are
        passed over and kept in ``numbering``.

        Raises ``asyncio.TimeoutError`` if nothing complete arrives within ``timeout``.
        """
        while True:
            event = await self._read_event(timeout)
            if event is None or event[0] not in (codec.SEQ, codec.ACK):
                return event
            self.numbering.append(event)

    async def _read_event(self, timeout: float) -> Any:
        if self.eof:
            return None
        try:
            header = await asyncio.wait_for(self.reader.readexactly(16), timeout)
            version, ftype, flags, meta_len, payload_len = HEADER.unpack(header)
            if meta_len > codec.MAX_META or payload_len > READ_PAYLOAD_MAX:
                raise AssertionError(f"the node sent a frame of type {ftype} with {meta_len} "
                                     f"bytes of metadata and {payload_len} of payload")
            body = await asyncio.wait_for(self.reader.readexactly(meta_len + payload_len), timeout)
        except (asyncio.TimeoutError, TimeoutError):
            # Not the end of the stream: the caller decides.  (On Python 3.11+ it is the
            # built-in TimeoutError, an OSError, which the clause below took for an EOF: a
            # connection the node never closed read as closed.)
            raise
        except (asyncio.IncompleteReadError, ConnectionError, OSError):
            self.eof = True
            return None
        if ftype == AUTH:
            return ("AUTH", msgpack.unpackb(body, raw=False))
        events = self._decode(header + body)
        assert len(events) == 1, events
        return events[0]

    def _decode(self, data: bytes) -> list[Any]:
        events: list[Any] = []
        view = memoryview(data)
        while view.nbytes:
            buf = self.decoder.get_buffer(-1)
            n = min(len(buf), view.nbytes)
            buf[:n] = view[:n]
            events += self.decoder.buffer_updated(n)
            view = view[n:]
        return events

    async def events_until_closed(self, timeout: float = 5.0) -> list[Any]:
        """Every frame the node sends until it closes the connection (within ``timeout``)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        events = []
        while True:
            left = end - loop.time()
            if left <= 0:
                kinds: dict[Any, int] = {}
                for e in events:
                    kinds[e[0]] = kinds.get(e[0], 0) + 1
                raise AssertionError(f"the node did not close the connection within {timeout}s; "
                                     f"it sent these frame types (type: count): {kinds}")
            try:
                event = await self.read_event(left)
            except asyncio.TimeoutError:
                continue
            if event is None:
                return events
            events.append(event)

    async def is_open_after(self, seconds: float) -> bool:
        """Whether the connection is still open after ``seconds`` (frames read meanwhile are
        dropped); used only where staying open is the expected, patient outcome."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while loop.time() < end:
            try:
                if await self.read_event(max(0.001, end - loop.time())) is None:
                    return False
            except asyncio.TimeoutError:
                break
        return not self.eof

    # -- the handshake ------------------------------------------------------------------

    async def hello(self, job: str, task: int, incarnation: int = 7, *,
                    secret: str | bytes | None = None, auth: bool | None = None,
                    nonce: bytes | None = None, mac: Any = None, mode: str = "recv",
                    timeout: float = 5.0, **extra: Any) -> dict[str, Any]:
        """Say HELLO as ``job:task``; read the node's HELLO; with ``secret`` (or a forged
        ``mac``) send AUTH.  Returns the node's HELLO fields.

        ``auth`` defaults to "a secret or a mac is given"; a nonce is always sent when it
        is true.  The node's own AUTH, if it sends one, is read later by ``read_auth``.
        """
        if auth is None:
            auth = secret is not None or mac is not None
        self.nonce = nonce if nonce is not None else os.urandom(16)
        self.identity = identity(job, task, incarnation)
        fields = hello_fields(job, task, incarnation, mode=mode,
                              nonce=self.nonce if auth else None, auth=True if auth else None,
                              **extra)
        if not await self.send(codec.encode_hello(fields), timeout):
            return {}
        event = await self.read_event(timeout)
        if event is None:
            return {}
        assert event[0] == codec.HELLO, event
        self.node_hello = event[1]
        if secret is not None and mac is None:
            mac = auth_mac(secret, self.nonce, self.node_nonce, self.identity, self.node_identity,
                           dialled=True)
        if mac is not None:
            await self.send(encode_auth(mac), timeout)
        return self.node_hello

    @property
    def node_nonce(self) -> bytes:
        return bytes(self.node_hello.get("n", b""))

    @property
    def node_identity(self) -> bytes:
        h = self.node_hello
        return identity(h["job"], h["task"], h["inc"])

    async def read_auth(self, timeout: float = 5.0) -> bytes | None:
        """The node's AUTH MAC (the first AUTH frame it sends), or None if it closes first."""
        while True:
            event = await self.read_event(timeout)
            if event is None:
                return None
            if event[0] == "AUTH":
                self.node_auth = bytes(event[1]["mac"])
                return self.node_auth

    def close(self) -> None:
        self.writer.close()


# -- a victim node in its own process ------------------------------------------------------

HERE = os.path.abspath(__file__)


class Victim:
    """The test's handle on a victim process: ``await v.call("stats")``."""

    def __init__(self, proc: asyncio.subprocess.Process, err: Any) -> None:
        self.proc = proc
        self.pid = proc.pid
        self._err = err

    async def call(self, op: str, timeout: float = 20.0, **args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write((json.dumps({"op": op, **args}) + "\n").encode())
        await self.proc.stdin.drain()
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not line:
            raise AssertionError(f"victim process died: {self.stderr()}")
        reply = json.loads(line)
        if "fail" in reply:
            raise AssertionError(f"victim could not {op}: {reply['fail']}")
        return reply

    def mem(self) -> dict[str, int]:
        return mem_status(self.pid)

    def stderr(self) -> str:
        self._err.seek(0)
        return str(self._err.read().decode(errors="replace"))[-3000:]


@contextlib.asynccontextmanager
async def victim(cluster: rvz.ClusterSpec, job: str, task: int, mode: str = "recv",
                 **options: Any) -> AsyncIterator[Victim]:
    """A node in a subprocess on this test's loop kind, killed and reaped on the way out."""
    config = {"cluster": cluster.as_dict(), "job": job, "task": task, "mode": mode,
              "loop": rvz.loop_name(), "options": options}
    err = tempfile.TemporaryFile()
    env = dict(os.environ)
    env.pop("RVZ_SECRET", None)   # the victim gets exactly the options the test gives it
    proc = await asyncio.create_subprocess_exec(
        sys.executable, HERE, json.dumps(config), stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=err, env=env)
    handle = Victim(proc, err)
    try:
        assert proc.stdout is not None
        try:
            line = await asyncio.wait_for(proc.stdout.readline(), 30)
        except asyncio.TimeoutError:
            line = b""
        if not line.startswith(b"ready"):
            raise AssertionError(f"victim process did not start: {line!r} {handle.stderr()}")
        assert line.split()[1].decode() == rvz.implementation()
        yield handle
    finally:
        if proc.returncode is None:
            proc.kill()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        finally:
            err.close()


class _Records(logging.Handler):
    """Keeps the victim's log records of WARNING and above (the first 200, and a count)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1
        if len(self.lines) < 200:
            self.lines.append(f"{record.name} {record.levelname} {record.getMessage()}")


async def _victim_main(config: dict[str, Any]) -> None:
    records = _Records()
    logging.getLogger("rvz").addHandler(records)
    logging.basicConfig(stream=sys.stderr, level=logging.WARNING)
    loop = asyncio.get_running_loop()
    unhandled: list[str] = []
    loop.set_exception_handler(lambda _loop, context: unhandled.append(str(context.get("message"))))
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    node = rvz.Node(config["cluster"], config["job"], config["task"], config["mode"],
                    **config["options"])
    kept: list[Any] = []  # values sent: a Recv-Driven send does not copy them

    def reply(obj: Any) -> None:
        sys.stdout.write(json.dumps(obj, default=str) + "\n")
        sys.stdout.flush()

    async with node:
        print("ready", rvz.implementation(), flush=True)
        while True:
            line = await reader.readline()
            if not line:
                return  # the test went away
            cmd = json.loads(line)
            op = cmd.pop("op")
            try:
                if op == "stats":
                    reply({"stats": node.stats(), "mem": mem_status(), "unhandled": unhandled,
                           "held": node._held_count})
                elif op == "logs":
                    reply({"count": records.count, "lines": records.lines})
                elif op == "reset_peak":
                    with open("/proc/self/clear_refs", "w") as f:
                        f.write("5")  # resets VmHWM to the current RSS
                    reply({"mem": mem_status()})
                elif op == "send":
                    for i in range(cmd.get("count", 1)):
                        value = np.full(cmd["size"], (cmd.get("fill", 0) + i) % 256, np.uint8)
                        kept.append(value)
                        await node.send(cmd["key"], value, mode=cmd.get("mode"),
                                        step=cmd.get("step", 0), timeout=cmd.get("send_timeout", 10))
                    reply({"ok": True})
                elif op == "recv":
                    got = []
                    for _ in range(cmd.get("count", 1)):
                        value = await node.recv(cmd["key"], mode=cmd.get("mode"),
                                                step=cmd.get("step", 0), timeout=cmd.get("timeout", 5))
                        arr = np.frombuffer(value, np.uint8) if isinstance(value, bytes) else value
                        got.append([int(arr.nbytes), int(arr.reshape(-1)[0]) if arr.size else -1,
                                    bool((arr == arr.reshape(-1)[0]).all()) if arr.size else True])
                    reply({"values": got})
                else:
                    reply({"fail": f"unknown op {op}"})
            except Exception as exc:  # the test checks the error it expects
                reply({"error": type(exc).__name__, "message": str(exc)})


def _main() -> None:
    config = json.loads(sys.argv[1])
    rvz.run(_victim_main(config), loop=config["loop"])


if __name__ == "__main__":
    _main()
