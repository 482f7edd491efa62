"""Options of vLLM's offloading config kvtd.vllm cannot serve are refused at start, by name, so vLLM
stops there instead of running without what its user asked for (before: ignored without a word)."""

from __future__ import annotations

import dataclasses

import pytest

import vllm_harness
from test_vllm_engine import extra_config, offloading_config, vllm_modules

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())


def spec_of(config):
    _, _, factory, _, _ = vllm_modules()
    return factory.OffloadingSpecFactory.create_spec(config)


def test_canonical_layout_is_refused_by_name():
    """vLLM sets OffloadingConfig.canonical_layout from the extra config (offloading/config.py:138);
    its CPU worker then writes topology-free pages. kvtd's are per rank."""
    config = dataclasses.replace(offloading_config(0, 2, extra_config(canonical_layout=True)), canonical_layout=True)
    with pytest.raises(ValueError, match='"canonical_layout"'):
        spec_of(config)


def test_secondary_tiers_are_refused_naming_kvtds_storage_tier():
    extra = extra_config(secondary_tiers=[{"type": "fs", "root": "/tmp/x"}])
    with pytest.raises(ValueError, match='"secondary_tiers".*"kvtd_storage": true'):
        spec_of(offloading_config(0, 1, extra))


def test_the_options_kvtd_serves_start():
    spec = spec_of(offloading_config(0, 1, extra_config(eviction_policy="arc", store_threshold=2)))
    assert spec.num_blocks == 16
