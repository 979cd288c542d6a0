"""The exception hierarchy: every error rvz raises for a reason of its own is an ``RvzError``
(an expired ``timeout=`` raises the built-in ``TimeoutError``).

Messages name the key and the peer involved.  Derived failures (an abort, a lost peer)
keep the original failure as ``__cause__`` so the root cause is never hidden behind a
bare "cancelled".

Errors about what the caller passed in also derive from the built-in class a Python
programmer would catch for it: ``ConfigError`` (and so ``KeyFormatError``) is a
``ValueError``, and ``UnknownTask`` (a job or task the cluster lacks) is a ``ConfigError`` and
a ``KeyError``.
"""

from __future__ import annotations


class RvzError(Exception):
    """Base class of every rvz error."""


class ConfigError(RvzError, ValueError):
    """A bad cluster, job, task, option or key, refused when it is constructed.

    Also raised by ``rvz.ClusterSpec.from_tf_config`` and ``rvz.cluster.from_env`` for a
    malformed ``TF_CONFIG`` or ``RVZ_CLUSTER``/``RVZ_JOB``/``RVZ_TASK``.
    """


class UnknownTask(ConfigError, KeyError):
    """The cluster has no such job, or the job no such task.

    A ``KeyError`` too, because it is a failed look-up in the cluster (code written against
    rvz 0.1, which raised ``KeyError`` here, keeps working).
    """

    # KeyError's own __str__ would print the message in quotes.
    __str__ = Exception.__str__


class KeyFormatError(ConfigError):
    """A rendezvous key string or device name is malformed (a ``ConfigError``, so a
    ``ValueError`` too)."""


class WrongEndpoint(RvzError):
    """A key's source (for send) or destination (for recv) is not this node."""


class Aborted(RvzError):
    """The rendezvous scope (a table, a step, a node) was aborted; ``__cause__`` says why."""


class NodeClosed(Aborted):
    """The node was closed or aborted before the operation could finish.

    An ``Aborted``: code that handles aborts handles a closed node too.  After
    ``node.abort(exc)``, ``__cause__`` is ``exc``.
    """


class PeerLost(RvzError):
    """The peer an operation depends on closed, stopped answering, or cannot be reached."""


class BufferMismatch(RvzError, ValueError):
    """A recv's ``into=`` buffer cannot hold the value it got (its dtype, shape or byte
    size differ; the message names both).  The value stays first in its key's queue."""


class ProtocolError(RvzError):
    """A peer sent bytes that are not a valid rvz frame; that connection is closed."""


class TransportError(RvzError):
    """A transport failed: a bind, a failed completion, a refused registration."""


class AuthError(RvzError):
    """A peer could not prove it holds the cluster's secret, or one side has a secret and
    the other none (names the peer, never the secret); or a peer refused this process
    because another process runs as the same task (it replaced this one's incarnation)."""


class RemoteError(RvzError):
    """An error that happened on a peer and was reported to us over the wire.

    ``peer`` names the node that reported it and ``code`` is its error class, when known.
    """

    def __init__(self, message: str, peer: str = "", code: str = "") -> None:
        super().__init__(message)
        self.peer = peer
        self.code = code
