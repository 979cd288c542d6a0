"""A recv's ``into=`` buffer as the destination of its request, over a provider that can
register private memory (verbs; shm cannot: a peer reaches only memory it can map).

When a Recv-Driven recv with a C-contiguous ``into=`` buffer sends its REQUEST, the consumer
tells the producer first that the destination follows (``later``), then, as the recv waits,
registers the buffer (remote write access) and offers it (``dest`` with a trailer ``t``).
The producer writes the payload into the buffer, then the value's number with the
immediate into a small trailer block of ours; RC queue pairs place writes in order, so the
trailer's completion says the payload is whole.  The buffer's registration goes as soon as
its request is answered (any way), gone, or its channel closes.  (The engine sends the
REQUEST before the recv waits, and knows nothing of its buffer: so the buffer follows the
REQUEST, and ``later`` makes the producer hold the answer for it.)

Cancellation (``fence``): the recv stops waiting (cancelled, timed out, its step aborted,
or it took another value) while the producer may be writing.  The buffer is deregistered
at once, before the caller runs again: the device writes nothing into memory whose
registration is gone, so the buffer is the caller's again.  Then the completions already
there are taken (a write that finished before the fence is copied out of the buffer at
once, for the next recv), and the request gets an ordinary destination instead.  A write
the producer posted before that offer reaches it fails on the producer (a remote access
error, which breaks an RC queue pair): its channel resets, the pair connects again and the
producer sends every unacknowledged value again, so the value is neither lost nor written
into the buffer.  The trailer block stays reserved under its immediate until the request is
settled, so a late trailer write lands in nothing else; its completion (payload placed
before the fence, completion seen after it) resets the channel the same way, since the
buffer no longer holds what was written.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .pool import address_of
from .provider import Region

if TYPE_CHECKING:
    from .destinations import Destinations


class BufferOffer:
    """One recv's buffer, registered as the destination of request ``request_id``."""

    __slots__ = ("target", "region", "request_id", "_destinations")

    def __init__(self, destinations: Destinations, target: Any, region: Region,
                 request_id: int) -> None:
        self._destinations = destinations
        self.target = target          # the recv's rvz._fast.into.Target
        self.region: Region | None = region
        self.request_id = request_id
        target.offer = self

    def fence(self) -> None:
        """The recv stopped waiting: nothing may be written into its buffer any more."""
        self._destinations.fence(self)

    def release(self) -> None:
        """Deregister the buffer; it is no destination any more."""
        if self.target.offer is self:
            self.target.offer = None
        region = self.region
        if region is not None:
            self.region = None
            self._destinations.provider.deregister(region)


def register_buffer(provider: Any, target: Any) -> Region:
    """The memory of ``target``'s buffer, registered with remote write access."""
    view = target.dest
    return provider.register_memory(address_of(view), view.nbytes)

