"""rvz: keyed tensor exchange for asyncio, following TensorFlow's Rendezvous.

Public API::

    rvz.Key, rvz.Rendezvous, rvz.ClusterSpec, rvz.Node, rvz.run, rvz.implementation()

and the errors under ``rvz.RvzError``.
"""

from __future__ import annotations

from ._impl import implementation
from ._impl import keys as _keys
from .cluster import ClusterSpec
from .errors import (
    Aborted,
    KeyFormatError,
    NodeClosed,
    PeerLost,
    ProtocolError,
    RemoteError,
    RvzError,
    TransportError,
    WrongEndpoint,
)
from .node import Node, Step
from .rendezvous import Rendezvous
from .runner import loop_name, new_event_loop, run

Key = _keys.Key
parse_device = _keys.parse_device

__version__ = "0.1.0"

__all__ = [
    "Aborted", "ClusterSpec", "Key", "KeyFormatError", "Node", "NodeClosed", "PeerLost",
    "ProtocolError", "RemoteError", "Rendezvous", "RvzError", "Step", "TransportError",
    "WrongEndpoint", "implementation", "loop_name", "new_event_loop", "parse_device", "run",
]
