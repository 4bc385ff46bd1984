"""MLA blocks in the paged KV cache (tiny DeepSeek-V3, every layer dense): what a block
holds and weighs, and the engine features that move blocks around — preemption, speculative
decoding (n-gram and a draft model: draft slots written then trimmed), and a KV transfer between two
engines of latent blocks, refused between mismatched layouts."""

from __future__ import annotations

import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.cluster.messages import KVLayout
from kiln.cluster.transfer import TransferError, check_payload, make_header
from kiln.cluster.worker_kv import engine_layout
from kiln.config_speculative import SpeculativeConfig
from kiln.engine.block_hash import hash_prompt_blocks
from kiln.models.deepseek_v3 import DeepseekV3Arch, kv_footprint
from kiln.models.layers.kv_layout import CacheHolds
from kiln.runner import kv_io
from tests.parity.test_mla_parity import PROMPTS, make_tiny_deepseek

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LAYERS, LATENT, ROPE = 2, 32, 8  # the tiny checkpoint's num_hidden_layers, kv_lora_rank, rope


@pytest.fixture(scope="module")
def mla_path(tmp_path_factory):
    return make_tiny_deepseek(tmp_path_factory.mktemp("deepseek"), "yarn")


@pytest.fixture(scope="module")
def prompts(mla_path):
    tok = LLM(mla_path, dtype="float32", num_threads=1, kv_cache_memory=1 << 20).get_tokenizer()
    # repeated text: the n-gram proposer finds its drafts in the prompt
    return [tok.encode(p * 3) for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(mla_path, prompts):
    """Greedy outputs of an unconstrained engine (no prefix caching, big budget)."""
    llm = LLM(mla_path, dtype="float32", enable_prefix_caching=False, num_threads=1)
    return token_ids(llm.generate(as_inputs(prompts), GREEDY))


def as_inputs(prompts: list[list[int]]) -> list[dict]:
    return [{"prompt_token_ids": ids} for ids in prompts]


def token_ids(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_a_block_holds_the_latent_and_rope_key_only(mla_path):
    llm = LLM(mla_path, dtype="float32", num_threads=1, block_size=16, kv_cache_memory=1 << 20)
    runner = llm.engine.runner
    spec = runner.kv_spec
    assert spec.holds is CacheHolds.MLA_LATENT
    # per token and layer: R + P fp32 numbers, no K and V per head
    assert spec.bytes_per_block == LAYERS * 16 * (LATENT + ROPE) * 4 == 5120
    assert llm.engine.kv.pool.num_blocks == (1 << 20) // 5120
    assert [tuple(t.shape[1:]) for t in runner.kv_caches[0]] == [(1, LATENT + ROPE)]
    assert len(runner.kv_caches) == LAYERS


def test_kv_footprint_against_plain_attention_at_deepseek_v3_scale():
    """DeepSeek-V3's shape: 61 layers of R 512 + P 64 in bf16, against K (128 + 64) and V
    (128) for each of 128 heads."""
    cfg = {"hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
           "vocab_size": 129280, "num_attention_heads": 128, "q_lora_rank": 1536,
           "kv_lora_rank": 512, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
           "v_head_dim": 128, "first_k_dense_replace": 3, "n_routed_experts": 256,
           "num_experts_per_tok": 8, "moe_intermediate_size": 2048, "n_group": 8,
           "topk_group": 4, "n_shared_experts": 1, "routed_scaling_factor": 2.5}
    footprint = kv_footprint(DeepseekV3Arch.from_hf(cfg, "DeepseekV3ForCausalLM"),
                             torch.bfloat16)
    assert footprint.mla_bytes_per_token == 61 * 576 * 2 == 70_272
    assert footprint.plain_bytes_per_token == 61 * 128 * 320 * 2 == 4_997_120
    assert round(footprint.ratio, 1) == 71.1


def test_preemption_under_tiny_kv_budget_gives_same_tokens(mla_path, prompts, reference):
    block = LLM(mla_path, dtype="float32", num_threads=1,
                kv_cache_memory=1 << 20).engine.runner.kv_spec.bytes_per_block
    # 8 blocks of 16 tokens: the prompts need 3 to 6 each, so they cannot all run together
    small = LLM(mla_path, dtype="float32", num_threads=1, enable_prefix_caching=False,
                kv_cache_memory=8 * block)
    assert token_ids(small.generate(as_inputs(prompts), GREEDY)) == reference
    assert small.engine.scheduler.num_preemptions > 0
    assert small.engine.kv.stats().used_blocks == 0


@pytest.mark.parametrize("speculator", ["ngram", "draft"])
def test_speculative_decoding_is_token_identical(mla_path, prompts, reference, speculator):
    """n-gram drafts, and a DeepSeek draft model (the checkpoint drafting for itself: its
    own latent cache, written and trimmed like the target's)."""
    llm = LLM(mla_path, dtype="float32", num_threads=1,
              speculator="ngram" if speculator == "ngram" else mla_path,
              speculative_config=SpeculativeConfig(adaptive=False, ngram_first=False,
                                                   tree_width=1))
    assert token_ids(llm.generate(as_inputs(prompts), GREEDY)) == reference
    assert llm.engine.speculator.stats.num_draft_tokens > 0


def test_latent_blocks_transfer_between_engines_and_continue_alike(mla_path, prompts,
                                                                   reference):
    """The prefill engine's cached prompt blocks, exported as bytes and checked as a KV
    transfer payload, imported into a second engine: it serves them as prefix-cache hits
    and continues with the same tokens."""
    prefill, decode = (LLM(mla_path, dtype="float32", num_threads=1, block_size=16)
                       for _ in range(2))
    prompt = prompts[2]
    assert token_ids(prefill.generate(as_inputs([prompt]), GREEDY)) == reference[2:]
    hashes = hash_prompt_blocks(prompt, 16)
    held = prefill.engine.kv.hold_cached(hashes)
    assert len(held) == len(hashes) == len(prompt) // 16
    data = kv_io.export_blocks(prefill.engine.runner.kv_caches, [b.block_id for b in held], 16)
    layout = engine_layout(prefill.engine)
    assert layout == engine_layout(decode.engine) and layout.holds == "mla_latent"
    raw = kv_io.as_bytes(data)
    header = make_header("h", hashes, layout, raw)
    received = check_payload(header, bytes(raw), layout, hashes)
    assert tuple(received.shape) == (LAYERS, 1, len(hashes) * 16, 1, LATENT + ROPE)
    prefill.engine.kv.release_held(held)

    kv = decode.engine.kv
    blocks = kv.allocate_for_import(len(hashes))
    kv_io.import_blocks(decode.engine.runner.kv_caches, [b.block_id for b in blocks], 16,
                        received)
    kv.register_imported(blocks, hashes, None, prompt[:len(hashes) * 16])
    out = decode.generate(as_inputs([prompt]), GREEDY)[0]
    assert out.num_cached_tokens == len(hashes) * 16
    assert out.outputs[0].token_ids == reference[2]


def test_a_transfer_between_mla_and_key_value_layouts_is_refused(mla_path):
    llm = LLM(mla_path, dtype="float32", num_threads=1, block_size=16, kv_cache_memory=1 << 20)
    mla = engine_layout(llm.engine)
    # the same bytes per block read as K and V of one 20-wide head: another layout
    key_value = KVLayout(mla.dtype, mla.num_layers, mla.block_size, 1, (LATENT + ROPE) // 2)
    hashes = [b"x" * 16]
    raw = kv_io.as_bytes(kv_io.export_blocks(llm.engine.runner.kv_caches, [1], 16))
    with pytest.raises(TransferError, match="does not match"):
        check_payload(make_header("h", hashes, key_value, raw), bytes(raw), mla, hashes)
