"""The exception hierarchy: every error rvz raises is an ``RvzError`` (or the built-in
``TimeoutError`` for an expired ``timeout=``).

Messages name the key and the peer involved.  Derived failures (an abort, a lost peer)
keep the original failure as ``__cause__`` so the root cause is never hidden behind a
bare "cancelled".
"""

from __future__ import annotations


class RvzError(Exception):
    """Base class of every rvz error."""


class KeyFormatError(RvzError, ValueError):
    """A rendezvous key string or device name is malformed."""


class WrongEndpoint(RvzError):
    """A key's source (for send) or destination (for recv) is not this node."""


class Aborted(RvzError):
    """The rendezvous scope (a table, a step, a node) was aborted; ``__cause__`` says why."""


class PeerLost(RvzError):
    """The peer an operation depends on closed, stopped answering, or cannot be reached."""


class ProtocolError(RvzError):
    """A peer sent bytes that are not a valid rvz frame; that connection is closed."""


class TransportError(RvzError):
    """A transport failed to move data (a failed completion, a refused registration)."""


class RemoteError(RvzError):
    """An error that happened on a peer and was reported to us over the wire."""

    def __init__(self, message: str, peer: str = "", code: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code


class NodeClosed(RvzError):
    """The node was closed; used as the cause of operations that were still pending."""
