"""Stand-ins for vllm/v1/kv_cache_interface.py, which is not vendored (PROVENANCE): the KV cache
specs and the KVCacheConfig a vLLM worker is built with, holding only what the vendored code that
runs in these tests reads of them. The registration itself is vLLM's: offloading/worker.py's
register_kv_caches (:68-240) and offloading/canonical_mapping.py's derive_canonical_mappings
(:399-456) run unmodified over these.

What is read, and where (vLLM main 017e9f44):
- worker.py:93-140: isinstance(spec, AttentionSpec / MambaSpec / UniformTypeKVCacheSpecs),
  spec.page_size_bytes, spec.unpadded_page_size_bytes, dataclasses.replace(mamba_spec,
  page_size_padded=None).page_size_bytes; KVCacheConfig.num_blocks, .kv_cache_groups (layer_names,
  kv_cache_spec), .kv_cache_tensors (shared_by, and block_stride through
  offloading/config.py:26-28 is_kv_cache_tensor_packed).
- canonical_mapping.py:255-330: spec.block_size, num_kv_heads, head_size, real_page_size_bytes,
  kv_quant_mode.is_per_token_head, and for MLA compress_ratio.
- offloading/scheduler.py:109-127, 162, 265: SlidingWindowSpec.sliding_window, MambaSpec (a window
  of one chunk) and its mamba_cache_mode ("none", "align" or "all").
Sizes follow vLLM's definitions: an attention page holds K and V of block_size tokens (MLA: the
latent once), a Mamba page the sum of its state tensors, each padded to page_size_padded if set.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Dict, List, Optional, Tuple

import torch


class KVQuantMode(enum.IntEnum):
    """Only the unquantized mode is used here; the two questions vLLM asks of a mode."""
    NONE = 0

    @property
    def is_per_token_head(self) -> bool:
        return False

    @property
    def is_nvfp4(self) -> bool:
        return False


def _itemsize(dtype: torch.dtype) -> int:
    return torch.tensor([], dtype=dtype).element_size()


@dataclasses.dataclass(frozen=True)
class KVCacheSpec:
    block_size: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    num_kv_heads: int
    head_size: int
    dtype: torch.dtype
    kv_quant_mode: KVQuantMode = KVQuantMode.NONE
    page_size_padded: Optional[int] = None

    @property
    def real_page_size_bytes(self) -> int:
        return 2 * self.block_size * self.num_kv_heads * self.head_size * _itemsize(self.dtype)

    @property
    def unpadded_page_size_bytes(self) -> int:
        return self.real_page_size_bytes

    @property
    def page_size_bytes(self) -> int:
        return self.page_size_padded if self.page_size_padded is not None else self.real_page_size_bytes


@dataclasses.dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    sliding_window: Optional[int] = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int


@dataclasses.dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    compress_ratio: int = 1

    @property
    def real_page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * self.head_size * _itemsize(self.dtype)


@dataclasses.dataclass(frozen=True)
class MambaSpec(KVCacheSpec):
    shapes: Tuple[Tuple[int, ...], ...]
    dtypes: Tuple[torch.dtype, ...]
    page_size_padded: Optional[int] = None
    mamba_cache_mode: str = "none"

    @property
    def page_size_bytes(self) -> int:
        real = sum(math.prod(s) * _itemsize(d) for s, d in zip(self.shapes, self.dtypes))
        return self.page_size_padded if self.page_size_padded is not None else real


@dataclasses.dataclass(frozen=True)
class UniformTypeKVCacheSpecs(KVCacheSpec):
    kv_cache_specs: Dict[str, KVCacheSpec]


@dataclasses.dataclass
class KVCacheTensor:
    size: int
    shared_by: List[str]
    block_stride: int = 0  # 0: not packed (offloading/config.py:26-28)


@dataclasses.dataclass
class KVCacheGroupSpec:
    layer_names: List[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclasses.dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_tensors: List[KVCacheTensor]
    kv_cache_groups: List[KVCacheGroupSpec]


NAMES = ("KVCacheSpec", "AttentionSpec", "FullAttentionSpec", "SlidingWindowSpec", "MLAAttentionSpec", "MambaSpec",
         "UniformTypeKVCacheSpecs", "KVCacheTensor", "KVCacheGroupSpec", "KVCacheConfig", "KVQuantMode")


def install(module) -> None:
    """Puts the stand-ins into the (otherwise name-only) vllm.v1.kv_cache_interface module, before
    any vendored module imports names from it."""
    for name in NAMES:
        setattr(module, name, globals()[name])
