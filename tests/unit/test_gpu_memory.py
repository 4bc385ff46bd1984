"""Sizing the KV pool from a GPU's memory (kiln.runner.device_memory): exact block counts
from numbers, the one error when nothing fits, and which rule num_kv_blocks applies."""

from __future__ import annotations

import pytest
import torch

from kiln.config import CacheConfig
from kiln.runner.device_memory import DeviceMemory, activation_reserve, gpu_kv_blocks
from kiln.runner.kv_cache import KVCacheSpec, num_kv_blocks

GiB, MiB = 1 << 30, 1 << 20


def card(free_gib: float, weights_gib: float = 2.5, activations_gib: float = 1.0,
         total_gib: float = 80) -> DeviceMemory:
    return DeviceMemory(free=int(free_gib * GiB), total=int(total_gib * GiB),
                        weights=int(weights_gib * GiB), activations=int(activations_gib * GiB))


def test_blocks_from_the_utilization_less_what_is_in_use_and_the_reserve():
    # 0.9 x 80 = 72 GiB; 4 GiB in use (weights, context); 1 GiB reserved: 67 GiB of 1 MiB blocks
    assert gpu_kv_blocks(card(free_gib=76), 0.9, MiB) == 67 * 1024
    # other processes holding memory count as in use: 20 GiB more leaves 47 GiB
    assert gpu_kv_blocks(card(free_gib=56), 0.9, MiB) == 47 * 1024
    assert gpu_kv_blocks(card(free_gib=76), 1.0, 3 * MiB) == (75 * 1024) // 3
    # a partial block does not count
    assert gpu_kv_blocks(card(free_gib=76), 0.9, 1000 * MiB) == (67 * 1024) // 1000


def test_nothing_left_names_the_numbers():
    with pytest.raises(ValueError) as err:
        gpu_kv_blocks(card(free_gib=76), 0.05, MiB)  # 4 GiB allowed, 4 GiB in use
    message = str(err.value)
    assert "gpu_memory_utilization 0.05 of 80.00 GiB" in message
    assert "4.00 GiB in use already (weights 2.50 GiB)" in message
    assert "1.00 GiB kept for activations" in message and "kv_cache_memory" in message


def test_activation_reserve():
    # per token 2 * (4*8 + 2*24 + 3*16) + 8*8 = 320 bytes; twice over 10 tokens = 6400;
    # logits 3 * 4 bytes * 2 rows * 100 = 2400
    assert activation_reserve(hidden=8, intermediate=16, qkv_width=24, vocab=100, tokens=10,
                              logits_rows=2, elem_bytes=2) == 6400 + 2400


def test_num_kv_blocks_rules():
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=torch.float32,
                       block_size=16)
    per_block = spec.bytes_per_block  # 2 * 2 * 16 * 2 * 8 * 4 = 4096
    memory = DeviceMemory(free=60 * MiB, total=100 * MiB, weights=10 * MiB, activations=MiB)
    # given bytes win on any device
    given = CacheConfig(kv_cache_memory=40 * per_block)
    assert num_kv_blocks(spec, given, 64, 4, memory) == 40
    # on a GPU: 90 MiB - 40 MiB in use - 1 MiB = 49 MiB
    assert num_kv_blocks(spec, CacheConfig(), 64, 4, memory) == 49 * MiB // per_block
    assert num_kv_blocks(spec, CacheConfig(gpu_memory_utilization=0.5), 64, 4,
                         memory) == 9 * MiB // per_block
    # on the CPU: max_model_len x max_num_seqs tokens (4 blocks each), capped
    assert num_kv_blocks(spec, CacheConfig(), 64, 4) == 16
    assert num_kv_blocks(spec, CacheConfig(max_kv_cache_memory=10 * per_block), 64, 4) == 10


def test_a_draft_pool_mirrors_the_target_within_what_is_free():
    from kiln.runner.device_memory import draft_kv_blocks

    # 6 GiB free after the target's pool and the draft's weights, 1 GiB kept: 5 GiB of blocks
    assert draft_kv_blocks(card(free_gib=6), wanted=100, bytes_per_block=MiB) == 100
    assert draft_kv_blocks(card(free_gib=6), wanted=10 ** 6, bytes_per_block=MiB) == 5 * 1024
    with pytest.raises(ValueError) as err:
        draft_kv_blocks(card(free_gib=1.5, weights_gib=0.25), wanted=10, bytes_per_block=GiB)
    message = str(err.value)
    assert "1.50 GiB free after the target's pool and the draft's weights (0.25 GiB)" in message
    assert "lower gpu_memory_utilization or give draft_kv_cache_memory" in message
