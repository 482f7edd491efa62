"""The cache groups of four real models, built from (the cache-shaping fields of) their published
Hugging Face config.json files, validated by the library, with per-block and per-state sizes
checked against figures worked out by hand from those fields."""

from __future__ import annotations

import pytest

from kvtd import models

# meta-llama/Llama-3.1-8B config.json
LLAMA_31_8B = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
               "head_dim": 128}
# openai/gpt-oss-20b config.json: layer_types alternates, sliding first
GPT_OSS_20B = {"num_hidden_layers": 24, "num_key_value_heads": 8, "head_dim": 64, "sliding_window": 128,
               "layer_types": ["sliding_attention", "full_attention"] * 12}
# Qwen/Qwen3-Next-80B-A3B-Instruct config.json (layer_types derived from full_attention_interval)
QWEN3_NEXT_80B = {"num_hidden_layers": 48, "num_key_value_heads": 2, "head_dim": 256, "full_attention_interval": 4,
                  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
                  "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}
# deepseek-ai/DeepSeek-V3.2-Exp config.json
DEEPSEEK_V32 = {"num_hidden_layers": 61, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "index_head_dim": 128,
                "index_n_heads": 64, "index_topk": 2048}


def test_plain_gqa_is_one_group_of_128_kib_per_token():
    for tp in (1, 2, 8):
        g = models.plain_attention(LLAMA_31_8B, tp)
        g.check()
        (block, _), = g.sizes()
        assert block == 131072 * 16 // tp  # 32 layers x K,V x 8 heads x 128 x 2 bytes, 16 tokens


def test_an_alternating_sliding_window_model_is_two_groups_of_twelve_layers():
    g = models.sliding_and_full(GPT_OSS_20B, 2)
    g.check()
    assert [x.kind for x in g.groups] == ["sliding_window", "full_attention"]
    assert g.groups[0].layers == list(range(0, 24, 2)) and g.groups[1].layers == list(range(1, 24, 2))
    assert g.groups[0].window_tokens == 128
    assert [b for b, _ in g.sizes()] == [12 * 2 * 4 * 16 * 64 * 2] * 2
    # A 20-page prefix (rows: the sliding group, then full attention): full attention needs all
    # 20 pages, the window only the last 8 (128 / 16 tokens).
    present = [[False] * 12 + [True] * 8, [True] * 20]
    assert g.loadable_prefix(present)[0] == 20
    present[0][13] = False
    assert g.loadable_prefix(present)[0] == 0


def test_linear_attention_states_beside_every_fourth_layer():
    g = models.linear_and_full(QWEN3_NEXT_80B, 1)
    g.check()
    state, full = g.groups
    assert state.kind == "state" and full.kind == "full_attention"
    assert full.layers == list(range(3, 48, 4)) and len(state.layers) == 36
    conv = (2 * 16 * 128 + 32 * 128) * 3 * 2      # 8192 channels x (kernel - 1) in bf16
    recurrent = 32 * 128 * 128 * 4                # value heads x key dim x value dim in fp32
    assert g.sizes()[0][0] == 36 * (conv + recurrent)  # one request's state, every linear layer
    assert g.sizes()[1][0] == 12 * 2 * 2 * 16 * 256 * 2
    g4 = models.linear_and_full(QWEN3_NEXT_80B, 4)
    assert g4.sizes()[0][0] * 4 == g.sizes()[0][0]
    with pytest.raises(ValueError, match="do not split over TP 3|neither divides"):
        models.linear_and_full(QWEN3_NEXT_80B, 3)


def test_mla_with_an_indexer_is_the_same_on_every_rank():
    g1, g8 = models.mla_with_indexer(DEEPSEEK_V32, 1), models.mla_with_indexer(DEEPSEEK_V32, 8)
    g1.check()
    g8.check()
    assert [x.kind for x in g1.groups] == ["mla_latent", "indexer"]
    assert g1.sizes() == g8.sizes()
    assert g1.sizes()[0][0] == 61 * 64 * 576 * 2   # 576-wide latent (512 + 64 rope) in bf16
    assert g1.sizes()[1][0] == 61 * 64 * 132       # 128 fp8 values + one fp32 scale per token
    # The indexer needs every page as the latent does (sglang: ALL_PAGES for DSA).
    assert g1.loadable_prefix([[True] * 6, [True] * 3 + [False] * 3])[0] == 3
