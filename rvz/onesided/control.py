"""The control messages a channel takes from its peer: ONESIDED frames on its connection.

They arrive in order with the connection's REQUEST/CANCEL/DATA/ERROR frames, which are
watched on the way for requests that end.  Each operation goes to the part of the channel
that owns what it changes; a malformed one fails the channel.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .. import _impl
from .._fast.format import FIELD, KIND, REQUEST_ID
from ..errors import TransportError

if TYPE_CHECKING:
    from .destinations import Destinations
    from .engine import Channel
    from .grants import SlotGrants
    from .outbound import Outbound

_codec = _impl.codec


class ControlIn:
    """Where one channel's control messages go, by operation."""

    def __init__(self, channel: Channel, out: Outbound, grants: SlotGrants,
                 destinations: Destinations) -> None:
        self._channel = channel
        self._out = out
        self._destinations = destinations
        self._ops: dict[str, Callable[[dict[str, Any]], None]] = {
            # to the producer: the consumer's memory, offered and taken back
            "slots": out.on_slots, "revoke": out.on_revoke, "unmap": out.on_unmap,
            "dest": out.on_dest, "later": out.on_later,
            # to the consumer: the producer's wants and answers to ours
            "want": grants.on_want, "rel": grants.on_rel,
            "meta": destinations.on_meta, "gone": destinations.on_gone,
        }

    def on_frames(self, events: list[tuple[Any, ...]]) -> list[tuple[Any, ...]]:
        """Take our ONESIDED frames out of a batch; watch CANCEL, answers and ERROR on the way."""
        channel = self._channel
        out = []
        for event in events:
            kind = event[KIND]
            if kind == _codec.ONESIDED:
                if channel.failed is None and not channel.closed:
                    try:
                        self._on_control(event[FIELD])
                    except (TransportError, ValueError, TypeError, KeyError, IndexError) as exc:
                        channel.fail(self._error(exc))
                continue
            if kind == _codec.CANCEL:
                request_id = event[FIELD]
                if request_id in channel.conn.parked:
                    # Parked, it was not answered and never will be.
                    self._out.cancelled(request_id)
            elif kind == _codec.DATA and event[REQUEST_ID]:
                # An answer that came over TCP (its key's values go that way): the
                # destination offered for it will not be written.
                self._destinations.forget(event[REQUEST_ID])
            elif kind == _codec.ERROR:
                try:
                    request_id = int(event[FIELD].get("req", 0))
                except (TypeError, ValueError, AttributeError):
                    request_id = 0
                self._destinations.forget(request_id)
            out.append(event)
        return out

    def _on_control(self, f: dict[str, Any]) -> None:
        op = f["op"]
        handler = self._ops.get(op) if isinstance(op, str) else None
        if handler is None:
            raise ValueError(f"unknown operation {op!r}")
        handler(f)

    def _error(self, exc: BaseException) -> BaseException:
        """Why a control message from the peer fails this channel.  A memory region it offered
        that is gone from its process (closed as it resets this very connection: the offer
        was still on the way) makes that a reset, after which the pair connects again and
        nothing is lost; anything else is the peer's fault."""
        channel = self._channel
        if isinstance(exc.__cause__, FileNotFoundError):
            return ConnectionResetError(f"{channel.name}: {channel.peer_name} closed a memory "
                                        f"region it offered: {exc}")
        return TransportError(f"{channel.name}: bad control message from {channel.peer_name}: "
                              f"{exc!r}")
