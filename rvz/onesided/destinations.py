"""The consumer's Recv-Driven side: the destinations it offers for its requests.

Before a REQUEST leaves, the consumer offers a destination for the dtype and shape it saw
last on the key (``dest``).  The producer's ``meta`` says they differ (or that nothing was
known): the consumer offers another (a re-ask).  The record of a request (``asks``) goes with
its destination once the request is answered, one way or another, or gone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TransportError
from .layout import SEQ_TRAILER, check_meta, fits_inline
from .regions import DEST, PeerRegions, Target

if TYPE_CHECKING:
    from .engine import Channel


class Destinations:
    """The requests of one channel's consumer and the destinations offered for them."""

    def __init__(self, channel: Channel, regions: PeerRegions) -> None:
        self._channel = channel
        self._regions = regions
        self._engine = channel.engine
        self._dests: dict[int, int] = {}               # request id -> imm of its destination
        self.asks: dict[int, tuple[int, str]] = {}     # request id -> (step, key)
        # Destinations lent to the application as arrays are freed on the loop when those die.
        regions.dest_arena.watch(self._engine.loop)

    def on_request(self, step: int, request_id: int, key: str) -> None:
        """Before REQUEST ``request_id`` leaves: offer a destination if we know the shape."""
        channel = self._channel
        if channel.failed is not None or channel.closed:
            return
        self.asks[request_id] = (step, key)
        meta = self._engine.meta.get(key)
        if meta is None:
            return
        code, shape, nbytes = meta
        if fits_inline(key, shape, nbytes, channel.inline_limit):
            return
        try:
            self._offer(step, request_id, key, code, shape, nbytes, False)
        except TransportError as exc:
            channel.fail(exc)

    def _offer(self, step: int, request_id: int, key: str, code: int, shape: tuple[int, ...],
               nbytes: int, again: bool) -> None:
        regions = self._regions
        block = regions.dest_arena.alloc(nbytes + SEQ_TRAILER.size)  # the answer's number follows
        imm = regions.add(Target(DEST, block, key, step, request_id, code, shape, nbytes))
        self._dests[request_id] = imm
        self._channel._control({"op": "dest", "r": request_id, "k": key, "i": imm,
                                "a": block.addr, "rk": block.region.rkey, "c": code,
                                "s": list(shape), "n": nbytes, "m": regions.describe([block]),
                                "re": again})

    def on_meta(self, f: dict[str, Any]) -> None:
        """The producer's value differs from the destination offered: offer another."""
        request_id = int(f["r"])
        if request_id not in self.asks:
            return   # not a request of ours (or one already answered or cancelled)
        self._drop(request_id)
        key = str(f["k"])
        step = int(f["st"])
        code = int(f["c"])
        shape = tuple(int(d) for d in f["s"])
        nbytes = int(f["n"])
        check_meta(key, code, shape, nbytes, self._engine.node.max_payload)
        self._engine.remember(key, code, shape, nbytes)
        self.asks[request_id] = (step, key)
        self._offer(step, request_id, key, code, shape, nbytes, True)

    def on_gone(self, f: dict[str, Any]) -> None:
        """The producer will not answer the request (it was cancelled while parked)."""
        self.forget(int(f["r"]))

    def written(self, request_id: int) -> None:
        """The answer to ``request_id`` was written into its destination (out of the targets)."""
        self._dests.pop(request_id, None)
        self.asks.pop(request_id, None)

    def forget(self, request_id: int) -> None:
        """Our request ``request_id`` is over (answered another way, failed or gone): its
        destination and our record of it go."""
        self._drop(request_id)
        self.asks.pop(request_id, None)

    def _drop(self, request_id: int) -> None:
        imm = self._dests.pop(request_id, None)
        if imm is not None:
            target = self._regions.targets.pop(imm, None)
            if target is not None:
                self._regions.dest_arena.free(target.block)

    def close(self) -> None:
        self._dests.clear()
        self.asks.clear()
