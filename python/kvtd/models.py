"""The cache groups of real models, built from their published Hugging Face `config.json` the way
the engines read it, at a tensor-parallel size. Each builder names the config fields it reads;
the numbers in the tests are those configs' published values.

A group's tensors are per block (or state slot) of one rank, heads outermost, as kvtd stores them
(kvtd/proto/cache_groups.h). Attention K/V: [kv_heads / tp, block_tokens, head_dim] each. MLA: one
latent [block_tokens, kv_lora_rank + qk_rope_head_dim], the same on every rank. Gated DeltaNet
(linear attention) state per request: the convolution state [conv_dim / tp, conv_kernel - 1] and
the recurrent state [value_heads / tp, key_head_dim, value_head_dim] in float32, as vLLM's
MambaStateShapeCalculator.gated_delta_net_state_shape gives them (conv_dim = 2 x key_heads x
key_head_dim + value_heads x value_head_dim).
"""

from __future__ import annotations

from typing import Dict, List, Sequence

from .cache_groups import CacheGroup, CacheGroups

BF16 = 2
FP32 = 4


def _split(heads: int, tp: int, what: str) -> int:
    if heads % tp != 0 and tp % heads != 0:
        raise ValueError(f"{what} {heads} and TP {tp}: neither divides the other")
    return max(1, heads // tp)


def _layers(layer_types: Sequence[str], kind: str) -> List[int]:
    return [i for i, t in enumerate(layer_types) if t == kind]


def _kv_group(kind, layers, kv_heads, head_dim, block_tokens, device_blocks, host_blocks, window=0, dtype_bytes=BF16):
    kv = (dtype_bytes, (kv_heads, block_tokens, head_dim))
    return CacheGroup(kind, layers, [kv, kv], device_blocks, host_blocks, block_tokens, window)


def plain_attention(config: Dict, tp: int, block_tokens=16, device_blocks=1024, host_blocks=2048) -> CacheGroups:
    """A plain GQA/MHA model (Llama, Qwen2/3 dense): num_hidden_layers, num_key_value_heads,
    head_dim (else hidden_size / num_attention_heads)."""
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    heads = _split(config["num_key_value_heads"], tp, "num_key_value_heads")
    layers = list(range(config["num_hidden_layers"]))
    return CacheGroups(tp, block_tokens, [_kv_group("full_attention", layers, heads, head_dim, block_tokens,
                                                    device_blocks, host_blocks)])


def sliding_and_full(config: Dict, tp: int, block_tokens=16, device_blocks=1024, host_blocks=2048) -> CacheGroups:
    """Sliding-window layers beside full-attention ones (gpt-oss, Gemma 3): layer_types
    ("sliding_attention" / "full_attention"), sliding_window, num_key_value_heads, head_dim."""
    types = config["layer_types"]
    heads = _split(config["num_key_value_heads"], tp, "num_key_value_heads")
    head_dim = config["head_dim"]
    return CacheGroups(tp, block_tokens, [
        _kv_group("sliding_window", _layers(types, "sliding_attention"), heads, head_dim, block_tokens,
                  device_blocks, host_blocks, window=config["sliding_window"]),
        _kv_group("full_attention", _layers(types, "full_attention"), heads, head_dim, block_tokens,
                  device_blocks, host_blocks),
    ])


def linear_and_full(config: Dict, tp: int, block_tokens=16, device_blocks=1024, host_blocks=2048,
                    state_slots=256, host_state_slots=512) -> CacheGroups:
    """Gated DeltaNet layers beside full attention (Qwen3-Next): layer_types ("linear_attention" /
    "full_attention"), or full_attention_interval (layer i is full attention when (i + 1) is a
    multiple of it, as transformers' Qwen3NextConfig derives layer_types), num_hidden_layers,
    num_key_value_heads, head_dim, linear_num_key_heads, linear_num_value_heads,
    linear_key_head_dim, linear_value_head_dim, linear_conv_kernel_dim."""
    types = config.get("layer_types") or [
        "full_attention" if (i + 1) % config["full_attention_interval"] == 0 else "linear_attention"
        for i in range(config["num_hidden_layers"])]
    kv_heads = _split(config["num_key_value_heads"], tp, "num_key_value_heads")
    key_heads, value_heads = config["linear_num_key_heads"], config["linear_num_value_heads"]
    key_dim, value_dim = config["linear_key_head_dim"], config["linear_value_head_dim"]
    conv_dim = 2 * key_heads * key_dim + value_heads * value_dim
    if conv_dim % tp or value_heads % tp:
        raise ValueError(f"linear attention heads ({key_heads} key, {value_heads} value) do not split over TP {tp}")
    conv = (BF16, (conv_dim // tp, config["linear_conv_kernel_dim"] - 1))
    recurrent = (FP32, (value_heads // tp, key_dim, value_dim))
    return CacheGroups(tp, block_tokens, [
        CacheGroup("state", _layers(types, "linear_attention"), [conv, recurrent], state_slots, host_state_slots, 0),
        _kv_group("full_attention", _layers(types, "full_attention"), kv_heads, config["head_dim"], block_tokens,
                  device_blocks, host_blocks),
    ])


def mla_with_indexer(config: Dict, tp: int, block_tokens=64, device_blocks=1024, host_blocks=2048) -> CacheGroups:
    """MLA with a sparse-attention indexer (DeepSeek-V3.2): num_hidden_layers, kv_lora_rank,
    qk_rope_head_dim, index_head_dim. The indexer keys are fp8 with one float32 scale per 128
    values (vLLM's DeepseekV32IndexerCache: index_head_dim + index_head_dim / 128 * 4 bytes)."""
    layers = list(range(config["num_hidden_layers"]))
    latent = config["kv_lora_rank"] + config["qk_rope_head_dim"]
    index_bytes = config["index_head_dim"] + config["index_head_dim"] // 128 * 4
    return CacheGroups(tp, block_tokens, [
        CacheGroup("mla_latent", layers, [(BF16, (block_tokens, latent))], device_blocks, host_blocks, block_tokens),
        CacheGroup("indexer", layers, [(1, (block_tokens, index_bytes))], device_blocks, host_blocks, block_tokens),
    ])
