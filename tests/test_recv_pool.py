"""The receive pool: a block is used again only once no array (or view) refers to it, the
pool learns how many blocks a consumer keeps alive, and it stays within its limit."""

from __future__ import annotations

import collections
import ctypes
import gc
import mmap
import sys
import weakref
from typing import Any

import numpy as np
import pytest

import rvz
from rvz import _impl

from .conftest import FAST, eventually, key, pair
from .hostile import Hostile, data_header, key_text

RecvPool = _impl.recvpool.RecvPool
size_class = _impl.recvpool.size_class
MiB = 1 << 20


def codec_u8() -> int:
    return int(_impl.codec.dtype_code(np.dtype(np.uint8)))


def fill(memory: object, nbytes: int, value: int) -> np.ndarray:
    """What the decoder does with a block: an array of exactly ``nbytes`` on it, written."""
    arr = np.frombuffer(memory, np.uint8, nbytes)  # type: ignore[call-overload]
    arr[:] = value
    return arr


def stream(pool: Any, sizes: list[int], hold: int = 1,
           check: bool = True) -> collections.deque[tuple[int, np.ndarray]]:
    """A consumer that keeps its newest ``hold`` arrays while the next arrives."""
    kept: collections.deque[tuple[int, np.ndarray]] = collections.deque()
    for i, nbytes in enumerate(sizes):
        memory = pool.take(nbytes)
        assert memory is not None and len(memory) == nbytes
        kept.append((i % 251, fill(memory, nbytes, i % 251)))
        del memory
        if len(kept) > hold:
            kept.popleft()
        if check:
            for value, arr in kept:  # writing the new one changed none still held
                assert arr[0] == value and arr[-1] == value
        assert pool.held <= pool.limit
        pool.maintain()
    return kept


async def test_a_block_in_use_is_never_handed_out_again() -> None:
    pool = RecvPool(8 * MiB)
    arr = fill(pool.take(MiB), MiB, 1)
    other = fill(pool.take(MiB), MiB, 2)
    assert not np.shares_memory(arr, other)
    view = arr[10:20]
    del arr
    gc.collect()
    third = fill(pool.take(MiB), MiB, 3)         # the view still holds the first block
    assert not np.shares_memory(third, view) and not np.shares_memory(third, other)
    assert (view == 1).all() and (other == 2).all()
    del third
    gc.collect()
    again = fill(pool.take(MiB), MiB, 4)          # the third block is free again: reused
    assert pool.held == 3 * MiB and pool.fresh == 3 and pool.reused == 1
    assert (view == 1).all() and (other == 2).all() and (again == 4).all()


async def test_a_consumer_holding_its_previous_array_reuses_two_blocks() -> None:
    pool = RecvPool(256 * MiB)
    stream(pool, [4 * MiB] * 50)
    assert pool.fresh + pool.prepared <= 3          # learned: two alive at once, one spare
    assert pool.reused >= 47 and pool.missed == 0 and pool.released == 0
    assert pool.held <= 3 * 4 * MiB


async def test_a_deeper_hold_learns_more_blocks_and_stays_correct() -> None:
    pool = RecvPool(256 * MiB)
    stream(pool, [MiB] * 60, hold=3)                # three held while the fourth arrives
    assert 4 <= pool.fresh + pool.prepared <= 5
    assert pool.reused >= 55 and pool.missed == 0


async def test_maintain_prepares_the_next_block_off_the_data_path() -> None:
    pool = RecvPool(64 * MiB)
    assert pool.maintain() is False                 # nothing taken yet: nothing to prepare
    first = fill(pool.take(4 * MiB), 4 * MiB, 1)
    assert pool.fresh == 1
    assert pool.maintain() is True                  # the consumer holds it: a second is made
    assert pool.prepared == 1 and pool.held == 8 * MiB
    assert pool.maintain() is False                 # once per take, not once per call
    second = fill(pool.take(4 * MiB), 4 * MiB, 2)   # served by the prepared block
    assert pool.fresh == 1 and pool.reused == 1
    assert (first == 1).all() and not np.shares_memory(first, second)
    del first
    gc.collect()
    assert pool.maintain() is False                 # a free block is ready: nothing to do
    assert pool.prepared == 1


async def test_maintain_stays_within_the_limit() -> None:
    pool = RecvPool(4 * MiB)
    held = fill(pool.take(4 * MiB), 4 * MiB, 1)
    assert pool.maintain() is False and pool.held == 4 * MiB and pool.prepared == 0
    assert pool.take(4 * MiB) is None and pool.missed == 1
    assert (held == 1).all()


async def test_the_limit_is_kept_and_free_blocks_of_other_sizes_make_room() -> None:
    pool = RecvPool(2 * MiB)
    held = [fill(pool.take(MiB), MiB, 1), fill(pool.take(MiB), MiB, 2)]
    assert pool.take(MiB) is None                   # full, and nothing is free
    assert pool.take(2 * MiB) is None
    assert pool.held == 2 * MiB and pool.released == 0
    del held
    gc.collect()
    big = pool.take(2 * MiB)                        # both free 1 MiB blocks are evicted for it
    assert big is not None and len(big) == 2 * MiB
    assert pool.held == 2 * MiB and pool.released == 2


async def test_a_request_that_cannot_fit_evicts_nothing() -> None:
    pool = RecvPool(2 * MiB)
    busy = fill(pool.take(MiB), MiB, 1)
    spare = fill(pool.take(MiB), MiB, 2)
    del spare
    gc.collect()
    assert pool.take(2 * MiB) is None               # freeing the spare would not be enough
    assert pool.released == 0 and pool.stats()[MiB][:2] == (2, 1)
    assert (busy == 1).all()


async def test_sizes_that_vary_share_blocks_across_a_class_boundary() -> None:
    rng = np.random.default_rng(3)
    sizes = [int(MiB + d) // 8 * 8 for d in rng.integers(-MiB // 20, MiB // 20, 80)]
    assert len({size_class(n) for n in sizes}) == 2  # 1 MiB sits on a boundary
    pool = RecvPool(64 * MiB)
    stream(pool, sizes[:20])
    before = pool.fresh + pool.prepared
    stream(pool, sizes[20:])
    assert pool.fresh + pool.prepared - before <= 1  # warmed up: (almost) nothing new
    assert pool.held <= 4 * size_class(max(sizes))


async def test_a_size_just_below_a_recent_one_gets_a_block_that_serves_both() -> None:
    pool = RecvPool(64 * MiB)
    upper = fill(pool.take(MiB + MiB // 10), MiB + MiB // 10, 1)
    lower = fill(pool.take(MiB - 4096), MiB - 4096, 2)   # a class below, asked for just after
    assert {size for size, (blocks, _, _) in pool.stats().items() if blocks} == {
        size_class(MiB + MiB // 10)}
    del upper
    gc.collect()
    again = fill(pool.take(MiB - 4096), MiB - 4096, 3)  # the larger free block serves it
    assert pool.fresh == 2 and pool.reused == 1
    assert (lower == 2).all() and (again == 3).all()


async def test_the_pool_adapts_when_sizes_change_under_its_limit() -> None:
    pool = RecvPool(32 * MiB)
    stream(pool, [8 * MiB] * 40)                    # about three blocks of 8 MiB
    assert pool.stats()[8 * MiB][0] >= 2
    stream(pool, [6 * MiB] * 40)                    # 8 MiB blocks give way to 6 MiB ones
    assert pool.held <= 32 * MiB
    fresh = pool.fresh
    kept = stream(pool, [6 * MiB] * 20)
    assert pool.fresh == fresh and pool.missed == 0  # settled: every take is served
    assert len(kept) == 1


async def test_sizes_nobody_asks_for_any_more_are_released() -> None:
    pool = RecvPool(1 << 30, window=4, stale=16)
    stream(pool, [8 * MiB] * 12)
    assert 8 * MiB in pool.stats()
    stream(pool, [2 * MiB] * 40)
    stats = pool.stats()
    assert 8 * MiB not in stats or stats[8 * MiB][0] == 0
    assert pool.held <= 3 * 2 * MiB and pool.released >= 2


async def test_a_burst_of_held_arrays_decays_slowly() -> None:
    pool = RecvPool(1 << 30, window=4)
    stream(pool, [MiB] * 20, hold=5)                # six alive at once
    assert pool.held >= 6 * MiB
    stream(pool, [MiB] * 40, hold=1)                # then two: the surplus is kept a while
    assert pool.held >= 5 * MiB and pool.released <= 1
    stream(pool, [MiB] * 200, hold=1)               # and let go, a block per DECAY windows
    assert pool.held <= 3 * MiB


async def test_a_queue_that_fills_and_drains_again_keeps_its_blocks() -> None:
    """A Send-Driven consumer's queue fills to the push window and drains, over and over:
    its blocks are not released in the lulls and allocated (faulted in) again."""
    pool = RecvPool(1 << 30, window=4)
    for _ in range(10):
        stream(pool, [MiB] * 12, hold=5)            # six alive at once
        stream(pool, [MiB] * 12, hold=0)            # one
    assert pool.released == 0
    assert pool.fresh + pool.prepared <= 7          # six, and a spare


async def test_any_pattern_keeps_held_arrays_intact_and_the_limit() -> None:
    rng = np.random.default_rng(11)
    pool = RecvPool(6 * MiB, window=8, stale=64)
    live: list[tuple[int, np.ndarray]] = []
    for i in range(400):
        nbytes = int(rng.choice([64 << 10, 100 << 10, 256 << 10, MiB, 3 * MiB // 2]))
        memory = pool.take(nbytes)
        if memory is None:                           # over the limit: the decoder allocates
            arr = np.full(nbytes, i % 251, np.uint8)
        else:
            assert len(memory) == nbytes
            arr = fill(memory, nbytes, i % 251)
            del memory
        live.append((i % 251, arr))
        while live and rng.random() < 0.5:           # drop some, in any order
            live.pop(int(rng.integers(len(live))))
        for value, kept in live:
            assert kept[0] == value and kept[-1] == value and kept[len(kept) // 2] == value
        assert pool.held <= pool.limit
        if rng.random() < 0.7:
            pool.maintain()
    assert pool.reused > 100


async def test_size_classes_round_up_by_less_than_an_eighth() -> None:
    for nbytes in (1, 4095, 4096, 65536, 65537, 100_000, MiB - 1, MiB, MiB + 1, 64 * MiB + 8):
        size = size_class(nbytes)
        assert size >= nbytes and size % 4096 == 0
        assert size == 4096 or size - nbytes < size // 8 + 1
    assert size_class(64 * MiB) == 64 * MiB and size_class(64 * MiB + 1) == 72 * MiB


async def test_pooled_arrays_decode_correctly_and_independently() -> None:
    codec = _impl.codec
    pool = RecvPool(64 * MiB)
    dec = codec.Decoder(pool=pool)
    payloads = [np.full((256, 512), i, np.float64) for i in range(3)]  # 1 MiB each: direct
    stream = codec.encode_hello({"v": 1})
    for p in payloads:
        stream += codec.encode_data(0, 0, b"k", codec.dtype_code(p.dtype), p.shape, p.nbytes) + p.tobytes()
    got = []
    pos = 0
    while pos < len(stream):
        buf = dec.get_buffer(-1)
        n = min(len(buf), len(stream) - pos)
        buf[:n] = stream[pos:pos + n]
        pos += n
        got += [e[4] for e in dec.buffer_updated(n) if e[0] == codec.DATA]
    assert len(got) == 3
    for i, arr in enumerate(got):            # all alive at once: three distinct blocks
        assert arr.shape == (256, 512) and arr.flags.writeable
        assert (arr == i).all()
    assert not np.shares_memory(got[0], got[1]) and not np.shares_memory(got[1], got[2])


@pytest.mark.loop_timeout(20)
async def test_held_arrays_are_not_overwritten_by_later_messages(cluster) -> None:  # type: ignore[no-untyped-def]
    async with pair(cluster, "send") as (w, p):
        kept = []
        for i in range(6):
            await w.send(key(), np.full(MiB // 8, i, np.float64))
            arr = await p.recv(key(), timeout=10)
            if i % 2 == 0:
                kept.append((i, arr))        # held: its block must stay untouched
            else:
                del arr                      # dropped: its block may serve the next one
        for i, arr in kept:
            assert (arr == i).all()
        assert p._recv_pool is not None and p._recv_pool.held > 0


# -- memory a DATA header reserves --------------------------------------------------------------


def resident(memory: Any) -> int:
    """Bytes of ``memory`` (a buffer) whose pages are resident now, as mincore(2) sees them."""
    arr = np.frombuffer(memory, np.uint8)
    page = mmap.PAGESIZE
    start = arr.ctypes.data - arr.ctypes.data % page
    length = arr.ctypes.data + arr.nbytes - start
    vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    if libc.mincore(start, length, vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return int((np.frombuffer(vec, np.uint8) & 1).sum()) * page


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
async def test_a_new_block_is_mapped_untouched_and_released_to_the_system() -> None:
    pool = RecvPool(256 * MiB)
    memory = pool.take(200 * MiB)
    assert memory is not None and len(memory) == 200 * MiB
    assert resident(memory) <= MiB                # nothing wrote it: nothing is resident
    np.frombuffer(memory, np.uint8, 4 * MiB)[:] = 1  # what a payload's first bytes do
    assert 4 * MiB <= resident(memory) <= 5 * MiB
    block = weakref.ref(memory.obj)
    pool.release(memory)                          # its payload will never come
    assert pool.held == 0 and pool.released == 1
    assert not any(blocks for blocks, _, _ in pool.stats().values())
    del memory
    gc.collect()
    assert block() is None                        # unmapped: no reference is left
    assert pool.take(200 * MiB) is not None and pool.fresh == 2   # a new block, not that one


async def test_a_payload_cut_short_gives_its_block_back_when_the_decoder_closes() -> None:
    codec = _impl.codec
    pool = RecvPool(256 * MiB)
    dec = codec.Decoder(pool=pool)
    header = codec.encode_data(0, 0, b"k", codec.dtype_code(np.dtype(np.uint8)), (200 * MiB,),
                               200 * MiB)
    data = codec.encode_hello({"v": 1}) + header + bytes(4096)
    buf = dec.get_buffer(-1)
    buf[:len(data)] = data
    del buf
    assert dec.buffer_updated(len(data))[0][0] == codec.HELLO
    assert dec.payload_left() == 200 * MiB - 4096 and pool.held >= 200 * MiB
    dec.close()                                   # the connection closed
    assert dec.payload_left() == 0 and pool.held == 0 and pool.released == 1
    pool.release(memoryview(bytearray(8)))        # memory not from the pool: left alone
    assert pool.held == 0 and pool.released == 1


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="mincore(2) as Linux has it")
@pytest.mark.loop_timeout(30)
async def test_a_data_header_alone_makes_nothing_resident_and_its_block_goes_with_the_connection(
        cluster: rvz.ClusterSpec) -> None:
    async with rvz.Node(cluster, "ps", 0, "send", **FAST) as p:
        h = await Hostile.connect(cluster.address("ps", 0))
        try:
            await h.hello("worker", 0, 7)
            k = key_text("big", ("worker", 0), ("ps", 0))
            await h.send(data_header(0, 0, k, codec_u8(), (200 * MiB,), 200 * MiB) + bytes(4096))
            conns = p._conns  # the node's side of the hostile connection
            await eventually(lambda: any(c.decoder.payload_left() for c in conns),
                             "the header's payload awaited")
            conn = next(c for c in conns if c.decoder.payload_left())
            view = conn.decoder.get_buffer(-1)    # what is left of the payload, on its block
            assert p._recv_pool.held >= 200 * MiB
            assert resident(view.obj) <= MiB     # the header reserved memory, made none resident
            block = weakref.ref(view.obj)
            del view, conn
        finally:
            h.close()
        pool = p._recv_pool
        await eventually(lambda: pool.held == 0, "the block released when the connection closed")
        gc.collect()
        assert block() is None and not any(blocks for blocks, _, _ in pool.stats().values())
