"""The consumer's Recv-Driven side: the destinations it offers for its requests.

Before a REQUEST leaves, the consumer offers a destination for the dtype and shape it saw
last on the key (``dest``).  The producer's ``meta`` says they differ (or that nothing was
known): the consumer offers another (a re-ask).  The record of a request (``asks``) goes with
its destination once the request is answered, one way or another, or gone.

A request sent by a recv with an ``into=`` buffer, over a provider that can register private
memory, says that its destination follows (``later``); the recv then offers its buffer
(``claim``, see buffers.py), or, if it does not (its buffer is strided, does not fit, or the
request was ``recv_many``'s), the request gets an ordinary destination at the end of the
loop iteration (``_settle``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..errors import TransportError
from .buffers import BufferOffer, register_buffer
from .layout import SEQ_TRAILER, check_meta, fits_inline
from .regions import BUFFER, DEST, FENCED, PeerRegions, Target

if TYPE_CHECKING:
    from .engine import Channel


class Destinations:
    """The requests of one channel's consumer and the destinations offered for them."""

    def __init__(self, channel: Channel, regions: PeerRegions) -> None:
        self._channel = channel
        self._regions = regions
        self._engine = channel.engine
        self.provider = self._engine.provider
        # The recvs with into= buffers of the node (None for a connection made by hand).
        self._landings = (getattr(getattr(channel.conn, "core", None), "into", None)
                          if self.provider.registers_private else None)
        self._dests: dict[int, int] = {}               # request id -> imm of its destination
        self.asks: dict[int, tuple[int, str]] = {}     # request id -> (step, key)
        # Requests whose destination follows: request id -> (step, key, code, shape, nbytes).
        self._later: dict[int, tuple[Any, ...]] = {}
        self._settling = False
        self.offers: dict[int, BufferOffer] = {}       # request id -> the buffer offered
        self._fenced: dict[int, int] = {}              # request id -> imm of a fenced trailer
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
            if self._landings is not None and self._landings.asking():
                self._later[request_id] = (step, key, code, shape, nbytes)
                channel._control({"op": "later", "r": request_id})
                if not self._settling:
                    self._settling = True
                    self._engine.loop.call_soon(self._settle)
                return
            self._offer(step, request_id, key, code, shape, nbytes, False)
        except TransportError as exc:
            channel.fail(exc)

    def claim(self, target: Any) -> bool:
        """A recv with an into= buffer waits: offer its buffer for the request it sent
        (``later``), if the buffer takes the value we expect; True if it had sent one."""
        later = self._later
        for request_id in reversed(later):
            if later[request_id][:2] == (target.step, target.key):
                break
        else:
            return False
        step, key, code, shape, nbytes = later.pop(request_id)
        channel = self._channel
        if channel.failed is not None or channel.closed:
            return True
        try:
            if not self._offer_buffer(step, request_id, key, code, shape, nbytes, target, True):
                self._offer(step, request_id, key, code, shape, nbytes, True)
        except TransportError as exc:
            channel.fail(exc)
        return True

    def _settle(self) -> None:
        """The end of the iteration a request said ``later`` in: the requests no recv
        offered its buffer for get an ordinary destination."""
        self._settling = False
        if self._landings is not None:
            self._landings.made = None   # a hint no recv took: recv_many's, or a failed recv's
        later, self._later = self._later, {}
        channel = self._channel
        if channel.failed is not None or channel.closed:
            return
        try:
            for request_id, (step, key, code, shape, nbytes) in later.items():
                if request_id in self.asks:
                    self._offer(step, request_id, key, code, shape, nbytes, True)
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

    def _offer_buffer(self, step: int, request_id: int, key: str, code: int,
                      shape: tuple[int, ...], nbytes: int, target: Any, again: bool) -> bool:
        """Offer ``target``'s buffer (registered now) for the value; False if it does not
        take it, or cannot be registered (then an ordinary destination does)."""
        if not target.fits(code, shape, nbytes):
            return False
        try:
            region = register_buffer(self.provider, target)
        except TransportError:   # past the memlock limit, say: the value is copied in
            return False
        offer = BufferOffer(self, target, region, request_id)
        regions = self._regions
        try:
            block = regions.dest_arena.alloc(SEQ_TRAILER.size)   # the answer's number
        except BaseException:
            offer.release()
            raise
        imm = regions.add(Target(BUFFER, block, key, step, request_id, code, shape, nbytes))
        self._dests[request_id] = imm
        self.offers[request_id] = offer
        self._channel._control({"op": "dest", "r": request_id, "k": key, "i": imm,
                                "a": region.addr, "rk": region.rkey, "c": code,
                                "s": list(shape), "n": nbytes, "m": regions.describe([block]),
                                "re": again, "t": [block.addr, block.region.rkey]})
        return True

    def fence(self, offer: BufferOffer) -> None:
        """``offer``'s recv stopped waiting: deregister its buffer now (nothing is written
        into it from here on), take the completions already there, and give the request an
        ordinary destination (see buffers.py)."""
        request_id = offer.request_id
        offer.release()
        if self.offers.get(request_id) is not offer:
            return
        del self.offers[request_id]
        channel = self._channel
        if channel.failed is not None or channel.closed or self._engine.loop.is_closed():
            return
        self._engine.drain(channel.ep.cq)   # a write that completed before the fence
        imm = self._dests.get(request_id, 0)
        target = self._regions.targets.get(imm)
        if target is None or target.kind != BUFFER:
            return   # answered meanwhile (delivered as a copy), or settled
        del self._dests[request_id]
        target.kind = FENCED   # its trailer block stays reserved until the request settles
        self._fenced[request_id] = imm
        if request_id in self.asks and channel.failed is None and not channel.closed:
            try:
                self._offer(target.step, request_id, target.key, target.code, target.shape,
                            target.nbytes, True)
            except TransportError as exc:
                channel.fail(exc)

    def on_meta(self, f: dict[str, Any]) -> None:
        """The producer's value differs from the destination offered: offer another (the
        recv's buffer again if it takes this value)."""
        request_id = int(f["r"])
        if request_id not in self.asks:
            return   # not a request of ours (or one already answered or cancelled)
        offer = self.offers.get(request_id)
        target = offer.target if offer is not None else None
        self._drop(request_id)
        key = str(f["k"])
        step = int(f["st"])
        code = int(f["c"])
        shape = tuple(int(d) for d in f["s"])
        nbytes = int(f["n"])
        check_meta(key, code, shape, nbytes, self._engine.node.max_payload)
        self._engine.remember(key, code, shape, nbytes)
        self.asks[request_id] = (step, key)
        if target is None or not self._offer_buffer(step, request_id, key, code, shape, nbytes,
                                                    target, True):
            self._offer(step, request_id, key, code, shape, nbytes, True)

    def on_gone(self, f: dict[str, Any]) -> None:
        """The producer will not answer the request (it was cancelled while parked)."""
        self.forget(int(f["r"]))

    def written(self, request_id: int) -> BufferOffer | None:
        """The answer to ``request_id`` was written into its destination (out of the
        targets): the request is over.  The buffer offered for it, if it was one (now
        deregistered)."""
        self._dests.pop(request_id, None)
        self.asks.pop(request_id, None)
        self._free_fenced(request_id)
        offer = self.offers.pop(request_id, None)
        if offer is not None:
            offer.release()
        return offer

    def forget(self, request_id: int) -> None:
        """Our request ``request_id`` is over (answered another way, failed or gone): its
        destination and our record of it go."""
        self._drop(request_id)
        self.asks.pop(request_id, None)
        self._later.pop(request_id, None)

    def _drop(self, request_id: int) -> None:
        imm = self._dests.pop(request_id, None)
        if imm is not None:
            target = self._regions.targets.pop(imm, None)
            if target is not None:
                self._regions.dest_arena.free(target.block)
        offer = self.offers.pop(request_id, None)
        if offer is not None:
            offer.release()
        self._free_fenced(request_id)

    def _free_fenced(self, request_id: int) -> None:
        """The request of a fenced buffer settled: its old trailer is written no more (a
        request is answered once)."""
        imm = self._fenced.pop(request_id, 0)
        targets = self._regions.targets
        target = targets.get(imm)
        if target is not None and target.kind == FENCED and target.request_id == request_id:
            del targets[imm]
            self._regions.dest_arena.free(target.block)

    def close(self) -> None:
        for offer in self.offers.values():
            offer.release()
        self.offers.clear()
        self._fenced.clear()
        self._later.clear()
        self._dests.clear()
        self.asks.clear()
