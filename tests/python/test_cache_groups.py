"""Cache groups through the library, and the loadable prefix by group against sglang's own
multi-pool storage code: HiCacheFile.batch_exists_v2 (sglang v0.5.18,
python/sglang/srt/mem_cache/hicache_storage.py:602-662) over files its own set() wrote.

sglang's rule per pool is PoolHitPolicy (hicache_storage.py:83-91): ALL_PAGES (KV, the DSA
indexer) or TRAILING_PAGES, whose count is len(transfer.keys): 1 for a Mamba state, the window's
pages for SWA (hybrid_cache/hybrid_cache_controller.py:772-782). kvtd's kinds map onto them:
full attention, MLA latent and indexer are ALL_PAGES; state is TRAILING 1; a sliding window of W
tokens is TRAILING ceil(W / page_tokens).
"""

from __future__ import annotations

import math
import os
import random
import sys

import pytest
import torch

import kvtd
from kvtd.cache_groups import CacheGroup, CacheGroups

# sglang's own HiCacheFile is the oracle of two tests here: its harness lives with sglang's tests.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "sglang"))
import sglang_harness  # noqa: E402

PAGE = 16


def groups(kinds, window=48):
    out, layer = [], 0
    for kind in kinds:
        own = 0 if kind == "indexer" else layer
        layer += kind != "indexer"
        out.append(CacheGroup(kind, [own], [(2, (2, PAGE, 8))], device_blocks=64, host_blocks=16,
                              block_tokens=0 if kind == "state" else PAGE,
                              window_tokens=window if kind == "sliding_window" else 0))
    return CacheGroups(num_ranks=1, page_tokens=PAGE, groups=out)


def test_a_bad_group_is_refused_naming_it():
    g = groups(["full_attention", "sliding_window"], window=0)
    with pytest.raises(ValueError, match=r"group 1 \(sliding_window\): a sliding-window group needs window_tokens"):
        g.check()
    with pytest.raises(ValueError, match="kind 'swa' is not one of"):
        CacheGroups(1, PAGE, [CacheGroup("swa", [0], [(2, (1,))], 1)]).to_native()


def test_a_single_shape_geometry_reads_back_as_one_group_with_mla_declared():
    g = kvtd.Geometry(num_ranks=2, num_layers=4, key_shape=(32, 1, 16, 576), num_host_blocks=8)
    gs = CacheGroups.of_geometry(g, mla=True)
    gs.check()
    assert [x.kind for x in gs.groups] == ["mla_latent"]
    assert gs.groups[0].layers == [0, 1, 2, 3]
    assert gs.sizes()[0] == (4 * 16 * 576 * 2, 8 * 4 * 16 * 576 * 2)
    with pytest.raises(ValueError, match="an MLA latent has no value cache"):
        CacheGroups.of_geometry(kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(4, 1, 16, 8),
                                              value_shape=(4, 1, 16, 8)), mla=True)


def sglang_answer(hs, tmp_path, kinds, window, present):
    """batch_exists_v2 of sglang's own HiCacheFile, over the files its set() wrote for `present`."""
    cfg = hs.HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                  is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
                                  model_name="m", extra_config={"enable_metadata_cache": False})
    store = hs.HiCacheFile(cfg, file_path=str(tmp_path))
    keys = [f"k{i}" for i in range(len(present[0]))]
    names = [hs.PoolName.KV] + [f"pool{g}" for g in range(1, len(kinds))]
    page = torch.zeros(8, dtype=torch.uint8)
    for g, row in enumerate(present):
        for i, stored in enumerate(row):
            if stored:
                assert store.set(keys[i] if g == 0 else f"{keys[i]}.{names[g]}", page)
    transfers = []
    for g, kind in enumerate(kinds[1:], start=1):
        if kind in ("full_attention", "mla_latent", "indexer"):
            transfers.append(hs.PoolTransfer(name=names[g], hit_policy=hs.PoolHitPolicy.ALL_PAGES))
        else:
            n = 1 if kind == "state" else math.ceil(window / PAGE)
            transfers.append(hs.PoolTransfer(name=names[g], keys=keys[:n], hit_policy=hs.PoolHitPolicy.TRAILING_PAGES))
    return store.batch_exists_v2(keys, transfers).kv_hit_pages


def holds(kinds, window, present, p):
    """Whether every group's rule holds at point p (independent of both implementations)."""
    for kind, row in zip(kinds, present):
        if kind in ("full_attention", "mla_latent", "indexer"):
            if not all(row[:p]):
                return False
        elif p > 0:
            n = 1 if kind == "state" else math.ceil(window / PAGE)
            if not all(row[max(0, p - n):p]):
                return False
    return True


LAYOUTS = [
    ["full_attention", "sliding_window"],        # gpt-oss, Gemma 3
    ["full_attention", "state"],                 # Qwen3-Next, Nemotron-H, Jamba
    ["mla_latent", "indexer"],                   # DeepSeek-V3.2
    ["full_attention", "indexer", "state"],      # an ALL_PAGES sidecar beside a state
    ["full_attention", "sliding_window", "state"],
]


@pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())
@pytest.mark.parametrize("kinds", LAYOUTS, ids=["+".join(k) for k in LAYOUTS])
def test_hits_by_group_match_sglangs_own_file_backend(tmp_path, kinds):
    hs = sglang_harness.import_hicache_storage()
    rng = random.Random("+".join(kinds))
    window = 48
    gs = groups(kinds, window)
    gs.check()
    same = differ = 0
    for trial in range(60):
        n = rng.randint(0, 12)
        density = rng.choice([0.5, 0.8, 0.95, 1.0])
        present = [[rng.random() < density for _ in range(n)] for _ in kinds]
        ours, _ = gs.loadable_prefix(present)
        theirs = sglang_answer(hs, tmp_path / f"t{trial}", kinds, window, present)
        assert holds(kinds, window, present, ours), (present, ours)
        assert all(not holds(kinds, window, present, p) for p in range(ours + 1, n + 1)), (present, ours)
        if ours == theirs:
            same += 1
            continue
        # sglang takes the minimum of each pool's own answer (hicache_storage.py:640-660): where
        # that point breaks a trailing pool's rule, kvtd answers the longest point that holds.
        assert not holds(kinds, window, present, theirs), (present, ours, theirs)
        assert ours < theirs
        differ += 1
    assert same >= 40, (same, differ)


@pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())
def test_sglang_names_a_prefix_whose_state_is_missing_and_kvtd_does_not(tmp_path):
    hs = sglang_harness.import_hicache_storage()
    kinds = ["full_attention", "indexer", "state"]
    present = [[True] * 10, [True] * 5 + [False] * 5, [False] * 9 + [True]]
    assert sglang_answer(hs, tmp_path, kinds, 0, present) == 5
    assert not holds(kinds, 0, present, 5), "page 4 (the 5-page prefix's end) has no state"
    assert groups(kinds).loadable_prefix(present) == (0, [10, 5, 0])
