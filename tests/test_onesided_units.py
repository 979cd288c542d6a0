"""Units of rvz.onesided: the pool, the transport decision, the shm provider's checks and
the ONESIDED frame (on the compiled and the pure-Python codec alike)."""

from __future__ import annotations

import asyncio
import gc
import itertools
import os

import numpy as np
import pytest

import rvz
from rvz import _impl
from rvz.onesided import decide
from rvz.onesided.engine import Options
from rvz.onesided.layout import MSG_HDR
from rvz.onesided.pool import PAGE, Pool, align
from rvz.onesided.provider import FAILED, RECV_MSG, RECV_WRITE, Region
from rvz.onesided.regions import DEST, SLOT, PeerRegions, Target
from rvz.onesided.shm import RECORD, ShmProvider

HOST = {"boot": "b-1", "uid": 1000, "pidns": 42}


@pytest.mark.loop_timeout(10)
async def test_pool_carves_coalesces_and_frees_with_the_arrays() -> None:
    provider = ShmProvider(asyncio.get_running_loop())
    pool = Pool(provider, chunk_size=1 << 20, limit=4 << 20)
    a, b, c = pool.alloc(1000), pool.alloc(5000), pool.alloc(100)
    assert a.size == 1024 and b.offset == 1024 and c.offset == 1024 + 5056
    pool.free(b)
    d = pool.alloc(4000)                       # first fit reuses b's hole
    assert d.offset == b.offset
    pool.free(a)
    pool.free(d)
    pool.free(c)
    assert pool.chunks[0].free == [[0, 1 << 20]]  # everything merged back
    big = pool.alloc(3 << 20)                  # too big for a chunk: its own, rounded up
    assert pool.stats()["chunks"] == 2 and big.region.length == 3 << 20
    with pytest.raises(rvz.TransportError, match="limit of 4194304 bytes"):
        pool.alloc(2 << 20)
    pool.free(big)
    arr = pool.array(pool.alloc(800), np.dtype(np.float64), (10, 10))
    arr[:] = 7
    view = arr[2:4]
    del arr
    gc.collect()
    assert pool.reclaim() == 0 and view.sum() == 140   # a view keeps the block alive
    del view
    assert pool.reclaim() == 1 and pool.in_use == 0
    keep = pool.array(pool.alloc(80), np.dtype(np.int64), (10,))
    pool.close()                               # a live array keeps its chunk mapped
    keep[:] = 1
    assert keep.sum() == 10 and pool.stats()["chunks"] == 1
    del keep
    assert pool.stats()["chunks"] == 0


class Ledger:
    """A provider that registers nothing, only counts: for the pool's arithmetic."""

    name = "ledger"

    def __init__(self) -> None:
        self.rkeys = itertools.count(1)

    def register(self, length: int) -> Region:
        rkey = next(self.rkeys)
        return Region(rkey, rkey, rkey << 40, length, memoryview(b""))

    def deregister(self, region: Region) -> None:
        pass


@pytest.mark.parametrize("nbytes", [1 << 20, (1 << 20) + 64, 4096 + 64, (3 << 20) + 5, 64 << 20])
async def test_a_budgeted_pool_registers_within_its_limit_and_capacity_says_how_much(
        nbytes: int) -> None:
    budget = 64 << 20
    pool = Pool(Ledger(), 1 << 20, budget, PAGE)  # a peer's slots: chunks rounded to a page
    room = pool.capacity(nbytes, 1 << 30)
    blocks = [pool.alloc(nbytes) for _ in range(room)]   # as many as it said, not one more
    assert pool.registered <= budget and pool.capacity(nbytes, 1 << 30) == 0
    with pytest.raises(rvz.TransportError, match="limit"):
        pool.alloc(nbytes)
    assert room >= budget // align(nbytes, PAGE)         # a page at most lost per slot
    for block in blocks:
        pool.free(block)
    assert pool.capacity(nbytes, 1 << 30) == room and pool.empty_chunks() == len(pool.chunks)
    pool.trim()
    assert pool.registered == 0


async def test_peer_regions_number_targets_and_describe_each_region_once() -> None:
    regions = PeerRegions(Ledger(), 4 << 20, 4 << 20)
    slot, dest = regions.arena.alloc(4096), regions.dest_arena.alloc(100)
    imms = [regions.add(Target(SLOT, slot, "a")), regions.add(Target(DEST, dest, "b", request_id=7))]
    assert imms == [1, 2] and regions.targets[2].request_id == 7
    rkeys = [slot.region.rkey, dest.region.rkey]
    assert [d["rk"] for d in regions.describe([slot, dest])] == rkeys
    assert regions.describe([slot, dest]) == []   # the peer maps each region once
    for imm in imms:
        regions.free(regions.targets.pop(imm))
    assert regions.trim_idle() == []               # carved from since the last look: kept
    assert sorted(regions.trim_idle()) == rkeys    # idle and empty: unregistered
    assert regions.arena.registered == 0
    regions.close()


@pytest.mark.loop_timeout(10)
async def test_pool_lookup_finds_registered_memory() -> None:
    pool = Pool(ShmProvider(asyncio.get_running_loop()), chunk_size=1 << 20)
    block = pool.alloc(4096)
    assert pool.lookup(block.addr, 4096) is block.region
    assert pool.lookup(block.addr + (1 << 20), 1) is None
    assert pool.lookup(1, 1) is None
    pool.free(block)
    pool.close()


@pytest.mark.loop_timeout(10)
async def test_decide_agrees_on_both_sides() -> None:
    shm = {"want": "shm", "host": HOST, "ep": {"shm": {}}}
    auto_both = {"want": "auto", "host": HOST, "ep": {"shm": {}, "verbs": {}}}
    far = {"want": "auto", "host": {**HOST, "boot": "other"}, "ep": {"shm": {}, "verbs": {}}}
    # (local want, local offers, remote field) -> transport, the same seen from both ends
    assert decide("auto", {"shm", "verbs"}, HOST, auto_both)[0] == "shm"
    assert decide("auto", {"shm", "verbs"}, HOST, far)[0] == "verbs"
    assert decide("auto", {"shm"}, HOST, far)[0] == "tcp"
    assert "another host" in decide("auto", {"shm"}, HOST, far)[1]
    assert decide("auto", {"shm"}, HOST, None) == ("tcp", "auto: the peer runs tcp")
    assert decide("shm", {"shm"}, HOST, auto_both)[0] == "shm"
    assert decide("auto", {"shm", "verbs"}, HOST, shm)[0] == "shm"
    assert decide("verbs", {"verbs"}, {}, far)[0] == "verbs"
    errors = [
        (("shm", {"shm"}, HOST, None), "the peer offers no shm: it runs transport='tcp'"),
        (("shm", {"shm"}, HOST, far), "not on this host"),
        (("auto", {"shm"}, HOST, {**shm, "host": {**HOST, "uid": 0}}), "not on this host"),
        (("verbs", {"verbs"}, {}, {"want": "auto", "ep": {"shm": {}}, "no": {"verbs": "no RDMA device"}}),
         "offers no verbs: no RDMA device"),
        (("shm", {"shm"}, HOST, {"want": "verbs", "ep": {"verbs": {}}}),
         "asks for transport 'shm' and the peer for 'verbs'"),
        (("auto", {"shm"}, HOST, {"want": "verbs", "ep": {"verbs": {}}}), "this node has none"),
    ]
    for args, message in errors:
        with pytest.raises(rvz.TransportError, match=message):
            decide(*args, unavailable={"verbs": "no pyverbs"})


@pytest.mark.loop_timeout(10)
async def test_options_are_checked() -> None:
    assert Options({"cqs": 3}).cqs == 3
    with pytest.raises(ValueError, match="unknown onesided option"):
        Options({"cq": 3})
    with pytest.raises(ValueError, match="positive"):
        Options({"max_slots": 0})


@pytest.mark.loop_timeout(10)
async def test_shm_completion_records_are_parsed_whole() -> None:
    provider = ShmProvider(asyncio.get_running_loop())
    cq = provider.create_cq()
    try:
        msg = b"m" * 40
        data = (RECORD.pack(24, 1, 0, 0, 5, 77, 4096)
                + RECORD.pack(24 + len(msg), 2, 0, 0, 5, 0, len(msg)) + msg)
        os.write(cq.wfd, data[:30])            # a record cut in two by the pipe
        assert cq.poll() == [(RECV_WRITE, 5, 77, 4096)]
        os.write(cq.wfd, data[30:])
        assert cq.poll() == [(RECV_MSG, 5, msg)]
        os.write(cq.wfd, RECORD.pack(3, 1, 0, 0, 5, 0, 0))
        assert cq.poll()[0][0] == FAILED       # a corrupt stream fails, never crashes
    finally:
        cq.close()


@pytest.mark.loop_timeout(10)
async def test_shm_endpoint_refuses_bad_peers_and_bad_writes() -> None:
    provider = ShmProvider(asyncio.get_running_loop())
    cq = provider.create_cq()
    ep = provider.create_endpoint(cq, 1)
    try:
        with pytest.raises(rvz.TransportError, match="cannot open the completion pipe of process"):
            ep.connect({"pid": 2 ** 22 + 12345, "cq": 3, "cqino": 1, "ep": 1})
        with pytest.raises(rvz.TransportError, match="is not its completion pipe"):
            ep.connect({**ep.info(), "cqino": 1})
        ep.connect(ep.info())                  # to ourselves: fine
        region = provider.register(1 << 20)
        with pytest.raises(rvz.TransportError, match="not its memory region"):
            ep.add_region({**region.describe(), "ino": 1})
        ep.add_region(region.describe())
        src = memoryview(b"x" * 100)
        with pytest.raises(rvz.TransportError, match="outside region"):
            ep.write([(src, 0, 0)], region.addr + (1 << 20) - 50, region.rkey, 1, 1)
        with pytest.raises(rvz.TransportError, match="unknown region"):
            ep.write([(src, 0, 0)], region.addr, 999, 1, 1)
        ep.write([(src, 0, 0)], region.addr + 8, region.rkey, 9, 1)
        assert bytes(region.view[8:108]) == b"x" * 100
        await asyncio.sleep(0)
        assert cq.poll() == [(RECV_WRITE, 1, 9, 100)]
        with pytest.raises(ValueError, match="exceeds"):
            ep.send([b"y" * 5000], 2)
        ep.close()
        provider.deregister(region)
    finally:
        cq.close()


@pytest.mark.loop_timeout(10)
async def test_onesided_frame_round_trips_on_both_codecs() -> None:
    for variant in ("python", "compiled") if rvz.implementation() == "compiled" else ("python",):
        codec = _impl.load(variant).codec
        fields = {"op": "slots", "k": "key", "s": [[1, 2 ** 47, 3, 4096]], "m": []}
        data = codec.encode_hello({"v": codec.VERSION}) + codec.encode_onesided(fields)
        decoder = codec.Decoder()
        buf = decoder.get_buffer(len(data))
        buf[:len(data)] = data
        events = decoder.buffer_updated(len(data))
        assert events[1] == (codec.ONESIDED, fields) and codec.FRAME_NAMES[codec.ONESIDED] == "ONESIDED"


@pytest.mark.loop_timeout(10)
async def test_inline_message_header_is_fixed() -> None:
    assert MSG_HDR.size == 40 and RECORD.size == 24
