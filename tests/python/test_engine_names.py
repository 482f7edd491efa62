"""The names engines' own configs load stay where users wrote them after the engine wing moved
each adapter into kvtd/engines/<engine>/: each resolves, as the engine's loader resolves it, to
that adapter's module itself (one module object, so classes and module state are one).

- FastDeploy v0: `from kvtd.fastdeploy import KvtdCacheQueue` (docs/engines/fastdeploy.md).
- FastDeploy v1: the dist-info entry point `kvtd = kvtd.fastdeploy_v1:register` in
  `fastdeploy.model_register_plugins` (python/dist-info/entry_points.txt, installed as kvtd-<version>.dist-info), loaded as
  importlib.metadata loads any entry point.
- sglang: `module_path` "kvtd.sglang", class "KvtdHiCacheStorage", through sglang's own
  StorageBackendFactory (storage/backend_factory.py:114-150 imports module_path and checks
  issubclass(HiCacheStorage)).
- vLLM: `kv_connector_module_path` and `spec_module_path` "kvtd.vllm" (offloading/factory.py:29-56
  import the module and take the class by name).
"""

from __future__ import annotations

import configparser
import importlib
import importlib.metadata
from pathlib import Path

import os
import sys

import pytest

# The engines' harnesses live with each engine's tests.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, "sglang"), os.path.join(HERE, "vllm")]
import sglang_harness  # noqa: E402
import vllm_harness  # noqa: E402


def test_fastdeploy_v0_imports_the_queue_from_kvtd_fastdeploy():
    from kvtd.engines.fastdeploy import queue
    from kvtd.fastdeploy import KvtdCacheQueue

    assert importlib.import_module("kvtd.fastdeploy") is queue and KvtdCacheQueue is queue.KvtdCacheQueue


def test_fastdeploy_v1s_plugin_entry_point_loads_register():
    from kvtd.engines.fastdeploy_v1 import manager

    parser = configparser.ConfigParser()  # the source of the installed kvtd-<version>.dist-info
    parser.read(Path(HERE).parents[1] / "python" / "dist-info" / "entry_points.txt")
    value = parser["fastdeploy.model_register_plugins"]["kvtd"]
    ep = importlib.metadata.EntryPoint(name="kvtd", value=value, group="fastdeploy.model_register_plugins")
    assert ep.load() is manager.register
    assert importlib.import_module("kvtd.fastdeploy_v1") is manager


@pytest.mark.skipif(sglang_harness.sglang_source() is None, reason=sglang_harness.skip_reason())
def test_sglangs_factory_loads_kvtd_sglang():
    hs = sglang_harness.import_hicache_storage()
    from kvtd.engines.sglang import backend

    config = sglang_harness.storage_config(0, 1, {"backend_name": "kvtd", "module_path": "kvtd.sglang",
                                                  "class_name": "KvtdHiCacheStorage", "interface_v1": 1,
                                                  "allocator": "shm", "kvtd_session": "names"})
    made = sglang_harness.backend_factory().create_backend("dynamic", config, None)
    try:
        assert type(made) is backend.KvtdHiCacheStorage and isinstance(made, hs.HiCacheStorage)
    finally:
        made.close()
    assert importlib.import_module("kvtd.sglang") is backend


@pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())
def test_vllms_module_paths_load_kvtd_vllm():
    vllm_harness.import_vllm()
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector import OffloadingConnector
    from vllm.v1.kv_offload.base import OffloadingSpec

    from kvtd.engines.vllm import spec

    module = importlib.import_module("kvtd.vllm")  # what both factories do with the path
    assert module is spec
    assert issubclass(getattr(module, "KvtdOffloadingSpec"), OffloadingSpec)
    assert issubclass(getattr(module, "KvtdOffloadingConnector"), OffloadingConnector)
