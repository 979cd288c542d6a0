"""The shared-memory provider: one-sided writes between processes on one host.

Memory: every pool chunk is a ``memfd`` mapped ``MAP_SHARED``; a peer maps the same file
through ``/proc/<pid>/fd/<fd>`` (same user, same host, same pid namespace) and a write is a
``memcpy`` into that mapping, done by the writer: the receiver's CPU does not copy.

Completions: every completion queue is a pipe.  A peer opens its write end through
``/proc/<pid>/fd/<fd>`` and appends fixed records after its writes; the receiver's event
loop watches the read end.  Records are at most ``PIPE_BUF`` bytes and every ``write(2)``
carries whole records of at most ``PIPE_BUF`` bytes, which POSIX makes atomic, so several
peers can share one queue.  The ``write(2)`` after the ``memcpy`` and the ``read(2)``
before the receiver looks at the memory order the two (no reliance on CPU memory order).

Record (little-endian, 24 bytes, then the message for ``OP_MSG``)::

    u32 total_len | u8 op | u8 status | u16 0 | u32 endpoint | u32 imm | u64 byte_len

The files are checked by inode after opening, so a recycled fd number is caught.  Nothing
is left in the filesystem if a process is killed: memfds and pipes die with their holders.
"""

from __future__ import annotations

import asyncio
import fcntl
import itertools
import mmap
import os
import select
import struct
import sys
from typing import Any

import numpy as np

from ..errors import TransportError
from .provider import FAILED, RECV_MSG, RECV_WRITE, Region, Source

PIPE_BUF = getattr(select, "PIPE_BUF", 4096)
RECORD = struct.Struct("<IBBHIIQ")
OP_WRITE = 1
OP_MSG = 2
F_SETPIPE_SZ = 1031
_READ_SIZE = 1 << 20
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


def _address(view: memoryview) -> int:
    arr = np.frombuffer(view, np.uint8, 1)
    return int(arr.__array_interface__["data"][0])


def check() -> None:
    """Raise ``TransportError`` naming why shm cannot work in this process."""
    if not sys.platform.startswith("linux"):
        raise TransportError(f"shm transport needs Linux (memfd, /proc); this is {sys.platform}")
    if not hasattr(os, "memfd_create"):
        raise TransportError("shm transport needs os.memfd_create (Linux 3.17+, Python 3.8+)")
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        raise TransportError("shm transport needs /proc mounted (peers open files through "
                             "/proc/<pid>/fd)")


class ShmProvider:
    name = "shm"
    needs_registered_source = False
    max_message = PIPE_BUF - RECORD.size
    # Pushes up to this size cost less over the TCP connection (compiled and coalesced)
    # than as one pipe record each; from about 1 MiB the one-sided copy is faster.
    tcp_max = 256 << 10
    # Answers up to this size too: below it, offering a destination (a control frame
    # before each request), the write and its completion cost more than the TCP answer.
    answer_tcp_max = 64 << 10
    # A peer writes only into memory it maps (memfds of ours): never into a recv's private
    # into= buffer, so values reach such a buffer by one copy.
    registers_private = False

    def __init__(self, loop: asyncio.AbstractEventLoop, pipe_size: int = 1 << 20) -> None:
        self.loop = loop
        self.pipe_size = pipe_size
        self._rkeys = itertools.count(1)
        self.pid = os.getpid()

    def open(self) -> None:
        check()

    def host_info(self) -> dict[str, Any]:
        try:
            pidns = os.stat("/proc/self/ns/pid").st_ino
        except OSError:
            pidns = 0
        return {"boot": _boot_id(), "uid": os.getuid(), "pidns": pidns}

    def register(self, length: int) -> Region:
        try:
            fd = os.memfd_create("rvz-pool", os.MFD_CLOEXEC)
        except OSError as exc:
            raise TransportError(f"shm: memfd_create failed: {exc}") from exc
        try:
            os.ftruncate(fd, length)
            mm = mmap.mmap(fd, length, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            os.close(fd)
            raise TransportError(f"shm: cannot map {length} bytes of shared memory: {exc}; "
                                 "is /dev/shm (tmpfs) large enough?") from exc
        view = memoryview(mm)
        rkey = next(self._rkeys)
        return Region(rkey, rkey, _address(view), length, view, handle=(mm, _Fd(fd)),
                      extra={"fd": fd, "ino": os.fstat(fd).st_ino})

    def register_memory(self, addr: int, length: int) -> Region:
        raise TransportError("shm cannot register private memory: a peer maps only memfds")

    def deregister(self, region: Region) -> None:
        mm, fd = region.handle
        region.view.release()
        mm.close()
        fd.close()

    def create_cq(self) -> ShmCQ:
        return ShmCQ(self)

    def create_endpoint(self, cq: ShmCQ, ep_id: int) -> ShmEndpoint:
        return ShmEndpoint(self, cq, ep_id)

    def close(self) -> None:
        pass


class _Fd:
    """A region's memory file descriptor: closed at ``deregister``, or when the region is
    collected unregistered (a node never closed must not hold its shared memory until the
    process exits)."""

    __slots__ = ("fd",)

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def close(self, _close: Any = os.close) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            _close(fd)

    __del__ = close


class ShmCQ:
    """A completion queue: a pipe whose write end peers open through /proc."""

    def __init__(self, provider: ShmProvider) -> None:
        self.fd, self.wfd = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        try:
            fcntl.fcntl(self.wfd, F_SETPIPE_SZ, provider.pipe_size)
        except OSError:
            pass  # the default 64 KiB works too, with more EAGAIN under load
        self.ino = os.fstat(self.wfd).st_ino
        # Records are read into one preallocated buffer (a fresh 1 MiB bytes per read would
        # cost more than the records); a record cut at its end moves to the front.
        self._buf = bytearray(_READ_SIZE)
        self._view = memoryview(self._buf)
        self._end = 0
        self.closed = False

    def poll(self) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        buf = self._buf
        view = self._view
        unpack = RECORD.unpack_from
        while True:
            try:
                n = os.readv(self.fd, [view[self._end:]])
            except BlockingIOError:
                return out
            except OSError as exc:
                return out + [(FAILED, 0, f"shm completion pipe failed: {exc}")]
            end = self._end + n
            pos = 0
            while end - pos >= 24:
                total, op, status, _, ep, imm, nbytes = unpack(buf, pos)
                if total < 24 or total > PIPE_BUF:
                    # Only processes of this user write here; a torn stream cannot be resynced.
                    self._end = 0
                    return out + [(FAILED, 0, f"corrupt record of {total} bytes in the shm "
                                              "completion pipe")]
                if end - pos < total:
                    break
                if op == OP_WRITE:
                    out.append((RECV_WRITE, ep, imm, nbytes))
                elif op == OP_MSG:
                    out.append((RECV_MSG, ep, bytes(view[pos + 24:pos + total])))
                pos += total
            if pos < end:
                buf[:end - pos] = view[pos:end]
            self._end = end - pos
            if n == 0 or end < _READ_SIZE:
                return out

    def close(self, _close: Any = os.close) -> None:
        # Also when collected unclosed (a node never closed): its pipe goes with it, not with
        # the process.  (getattr: a queue whose pipe2 failed has no fds to close.)
        if not getattr(self, "closed", True):
            self.closed = True
            _close(self.fd)
            _close(self.wfd)

    __del__ = close


class ShmEndpoint:
    """Our side of a same-host connection: the peer's mapped regions and its pipe."""

    def __init__(self, provider: ShmProvider, cq: ShmCQ, ep_id: int) -> None:
        self.provider = provider
        self.loop = provider.loop
        self.cq = cq
        self.ep_id = ep_id
        self.on_error: Any = None     # set by the engine: called with a TransportError
        self._pid = 0
        self._wfd = -1
        self._remote_ep = 0
        self._maps: dict[int, tuple[mmap.mmap, memoryview, int, int]] = {}
        self._records: list[bytes] = []
        self._flush_scheduled = False
        self._hot = False             # a record went out at once in this loop iteration
        self._writer = False
        self.closed = False

    def info(self) -> dict[str, Any]:
        return {"pid": self.provider.pid, "cq": self.cq.wfd, "cqino": self.cq.ino, "ep": self.ep_id}

    def _open(self, fd: int, flags: int, what: str) -> int:
        path = f"/proc/{self._pid}/fd/{fd}"
        try:
            return os.open(path, flags | os.O_CLOEXEC)
        except OSError as exc:
            raise TransportError(
                f"shm: cannot open the {what} of process {self._pid} ({path}): {exc.strerror}; "
                "shm needs both processes on one host, under one user, in one pid "
                "namespace") from exc

    def connect(self, remote: dict[str, Any]) -> None:
        try:
            self._pid = int(remote["pid"])
            cq, ino, self._remote_ep = int(remote["cq"]), int(remote["cqino"]), int(remote["ep"])
        except (KeyError, TypeError, ValueError):
            raise TransportError(f"shm: malformed endpoint info from the peer: {remote!r}") from None
        fd = self._open(cq, os.O_WRONLY | os.O_NONBLOCK, "completion pipe")
        if os.fstat(fd).st_ino != ino:
            os.close(fd)
            raise TransportError(f"shm: fd {cq} of process {self._pid} is not its completion pipe "
                                 "any more (did it exit?)")
        self._wfd = fd

    def add_region(self, desc: dict[str, Any]) -> None:
        rkey = int(desc["rk"])
        if rkey in self._maps:
            return
        length = int(desc["n"])
        fd = self._open(int(desc["fd"]), os.O_RDWR, f"memory region {rkey}")
        try:
            st = os.fstat(fd)
            if st.st_ino != int(desc["ino"]) or st.st_size < length:
                raise TransportError(f"shm: fd {desc['fd']} of process {self._pid} is not its memory "
                                     f"region {rkey} any more")
            mm = mmap.mmap(fd, length, _MAP_FLAGS, mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise TransportError(f"shm: cannot map region {rkey} of process {self._pid}: {exc}") from exc
        finally:
            os.close(fd)
        self._maps[rkey] = (mm, memoryview(mm), int(desc["a"]), length)

    def remove_region(self, rkey: int) -> None:
        """The peer unregistered a region: unmap it (its memory goes once nobody maps it)."""
        mapping = self._maps.pop(rkey, None)
        if mapping is not None:
            mapping[1].release()
            mapping[0].close()

    def write(self, sources: list[Source], remote_addr: int, rkey: int, imm: int, wr_id: int) -> bool:
        if self.closed:
            raise TransportError("shm endpoint is closed")
        mapping = self._maps.get(rkey)
        if mapping is None:
            raise TransportError(f"shm: write to unknown region {rkey} of process {self._pid}")
        _, view, base, length = mapping
        off = remote_addr - base
        total = 0
        for src in sources:
            total += src[0].nbytes
        if off < 0 or off + total > length:
            raise TransportError(f"shm: write of {total} bytes at {remote_addr:#x} is outside "
                                 f"region {rkey} ({base:#x}+{length})")
        for src in sources:
            n = src[0].nbytes
            if n:
                view[off:off + n] = src[0]
                off += n
        self._post(RECORD.pack(24, OP_WRITE, 0, 0, self._remote_ep, imm, total))
        return True

    def send(self, parts: list[Any], wr_id: int) -> bool:
        if self.closed:
            raise TransportError("shm endpoint is closed")
        n = 0
        for part in parts:
            n += len(part)
        if n + 24 > PIPE_BUF:
            raise ValueError(f"message of {n} bytes exceeds {self.provider.max_message}")
        self._post(b"".join([RECORD.pack(n + 24, OP_MSG, 0, 0, self._remote_ep, 0, n), *parts]))
        return True

    def _post(self, record: bytes) -> None:
        """The first record of a loop iteration goes out at once (latency); the others of
        that iteration are coalesced into as few writes as PIPE_BUF allows (throughput)."""
        if self._hot or self._records:
            self._records.append(record)
        else:
            try:
                os.write(self._wfd, record)
            except BlockingIOError:
                self._records.append(record)
            except OSError as exc:
                self._fail(TransportError(f"shm: the completion pipe of process {self._pid} "
                                          f"failed ({exc.strerror}): the peer is gone"))
                return
            self._hot = True
        if not self._flush_scheduled:
            self._flush_scheduled = True
            self.loop.call_soon(self.flush)

    def pending(self) -> bool:
        return bool(self._records)

    def flush(self) -> None:
        """Write the queued records, whole and at most PIPE_BUF bytes per write(2)."""
        self._flush_scheduled = False
        self._hot = False
        records = self._records
        if not records or self.closed:
            return
        i = 0
        n = len(records)
        try:
            while i < n:
                size = len(records[i])
                j = i + 1
                while j < n and size + len(records[j]) <= PIPE_BUF:
                    size += len(records[j])
                    j += 1
                data = records[i] if j == i + 1 else b"".join(records[i:j])
                os.write(self._wfd, data)  # whole or EAGAIN: at most PIPE_BUF bytes
                i = j
        except BlockingIOError:
            if not self._writer:
                self._writer = True
                self.loop.add_writer(self._wfd, self._writable)
        except OSError as exc:
            del records[:i]
            self._fail(TransportError(f"shm: the completion pipe of process {self._pid} failed "
                                      f"({exc.strerror}): the peer is gone"))
            return
        del records[:i]
        if not records and self._writer:
            self._writer = False
            self.loop.remove_writer(self._wfd)

    def _writable(self) -> None:
        self.flush()

    def _fail(self, exc: TransportError) -> None:
        self._records.clear()
        if self.on_error is not None:
            self.on_error(exc)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._records.clear()
        if self._wfd >= 0:
            if self._writer:
                self.loop.remove_writer(self._wfd)
            os.close(self._wfd)
            self._wfd = -1
        for mm, view, _, _ in self._maps.values():
            view.release()
            mm.close()
        self._maps.clear()

    def __del__(self, _close: Any = os.close) -> None:
        # Collected unclosed (its loop is gone: no reader to remove); the maps close themselves.
        if not getattr(self, "closed", True) and self._wfd >= 0:
            self.closed = True
            _close(self._wfd)
