"""The small verbs-like interface the one-sided engine runs on.

A *provider* moves bytes between two processes without the receiver's CPU taking part in
the copy.  It offers what RDMA verbs offer, and nothing else:

* ``register(length) -> Region``: memory a peer may write into (``rkey``) and that local
  writes may read from (``lkey``), with its local address and a writable ``view``;
* ``create_cq() -> CompletionQueue``: a completion queue with a file descriptor ``fd`` that
  becomes readable when ``poll()`` has something; the engine watches it with
  ``loop.add_reader``;
* ``create_endpoint(cq, ep_id) -> Endpoint``: one side of a reliable connection (an RC queue
  pair); ``info()`` is what the peer needs to connect to it and travels in the TCP HELLO;
  ``connect(remote_info)`` completes it;
* ``Endpoint.write(sources, remote_addr, rkey, imm, wr_id)``: a one-sided write with an
  immediate value: the bytes of ``sources`` land contiguously at ``remote_addr`` in the
  peer's registered memory, then the peer's completion queue reports ``(RECV_WRITE, its
  endpoint id, imm, length)``;
* ``Endpoint.write_plain(sources, remote_addr, rkey, wr_id)`` (verbs only): the same write
  without an immediate, which the peer does not see complete; a write with an immediate
  posted after it on the endpoint completes after it has landed;
* ``register_memory(addr, length) -> Region`` (only when ``registers_private``): memory of
  the process's own (a recv's ``into=`` buffer) registered for the peer to write, until
  ``deregister``; after that the device writes nothing into it, and a peer's write into it
  fails at the peer.  shm cannot: a peer writes only into memory it can map;
* ``Endpoint.send(parts, wr_id)``: a small two-sided message (at most ``max_message``
  bytes) that the peer's completion queue reports as ``(RECV_MSG, endpoint id, bytes)``.

Writes and messages posted on one endpoint are reported to the peer in the order they were
posted.  Completions are plain tuples (this is the hot path):

``(RECV_WRITE, ep_id, imm, byte_len)``, ``(RECV_MSG, ep_id, data)``,
``(SEND_DONE, ep_id, wr_id)`` (a local write/send finished; its sources may be reused) and
``(FAILED, ep_id, message)`` (the endpoint is broken: every operation on it fails).
"""

from __future__ import annotations

from typing import Any, Protocol

RECV_WRITE = 1
RECV_MSG = 2
SEND_DONE = 3
FAILED = 4

# A source of a write: a byte view of the data, its address, and the local key of the
# registered region it lies in (0 when it is not in registered memory).
Source = tuple  # (memoryview, addr, lkey)


class Region:
    """A registered chunk of memory.  ``view`` is a writable byte view of all of it."""

    __slots__ = ("rkey", "lkey", "addr", "length", "view", "handle", "extra")

    def __init__(self, rkey: int, lkey: int, addr: int, length: int, view: memoryview,
                 handle: Any = None, extra: dict[str, Any] | None = None) -> None:
        self.rkey = rkey
        self.lkey = lkey
        self.addr = addr
        self.length = length
        self.view = view
        self.handle = handle          # the provider's object (mmap, MR) kept alive with it
        self.extra = extra or {}      # what else a peer needs to reach it (shm: pid, fd)

    def describe(self) -> dict[str, Any]:
        """What a peer needs to write into this region."""
        desc = {"rk": self.rkey, "a": self.addr, "n": self.length}
        desc.update(self.extra)
        return desc

    def __repr__(self) -> str:
        return f"<Region rkey={self.rkey} addr={self.addr:#x} length={self.length}>"


class CompletionQueue(Protocol):
    fd: int

    def poll(self) -> list[tuple[Any, ...]]: ...

    def close(self) -> None: ...


class Endpoint(Protocol):
    ep_id: int

    def info(self) -> dict[str, Any]: ...

    def connect(self, remote: dict[str, Any]) -> None: ...

    def add_region(self, desc: dict[str, Any]) -> None: ...

    def remove_region(self, rkey: int) -> None: ...

    def write(self, sources: list[Source], remote_addr: int, rkey: int, imm: int,
              wr_id: int) -> bool: ...

    def send(self, parts: list[Any], wr_id: int) -> bool: ...

    def pending(self) -> bool: ...

    def close(self) -> None: ...


class Provider(Protocol):
    name: str
    needs_registered_source: bool
    max_message: int
    tcp_max: int  # default of Options.tcp_max: keys first pushed up to it stay on TCP
    answer_tcp_max: int  # keys first answered up to it stay on TCP (at most tcp_max)
    registers_private: bool  # ``register_memory`` works: a recv's buffer can be a destination

    def open(self) -> None: ...

    def host_info(self) -> dict[str, Any]: ...

    def register(self, length: int) -> Region: ...

    def register_memory(self, addr: int, length: int) -> Region: ...

    def deregister(self, region: Region) -> None: ...

    def create_cq(self) -> CompletionQueue: ...

    def create_endpoint(self, cq: Any, ep_id: int) -> Endpoint: ...

    def close(self) -> None: ...
