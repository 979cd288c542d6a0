"""rvz: keyed tensor exchange for asyncio, following TensorFlow's Rendezvous.

Public API::

    rvz.Key, rvz.Rendezvous, rvz.ClusterSpec, rvz.Node, rvz.Step, rvz.run,
    rvz.BlockingNode, rvz.BlockingStep (the same calls for synchronous code),
    rvz.implementation(), the type aliases of ``rvz.types`` (Value, Mode, TransportName, ...)

and the errors under ``rvz.RvzError``.  rvz logs to the ``rvz`` logger (and its children);
it has a ``NullHandler``, so nothing is printed unless the application configures logging.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from . import types as types  # rvz.types: the type aliases
from ._impl import implementation
from .blocking import BlockingNode, BlockingStep
from .cluster import ClusterSpec
from .errors import (
    Aborted,
    AuthError,
    BufferMismatch,
    ConfigError,
    KeyFormatError,
    NodeClosed,
    PeerLost,
    ProtocolError,
    RemoteError,
    RvzError,
    TransportError,
    UnknownTask,
    WrongEndpoint,
)
from .node import Node, Step
from .rendezvous import Rendezvous
from .runner import loop_name, new_event_loop, run
from .types import KeyLike, LoopName, Mode, SendValue, TransportName, Value

# Type checkers read the pure-Python source of Key (the compiled module has the same API);
# at run time these are whichever variant rvz._impl loaded.
if TYPE_CHECKING:
    from ._fast.keys import Key, parse_device
else:
    from ._impl import keys as _keys

    Key = _keys.Key
    parse_device = _keys.parse_device

# A library adds no handler of its own but this one: without it, Python's last-resort
# handler would print rvz's warnings to stderr when the application configured nothing.
logging.getLogger("rvz").addHandler(logging.NullHandler())

__version__ = "0.2.0.dev0"

__all__ = [
    "Aborted", "AuthError", "BlockingNode", "BlockingStep", "BufferMismatch", "ClusterSpec",
    "ConfigError", "Key",
    "KeyFormatError", "KeyLike",
    "LoopName", "Mode", "Node", "NodeClosed", "PeerLost", "ProtocolError", "RemoteError",
    "Rendezvous", "RvzError", "SendValue", "Step", "TransportError", "TransportName",
    "UnknownTask", "Value", "WrongEndpoint", "implementation", "loop_name", "new_event_loop",
    "parse_device", "run",
]
