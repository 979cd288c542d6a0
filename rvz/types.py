"""The type aliases of rvz's public API, for annotations in user code and in rvz itself.

``Value`` is what ``recv`` returns (``SendValue`` what ``send`` takes), ``KeyLike`` what names a key,
``Mode`` and ``TransportName`` the accepted spellings of ``mode=`` and ``transport=``,
``LoopName`` those of ``rvz.run(loop=...)``.  A typo in a literal fails type checking.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal, TypeAlias

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

SendValue: TypeAlias = Value | np.generic
"""What ``send`` accepts: a ``Value``, or a numpy scalar (``arr.sum()``), sent as a 0-d array."""

KeyLike: TypeAlias = Key | str
"""Anything ``send``/``recv`` accept as a key: a ``rvz.Key`` or its string form."""

Mode: TypeAlias = Literal["recv", "send"]
"""``"recv"`` (Recv-Driven, TensorFlow's default) or ``"send"`` (Send-Driven)."""

TransportName: TypeAlias = Literal["tcp", "shm", "verbs", "auto"]
"""The transports of ``Node(transport=...)``."""

LoopName: TypeAlias = Literal["auto", "uvloop", "asyncio"]
"""The event loops of ``rvz.run(loop=...)`` and ``rvz.new_event_loop``."""

__all__ = ["KeyLike", "LoopName", "Mode", "SendValue", "TransportName", "Value"]
