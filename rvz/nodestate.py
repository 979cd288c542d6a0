"""What the parts of a node share: its fields, and the methods one part calls on another,
declared once for the type checker.

``rvz.node.Node`` is the public API and the life cycle; its other parts are base classes in
modules of their own: ``rvz.links`` (connections and dialling), ``rvz.peering`` (what the
engine hands up), ``rvz.heartbeat`` (the periodic jobs), ``rvz.waiting`` (calls that must
wait) and ``rvz.closing`` (close and abort).  Each reads the node's fields through
``NodeState``; none of them assigns a field of the engine (tests/test_layers.py).
"""

from __future__ import annotations

import asyncio
import ssl as _ssl
import weakref
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from .cluster import ClusterSpec
from .types import Mode

if TYPE_CHECKING:
    from .connection import Connection
    from .errors import NodeClosed, RvzError
    from .handshake import Handshake
    from .heartbeat import Repeats

TaskId = tuple  # (job, task)

# The nodes started in this process and not yet closed, for a forked child to disown.
started: weakref.WeakSet[Any] = weakref.WeakSet()


class NodeState:
    """The fields of a node its parts read (set in ``Node.__init__`` and ``start``)."""

    name: str
    id: TaskId
    mode: Mode
    cluster: ClusterSpec
    push_window: int
    max_parked: int
    max_payload: int
    max_unidentified: int
    hello_timeout: float
    connect_timeout: float
    heartbeat: float
    peer_timeout: float
    linger: float
    min_rate: int
    step_idle: float | None
    claim_timeout: float | None
    tls_identity: bool
    _core: Any
    _loop: asyncio.AbstractEventLoop | None
    _server: asyncio.AbstractServer | None
    _tick_handle: asyncio.TimerHandle | None
    _poll: Any
    _conns: set[Connection]
    _handshaking: set[Connection]
    _dials: dict[tuple[str, int], asyncio.Future[Connection]]
    _tasks: set[asyncio.Task[Any]]
    _deliveries: set[asyncio.Task[Any]]
    _closing_pushes: list[Any]
    _state: str
    _close_cause: BaseException | None
    _forked_from: int | None
    _said_bye: bool
    _handshake: Handshake
    _onesided: Any
    _recv_pool: Any
    _repeats: Repeats
    _errors: dict[str, int]  # stats()["errors"] (rvz.links.ERROR_KINDS)
    # per peer: bytes in, bytes out, messages in, messages out of its closed connections
    _closed_traffic: dict[Any, list[int]]
    _ssl_server: _ssl.SSLContext | None
    _ssl_client: _ssl.SSLContext | None

    if TYPE_CHECKING:  # what one part calls on another, or on the node
        def _spawn(self, coro: Awaitable[Any], delivery: bool = False) -> None: ...

        def _entry(self, timeout: float | None) -> None: ...

        def _check_empty_batch(self, step: int) -> None: ...

        def _set_state(self, new: str) -> None: ...

        def _closed_error(self, cause: BaseException) -> NodeClosed: ...

        def _say_bye(self, conn: Connection) -> None: ...

        def _drop_table(self, step: int, message: str, cause: BaseException | None,
                        kind: type[Any] = ...) -> None: ...

        def _abort_step(self, step: int, message: str, cause: BaseException | None,
                        origin: Any) -> None: ...

        def _push_held(self) -> list[Any]: ...

        def _held_keys(self) -> list[tuple[int, Any, Any]]: ...

        def _link(self, peer: Any, key: str) -> Awaitable[Any]: ...

        def _link_ready(self, peer: Any, conn: Connection) -> None: ...

        def _request_when_linked(self, requests: list[Any]) -> None: ...

        def _peer_lost(self, peer: Any, err: RvzError, keep: Connection | None = None,
                       level: int | None = None) -> None: ...

        def _fail_queued_pushes(self, peer: Any, error: Callable[[str], BaseException],
                                step: int | None = None) -> None: ...

        def abort(self, exc: BaseException | None = None) -> None: ...
