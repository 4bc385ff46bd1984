"""KV transfer without processes: block bytes out and in, the payload gate, and the cache
manager's hold / import bookkeeping."""

from __future__ import annotations

import pytest
import torch

from kiln.cluster.messages import KVLayout
from kiln.cluster.transfer import TransferError, check_payload, make_header
from kiln.config import CacheConfig
from kiln.engine.block_hash import hash_prompt_blocks
from kiln.engine.kv_manager import KVCacheManager
from kiln.engine.prefix_cache import BlockStored
from kiln.runner import kv_io

BS, HEADS, DIM, LAYERS = 4, 2, 3, 2
LAYOUT = KVLayout("float32", LAYERS, BS, HEADS, DIM)


def caches(num_blocks: int, seed: int | None = None) -> kv_io.KVCaches:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (num_blocks * BS, HEADS, DIM)
    if seed is None:
        return [(torch.zeros(shape), torch.zeros(shape)) for _ in range(LAYERS)]
    return [(torch.randn(shape, generator=gen), torch.randn(shape, generator=gen))
            for _ in range(LAYERS)]


def slots(block: int) -> slice:
    return slice(block * BS, (block + 1) * BS)


def test_blocks_round_trip_through_raw_bytes():
    src, dst = caches(5, seed=1), caches(5)
    data = kv_io.export_blocks(src, [3, 1], BS)
    assert data.shape == (LAYERS, 2, 2 * BS, HEADS, DIM)
    raw = kv_io.as_bytes(data)
    back = kv_io.from_bytes(raw, torch.float32, data.shape)
    kv_io.import_blocks(dst, [0, 4], BS, back)
    for (sk, sv), (dk, dv) in zip(src, dst, strict=True):
        assert torch.equal(dk[slots(0)], sk[slots(3)]) and torch.equal(dv[slots(4)], sv[slots(1)])
        assert not dk[slots(2)].any()  # untouched blocks stay as they were


def test_bf16_bytes_keep_their_bits():
    src = [(t.bfloat16(), u.bfloat16()) for t, u in caches(2, seed=2)]
    data = kv_io.export_blocks(src, [1], BS)
    back = kv_io.from_bytes(kv_io.as_bytes(data), torch.bfloat16, data.shape)
    assert torch.equal(back, data)


def payload_and_header(hashes: list[bytes]):
    data = kv_io.export_blocks(caches(4, seed=3), list(range(len(hashes))), BS)
    raw = kv_io.as_bytes(data)
    return make_header("h", hashes, LAYOUT, raw), bytes(raw), data


def test_a_good_payload_passes_the_gate():
    hashes = [b"x" * 16, b"y" * 16]
    header, raw, data = payload_and_header(hashes)
    assert torch.equal(check_payload(header, raw, LAYOUT, hashes), data)


@pytest.mark.parametrize("damage, message", [
    (lambda raw: raw[:-1], "payload has"),
    (lambda raw: raw[:10] + bytes([raw[10] ^ 1]) + raw[11:], "checksum"),
    (lambda raw: b"", "payload has"),
])
def test_a_short_or_corrupted_payload_is_rejected(damage, message):
    hashes = [b"x" * 16, b"y" * 16]
    header, raw, _ = payload_and_header(hashes)
    with pytest.raises(TransferError, match=message):
        check_payload(header, damage(raw), LAYOUT, hashes)


def test_other_blocks_or_another_layout_are_rejected():
    hashes = [b"x" * 16, b"y" * 16]
    header, raw, _ = payload_and_header(hashes)
    with pytest.raises(TransferError, match="not the blocks"):
        check_payload(header, raw, LAYOUT, [b"x" * 16, b"z" * 16])
    with pytest.raises(TransferError, match="layout"):
        check_payload(header, raw, KVLayout("bfloat16", LAYERS, BS, HEADS, DIM), hashes)
    lying = make_header("h", hashes, LAYOUT, memoryview(raw[:-4]))  # header agrees, sizes not
    with pytest.raises(TransferError, match="header says"):
        check_payload(lying, raw[:-4], LAYOUT, hashes)


def manager(num_blocks: int = 8) -> KVCacheManager:
    return KVCacheManager(CacheConfig(block_size=BS), num_blocks, emit_events=True)


def test_imported_blocks_become_cached_and_free_under_their_hashes():
    kv = manager()
    tokens = list(range(10))
    hashes = hash_prompt_blocks(tokens, BS)  # 2 full blocks
    blocks = kv.allocate_for_import(2)
    assert [b.block_id for b in blocks] == [0, 1] and kv.pool.num_free_blocks == 6
    kv.register_imported(blocks, hashes, None, tokens[:8])
    assert kv.pool.num_free_blocks == 8 and kv.num_cached_prefix(hashes) == 2
    assert kv.pool.free_block_ids()[-2:] == [1, 0]  # tail first: the prefix is evicted last
    events = kv.prefix_cache.take_events()
    assert events == [BlockStored([hashes[0]], None, [0, 1, 2, 3], BS),
                      BlockStored([hashes[1]], hashes[0], [4, 5, 6, 7], BS)]


def test_held_blocks_survive_until_released():
    kv = manager(num_blocks=3)
    hashes = hash_prompt_blocks(list(range(8)), BS)
    kv.register_imported(kv.allocate_for_import(2), hashes, None, list(range(8)))
    held = kv.hold_cached(hashes)
    assert [b.ref_cnt for b in held] == [1, 1] and kv.pool.num_free_blocks == 1
    assert kv.allocate_for_import(2) is None  # held blocks are not handed out
    kv.release_held(held)
    assert kv.pool.num_free_blocks == 3 and kv.num_cached_prefix(hashes) == 2


def test_hold_stops_at_the_first_missing_block():
    kv = manager()
    hashes = hash_prompt_blocks(list(range(12)), BS)
    kv.register_imported(kv.allocate_for_import(1), hashes[:1], None, list(range(4)))
    assert [b.block_id for b in kv.hold_cached(hashes)] == [0]
