"""The receive pool: a block is used again only once no array (or view) refers to it."""

from __future__ import annotations

import gc

import numpy as np

from rvz import _impl

from .conftest import in_loop, key, pair

RecvPool = _impl.recvpool.RecvPool
MiB = 1 << 20


def on(block: bytearray, dtype: str = "<f8") -> np.ndarray:
    return np.frombuffer(block, np.dtype(dtype))


# The tests keep ids, not the blocks: a reference held here would (rightly) count as a use.

@in_loop
def test_a_block_in_use_is_never_handed_out_again() -> None:
    pool = RecvPool(8 * MiB)
    arr = on(pool.take(MiB))
    first = id(arr.base.obj if isinstance(arr.base, memoryview) else arr.base)
    other = pool.take(MiB)
    assert other is not None and id(other) != first
    second = id(other)
    keep_second = on(other)
    del other
    view = arr[10:20]
    del arr
    gc.collect()
    third = pool.take(MiB)                  # the view still holds the first block
    assert third is not None and id(third) not in (first, second)
    del third
    del view
    gc.collect()
    assert id(pool.take(MiB)) == first      # all its arrays gone: free again
    assert id(pool.take(MiB)) == first      # (taking does not keep it: nothing holds it)
    assert keep_second.size and pool.held == 3 * MiB


@in_loop
def test_the_limit_is_kept_and_free_blocks_of_other_sizes_make_room() -> None:
    pool = RecvPool(2 * MiB)
    held = [on(pool.take(MiB)), on(pool.take(MiB))]
    assert pool.take(MiB) is None            # full, and nothing is free
    assert pool.take(2 * MiB) is None
    del held
    gc.collect()
    big = pool.take(2 * MiB)                 # both free 1 MiB blocks are evicted for it
    assert big is not None and len(big) == 2 * MiB
    assert pool.held == 2 * MiB


@in_loop
def test_pooled_arrays_decode_correctly_and_independently() -> None:
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


def test_held_arrays_are_not_overwritten_by_later_messages(run, cluster) -> None:  # type: ignore[no-untyped-def]
    async def main() -> None:
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

    run(main(), timeout=20)
