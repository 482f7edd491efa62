"""gpu-check's sglang step: sglang's own pinned memfd host pools beside CUDA device pools, through
kvtd.sglang and a real daemon, every byte compared on the device.

    KVTD_BINARY=... KVTD_CLIENT_LIBRARY=... PYTHONPATH=python:tests/python:tests/python/sglang \\
      python3 scripts/gpu/sglang_pinned.py [--device cuda|cpu] [--pages 64]

A hybrid scheduler's pools as sglang makes them on a GPU machine: the KV host pool (the MHA
stand-in of tests/python/sglang/sglang_harness.py, page-first, its buffer pinned by sglang's own
_cuda_host_register, pool_host/common.py:120-130) and sglang's own MambaPoolHost over a CUDA
Mamba pool (its buffers made by sglang's alloc_with_host_register: a memfd, then
cudaHostRegister). The "model" writes KV pages and a Mamba state on the device; they are copied to
the host pools (the copy sglang's backup kernels make), backed up through kvtd (batch_set_v2, then
batch_set_v1, as HybridCacheController does), the host pools zeroed, loaded back into other pages
and another slot (batch_exists_v2, batch_get_v1, batch_get_v2) and copied to new device tensors:
equal to what the model wrote, or the step fails. The daemon maps the pinned memfds (host
backend: sglang's device<->host copies are its own). `--device cpu` runs the same without a GPU.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

import sglang_harness
import sglang_hybrid as sh

PAGE = 16


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--pages", type=int, default=64)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    _, _, _, _, hs = sh.import_hybrid()
    from sglang.srt.mem_cache.pool_host.common import _cuda_host_register  # noqa: E402

    kv_dev = sglang_harness.DevicePool(torch.bfloat16, a.pages * PAGE, 4, 4, 64)
    kv = sglang_harness.mha_host_pool_class()(kv_dev, 2.0, PAGE, "page_first")
    if cuda:
        _cuda_host_register(kv.kv_buffer)
    mamba_dev = sh.MambaDevicePool(layers=4, slots=4)
    if cuda:  # a CUDA Mamba pool: MambaPoolHost pins its memfd buffers (alloc_with_host_register)
        mamba_dev.device = "cuda"
        mamba_dev.mamba_cache.temporal = mamba_dev.mamba_cache.temporal.cuda()
        mamba_dev.mamba_cache.conv = [c.cuda() for c in mamba_dev.mamba_cache.conv]
    _, _, _, mamba_cls, _ = sh.import_hybrid()
    mamba = (mamba_cls(mamba_dev, 1.0, 0, pin_memory=True, device="cpu", allocator_type="shm", layout="page_first")
             if cuda else sh.mamba_host_pool(mamba_dev))
    group = sh.pool_group([(hs.PoolName.KV, kv, kv_dev), (hs.PoolName.MAMBA, mamba, mamba_dev)])
    store = Path(tempfile.mkdtemp(prefix="kvtd_sglang_pinned_"))
    backend, daemons = sh.kvtd_backend(group, store / "s", model_id="gpu")
    try:
        dev = torch.device(a.device)
        n = a.pages * PAGE
        # The model's KV of pages [0, pages) on the device, in the host pool's dims (2, tokens, layers, heads, dim).
        model_kv = torch.randint(-2**15, 2**15, (2, n) + tuple(kv.kv_buffer.shape[2:]), dtype=torch.int16,
                                 device=dev).view(torch.bfloat16)
        model_state = [torch.randint(0, 256, (b[0].numel() * b.element_size(),), dtype=torch.uint8, device=dev)
                       .view(b.dtype).reshape(b[0].shape) for b in (mamba.temporal_buffer, *mamba.conv_buffer)]
        kv.kv_buffer[:, :n].copy_(model_kv, non_blocking=True)
        for buf, st in zip((mamba.temporal_buffer, *mamba.conv_buffer), model_state):
            buf[0].copy_(st, non_blocking=True)
        if cuda:
            torch.cuda.synchronize()
        keys = [f"g{i}" for i in range(a.pages)]
        state = [hs.PoolTransfer(name=hs.PoolName.MAMBA, keys=keys[-1:], host_indices=torch.tensor([0]),
                                 hit_policy=hs.PoolHitPolicy.TRAILING_PAGES)]
        t0 = time.perf_counter()
        assert all(backend.batch_set_v2(state)[hs.PoolName.MAMBA]), "state backup"
        assert all(backend.batch_set_v1(keys, torch.arange(n))), "KV backup"
        backed = time.perf_counter() - t0
        kv.kv_buffer.zero_()
        for buf in (mamba.temporal_buffer, *mamba.conv_buffer):
            buf.zero_()
        state[0].host_indices = torch.tensor([1])
        t0 = time.perf_counter()
        assert backend.batch_exists_v2(keys, state).kv_hit_pages == a.pages, "lookup"
        assert all(backend.batch_get_v1(keys, torch.arange(n, 2 * n))), "KV load"
        assert all(backend.batch_get_v2(state)[hs.PoolName.MAMBA]), "state load"
        loaded = time.perf_counter() - t0
        back_kv = kv.kv_buffer[:, n:2 * n].to(dev, non_blocking=True)
        back_state = [b[1].to(dev, non_blocking=True) for b in (mamba.temporal_buffer, *mamba.conv_buffer)]
        if cuda:
            torch.cuda.synchronize()
        same_kv = torch.equal(back_kv.view(torch.int16), model_kv.view(torch.int16))
        same_state = all(torch.equal(x.view(torch.uint8), y.view(torch.uint8)) for x, y in zip(back_state, model_state))
        nbytes = kv.kv_buffer[:, :n].numel() * 2
        print(f"FIGURE sglang pinned pools ({a.device}): {a.pages} pages ({nbytes / 2**20:.1f} MiB) + 1 Mamba state, "
              f"backup {nbytes / backed / 1e9:.2f} GB/s, load {nbytes / loaded / 1e9:.2f} GB/s; KV on the device "
              f"{'equal' if same_kv else 'DIFFERENT'}, state {'equal' if same_state else 'DIFFERENT'}")
        return 0 if same_kv and same_state else 1
    finally:
        daemons.stop()
        backend.close()
        shutil.rmtree(store, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
