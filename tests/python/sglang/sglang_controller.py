"""sglang v0.5.18's HiCacheController (managers/cache_controller.py), loaded unmodified, with its
storage threads, for tests that drive an L3 backend the way a scheduler does.

What cannot load here is stood in for (PROVENANCE of the reference tree), never its logic:
- sglang.srt.layers.dp_attention: no DP attention (is_dp_attention_enabled() False).
- sglang.srt.runtime_context.get_parallel: this process's TP rank and size.
- sglang.srt.utils.get_device_module: a CPU module whose streams and events do nothing (the
  controller builds an L2TransferEngine with two streams and per-layer events at start,
  l2_transfer.py:52-55, cache_controller.py:51-53; no device copy runs here).
- sglang.srt.mem_cache.memory_pool's MLATokenToKVPool / HybridLinearKVPool and
  deepseek_v4_memory_pool's DeepSeekV4TokenToKVPool: classes for its isinstance checks
  (cache_controller.py:272-276, 624-630); the device pool is sglang_harness.DevicePool or
  MLADevicePool, the MLA one an instance of the MLATokenToKVPool stand-in.
- sglang.srt.mem_cache.utils.get_hash_str: a compiled extension upstream; here SHA-256 chained
  page by page from the prior hash, the same shape (one string per page of page_size tokens).
- sglang.srt.distributed.parallel_state.create_custom_parallel_group: torch.distributed.new_group
  over the ranks with the backend asked for (gloo), as the controller's prefetch MIN all-reduce
  needs (cache_controller.py:346-378).

The scheduler thread's part (hiradix_cache.py:608-683, which needs the radix tree) is done by
`Scheduler` below, step for step: drain prefetch_hit_queue, allocate host memory for the agreed
hit count, hand the operation to prefetch_buffer; drain ack_backup_queue; free what
host_mem_release_queue returns.
"""

from __future__ import annotations

import contextlib
import hashlib
import sys
import threading
import time
from queue import Empty

import torch

import sglang_harness
from reference_source import stand_in_module


class _Stream:
    def wait_stream(self, other):
        pass

    def synchronize(self):
        pass


class _Event:
    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True


class _CpuDeviceModule:
    Stream = _Stream
    Event = _Event

    @staticmethod
    def stream(s):
        return contextlib.nullcontext()

    @staticmethod
    def current_stream():
        return _Stream()


class MLATokenToKVPool:
    """memory_pool.MLATokenToKVPool's stand-in: the class the controller's isinstance checks name."""


def get_hash_str(token_ids, prior_hash=None, page_size=1):
    out, prior = [], prior_hash or ""
    for i in range(0, len(token_ids) - len(token_ids) % page_size, page_size):
        prior = hashlib.sha256((prior + ":" + ",".join(map(str, token_ids[i:i + page_size]))).encode()).hexdigest()
        out.append(prior)
    return out


class _Parallel:
    def __init__(self, tp_rank, tp_size):
        self.tp_rank, self.tp_size, self.pp_rank, self.pp_size = tp_rank, tp_size, 0, 1
        self.attn_tp_rank, self.attn_tp_size = tp_rank, tp_size


_parallel = _Parallel(0, 1)


def _stand_ins():
    sglang_harness.import_host_pool()
    utils = sys.modules["sglang.srt.utils"]
    utils.get_device_module = lambda: _CpuDeviceModule
    memory_pool = sys.modules["sglang.srt.mem_cache.memory_pool"]
    memory_pool.MLATokenToKVPool = MLATokenToKVPool
    memory_pool.HybridLinearKVPool = type("HybridLinearKVPool", (), {})
    if "sglang.srt.layers.dp_attention" not in sys.modules:
        stand_in_module("sglang.srt.layers")
        stand_in_module("sglang.srt.layers.dp_attention", is_dp_attention_enabled=lambda: False,
                        get_attention_dp_rank=lambda: 0)
        stand_in_module("sglang.srt.runtime_context", get_parallel=lambda: _parallel)
        stand_in_module("sglang.srt.mem_cache.deepseek_v4_memory_pool",
                        DeepSeekV4TokenToKVPool=type("DeepSeekV4TokenToKVPool", (), {}))
        stand_in_module("sglang.srt.mem_cache.utils", get_hash_str=get_hash_str)
        stand_in_module("sglang.srt.distributed")
        stand_in_module("sglang.srt.distributed.parallel_state",
                        create_custom_parallel_group=lambda group_ranks, backend:
                        torch.distributed.new_group(ranks=group_ranks, backend=backend))


def import_controller():
    _stand_ins()
    from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
    return HiCacheController


class Allocator:
    """What the controller reads of the device allocator: its KV cache (cache_controller.py:270)."""

    def __init__(self, device_pool):
        self._pool = device_pool

    def get_kvcache(self):
        return self._pool


def with_layer_counter(device_pool):
    device_pool.register_layer_transfer_counter = lambda counter: None
    return device_pool


def controller(pool, device_pool, *, tp_rank=0, tp_size=1, backend="dynamic", extra=None, threshold=None,
               tp_group=None):
    """A HiCacheController over `pool` with storage `backend` attached at construction, as sglang
    makes it (hiradix_cache.py:160-180)."""
    HiCacheController = import_controller()
    _parallel.__init__(tp_rank, tp_size)
    return HiCacheController(Allocator(with_layer_counter(device_pool)), pool, pool.page_size, tp_group,
                             threading.Event(), storage_backend=backend,
                             prefetch_threshold=threshold or pool.page_size, model_name="kvtd-test/model",
                             storage_backend_extra_config=dict(extra) if extra else None)


def next_from(queue, match, what, timeout=30.0):
    """The first operation the controller puts on `queue` for which match(op) holds (others are
    dropped, as the scheduler drains them); TimeoutError naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            op = queue.get(timeout=0.1)
        except Empty:
            continue
        if match(op):
            return op
    raise TimeoutError(f"{what} did not come back")


class Scheduler:
    """The scheduler thread's storage duties for one controller (hiradix_cache.py:608-683)."""

    def __init__(self, cc):
        self.cc = cc

    def backup(self, host_indices, token_ids, timeout=30.0):
        """write_storage then the backup ack; returns the tokens the backup thread completed."""
        keys = get_hash_str(token_ids, None, self.cc.page_size)
        op_id = self.cc.write_storage(host_indices, token_ids, keys)
        return next_from(self.cc.ack_backup_queue, lambda op: op.id == op_id, "the backup's ack", timeout).completed_tokens

    def prefetch_hits(self, request_id, token_ids, timeout=30.0):
        """prefetch() and the TP-agreed hit count from prefetch_hit_queue (the operation)."""
        self.cc.prefetch(request_id, token_ids)
        return next_from(self.cc.prefetch_hit_queue, lambda op: op.request_id == request_id, "the hit count", timeout)

    def load(self, op, timeout=30.0):
        """Allocates host memory for the hit count, hands it to the prefetch-io thread and waits
        until it completed or stopped; returns (host_indices, completed_tokens)."""
        host_indices = self.cc.mem_pool_host.alloc(op.storage_hit_count)
        assert host_indices is not None, "the host pool is full"
        op.host_indices = host_indices
        self.cc.prefetch_buffer.put(op)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if op.completed_tokens >= op.storage_hit_count or op.is_terminated():
                break
            time.sleep(0.01)
        time.sleep(0.05)  # the prefetch-io thread returns what it did not fill to host_mem_release_queue
        return host_indices, op.completed_tokens

    def stop(self):
        self.cc._stop_storage_threads()
        backend = self.cc.storage_backend
        if backend is not None and hasattr(backend, "close"):
            backend.close()
