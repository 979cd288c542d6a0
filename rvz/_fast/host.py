"""What the protocol engine asks of the node that hosts it: ``Core.host`` is a ``Host``.

These are the engine's only calls upward, for what needs the event loop, a dial or the
node's life cycle.  ``rvz.node`` gives them (``_EngineHost``); the benchmark
of the engine alone gives stubs.  tests/test_layers.py fails on any other call from
``rvz/_fast`` into its host.
"""

from __future__ import annotations

from typing import Any, Protocol


class Host(Protocol):
    def check_running(self, key: str | None = None) -> None:
        """Raise what an operation on a node that is not running raises (``key``: the
        operation's key, named in the message)."""

    def start_link(self, peer: Any) -> None:
        """Dial ``peer`` unless a dial is under way; its queued pushes go once linked."""

    def request_when_linked(self, requests: list[Any]) -> None:
        """Send these Recv-Driven requests (all to one peer) once it is linked."""

    def on_hello(self, conn: Any, fields: dict[str, Any]) -> None:
        """The peer's HELLO on ``conn``; raises the error that refuses it."""

    def on_auth(self, conn: Any, fields: dict[str, Any]) -> None:
        """The peer's AUTH on ``conn``; raises the error that refuses it."""

    def on_error(self, conn: Any, fields: dict[str, Any]) -> None:
        """An ERROR frame: a refused handshake, a closed connection or a failed request."""

    def on_abort_step(self, conn: Any, step: int, message: str) -> None:
        """The peer cleaned up ``step``."""
