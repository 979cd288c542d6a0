"""The type aliases of rvz's public API, for annotations in user code and in rvz itself.

``Value`` is what ``recv`` returns (``SendValue`` what ``send`` takes), ``KeyLike`` what names a key,
``Mode`` and ``TransportName`` the accepted spellings of ``mode=`` and ``transport=``,
``LoopName`` those of ``rvz.run(loop=...)``.  A typo in a literal fails type checking.
"""

from __future__ import annotations

import ssl as _ssl
from typing import TYPE_CHECKING, Any, Literal, Protocol, TypeAlias, TypedDict

import numpy as np
import numpy.typing as npt

# Type checkers read the pure-Python source of Key; at run time it is whichever of the
# compiled and the pure-Python Key rvz._impl loaded.
if TYPE_CHECKING:
    from ._fast.keys import Key
else:
    from ._impl import keys as _keys

    Key = _keys.Key

Value: TypeAlias = npt.NDArray[Any] | bytes
"""A value rvz moves: a numpy array of a numeric or bool dtype (any shape), or ``bytes``.
``recv`` returns one of these."""



class DLPackTensor(Protocol):
    """A tensor that exports DLPack: torch, JAX, TensorFlow and numpy arrays do."""

    def __dlpack__(self) -> Any: ...

    def __dlpack_device__(self) -> Any: ...


class ArrayInterface(Protocol):
    """An object that describes its memory by numpy's ``__array_interface__``."""

    @property
    def __array_interface__(self) -> dict[str, Any]: ...


SendValue: TypeAlias = Value | bytearray | memoryview | np.generic | DLPackTensor | ArrayInterface
"""What ``send`` accepts: a ``Value``; a ``bytearray`` or ``memoryview``, sent as its bytes
(it arrives as ``bytes``); a numpy scalar (``arr.sum()``), sent as a 0-d array; or a CPU
tensor of another framework (DLPack or ``__array_interface__``; any other object that
exports the buffer protocol too), read where it lies and received as a numpy array."""

KeyLike: TypeAlias = Key | str
"""Anything ``send``/``recv`` accept as a key: a ``rvz.Key`` or its string form."""

Mode: TypeAlias = Literal["recv", "send"]
"""``"recv"`` (Recv-Driven, TensorFlow's default) or ``"send"`` (Send-Driven)."""

TransportName: TypeAlias = Literal["tcp", "shm", "verbs", "auto"]
"""The transports of ``Node(transport=...)``."""

LoopName: TypeAlias = Literal["auto", "uvloop", "asyncio"]
"""The event loops of ``rvz.run(loop=...)`` and ``rvz.new_event_loop``."""


class NodeOptions(TypedDict, total=False):
    """The keyword options of ``Node`` after its cluster, job and task, as
    ``Node.from_env(**options)`` takes them (``Node`` documents each)."""

    mode: Mode
    transport: TransportName
    host: str | None
    connect_timeout: float
    heartbeat: float
    peer_timeout: float
    linger: float
    push_window: int
    hold_limit: int
    lost_hold_limit: int | None
    claim_timeout: float | None
    incarnation: int | None
    max_payload: int
    recv_pool: int
    onesided: dict[str, Any] | None
    shm_copy: bool
    secret: str | bytes | None
    ssl: _ssl.SSLContext | tuple[_ssl.SSLContext, _ssl.SSLContext] | None
    max_parked: int
    max_steps: int
    step_idle: float | None
    hello_timeout: float
    max_unidentified: int
    answer_backlog: int
    busy_poll: float
    min_rate: int
    tls_identity: bool


class PeerStats(TypedDict):
    """One peer in ``Node.stats()["peers"]``."""

    state: Literal["connected", "dialling", "idle"]
    transport: str | None
    incarnation: int | None
    mode: Mode | None
    bytes_in: int
    bytes_out: int
    messages_in: int
    messages_out: int
    credit: int
    owed: int
    unreturned: int
    arriving: int  # what its pushes whose payload is still arriving will cost the window
    window: int
    queued_pushes: int
    parked_requests: int
    deferred_answers: int
    outstanding_requests: int
    held_back_requests: int
    held_values: int
    credit_stalls: int  # pushes to it that waited for its credit, the link being up


class StepStats(TypedDict):
    """One step in ``Node.stats()["steps"]``."""

    queued_values: int
    queued_keys: int
    waiting_recvs: int
    waiting_keys: int


class HeldStats(TypedDict):
    """``Node.stats()["held"]``: the Recv-Driven values kept for remote consumers."""

    values: int
    bytes: int


class WaitStats(TypedDict):
    """``Node.stats()["waits"]``: how often a send or a recv had to wait for the other."""

    producer: int
    consumer: int


class IntoStats(TypedDict):
    """``Node.stats()["into"]``: the bytes of values that ``recv(..., into=buf)`` received
    straight from the socket into ``buf``, and those it copied into one."""

    landed_bytes: int
    copied_bytes: int


class BusyPollStats(TypedDict):
    """``Node.stats()["busy_poll"]``: the budget in seconds, the loop passes kept awake."""

    budget: float
    spins: int


class NodeStats(TypedDict):
    """What ``Node.stats()`` returns (plain data; the README describes each field)."""

    node: str
    address: str
    state: str
    mode: Mode
    transport: str
    implementation: str
    peers: dict[str, PeerStats]
    steps: dict[int, StepStats]
    held: HeldStats
    waits: WaitStats
    into: IntoStats
    dead_steps: int
    # connections ended by a protocol violation, a refused handshake, a timeout or a reset,
    # and peers lost: {"protocol", "auth", "timeout", "reset", "peer_lost"} -> count
    errors: dict[str, int]
    unidentified: int
    recv_pool: dict[int, tuple[int, int, int]] | None
    busy_poll: BusyPollStats | None


__all__ = ["ArrayInterface", "BusyPollStats", "DLPackTensor", "HeldStats", "IntoStats", "KeyLike", "LoopName",
           "Mode", "NodeOptions", "NodeStats", "PeerStats", "SendValue", "StepStats", "TransportName",
           "Value", "WaitStats"]
