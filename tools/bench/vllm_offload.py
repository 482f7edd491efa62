"""kvtd.vllm's worker against the mechanism of vLLM's own CPU worker, the same blocks, the same jobs.

    PYTHONPATH=python:tests/python KVTD_BINARY=build/daemon/kvtd KVTD_CLIENT_LIBRARY=... \\
      /usr/bin/python3 tools/bench/vllm_offload.py [--device cpu|cuda] [--layers 32] [--page-kib 32] \\
      [--blocks 1024] [--job-blocks 64] [--rounds 3] [--registration direct|per_layer|cross_layer]

One worker's canonical KV tensors (2 x layers tensors of (blocks, page) bytes: vLLM's canonical
layout, a K and a V row of `--page-kib` per layer and block), stored to host blocks and loaded back
in jobs of `--job-blocks` random blocks, as vLLM's OffloadingConnectorWorker submits them
(submit_store / submit_load, then get_finished until every job is done). --registration per_layer
or cross_layer: the same bytes registered by vLLM's own code instead (a layer's K and V as one
FlashAttention-shaped tensor through register_kv_caches, or one slab of every layer through
register_cross_layers_kv_cache, vLLM's default layout).
- kvtd: KvtdOffloadingWorker, its rank's daemon doing the copies (host backend with --device cpu:
  the "GPU" is a shared-memory tensor; --device cuda: CUDA tensors through IPC handles).
- vLLM's mechanism in the same process, per tensor: CPU -> GPU with vLLM's own Triton kernel
  (v1/kv_offload/cpu/swap_blocks_triton.py, its path for pages under 28 KiB) where Triton runs;
  otherwise, and GPU -> CPU, a copy per block and tensor into pinned host rows (vLLM's swap_blocks:
  a cudaMemcpyAsync per block; vLLM's compiled ops batch them with cuMemcpyBatchAsync, which torch
  does not expose, so on a GPU this peer is the slower of vLLM's two paths).
On the host backend the per-block peer pays a Python call per block and tensor that vLLM's
compiled swap_blocks does not: read its ratio as an upper bound, and kvtd's fraction of the
ceiling (the same bytes copied whole, one contiguous copy per tensor) as the firmer figure.
Prints FIGURE lines: GB/s each way and kvtd's ratio, the median of --rounds. Every loaded byte is
compared once. With --device cuda it then checks the GPU ordering (ordering_check).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "python"), str(ROOT / "tests" / "python"), str(ROOT / "tests" / "python" / "vllm")]

import torch  # noqa: E402

import kvtd.testing  # noqa: E402
import vllm_harness  # noqa: E402


def config(a, session, ready_timeout=60.0):
    from vllm.v1.kv_offload import config as c
    page = a.page_kib * 1024
    return c.OffloadingConfig(
        groups=(c.OffloadingGroupConfig(tokens_per_block=16, layer_names=tuple(f"l{i}" for i in range(a.layers))),),
        worker_kv_bytes_per_block=2 * a.layers * page, enable_kv_cache_events=False,
        extra_config={"spec_name": "KvtdOffloadingSpec", "spec_module_path": "kvtd.vllm",
                      "kvtd_host_blocks": a.blocks, "kvtd_session": session, "kvtd_ready_timeout_s": ready_timeout},
        engine_id="bench", model=c.OffloadingModelConfig(name="m", dtype="bfloat16"),
        cache=c.OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=c.OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                            data_parallel_index=0, data_parallel_size=1,
                                            data_parallel_rank_local=None, is_parallelism_agnostic=False))


def kv_bytes(a, n):
    """`n` bytes of KV: a CUDA tensor, or a shared-memory file's tensor (with its path) on the host."""
    if a.device == "cuda":
        return torch.randint(-128, 127, (n,), dtype=torch.int8, device="cuda"), None
    path = f"/dev/shm/kvtd_vllm_bench_{uuid.uuid4().hex[:8]}"
    buf = torch.from_file(path, shared=True, size=n, dtype=torch.int8)
    buf.copy_(torch.randint(-128, 127, buf.shape, dtype=torch.int8))
    return buf, path


def device_tensors(a):
    """vLLM's canonical tensors: 2 x layers (blocks, page) rows over one allocation."""
    page, n = a.page_kib * 1024, 2 * a.layers
    buf, path = kv_bytes(a, n * a.blocks * page)
    return [buf[i * a.blocks * page:(i + 1) * a.blocks * page].view(a.blocks, page) for i in range(n)], path


def registered_worker(a, session):
    """The worker as vLLM's own registration makes it (offloading/worker.py): per_layer, one
    FlashAttention-shaped layer of K and V a layer through register_kv_caches; cross_layer, one slab
    of every layer through register_cross_layers_kv_cache (vLLM's default layout). The worker's
    session is published first, then its daemon started on the geometry the worker logged."""
    import vllm_engine
    import vllm_registration
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading import worker as connector_worker
    from vllm.v1.kv_offload import factory
    page, heads = a.page_kib * 1024, 4
    head_size = page // (vllm_registration.TOKENS_PER_BLOCK * heads * 2)
    buf, path = kv_bytes(a, 2 * a.layers * a.blocks * page)
    names = [f"l{i}" for i in range(a.layers)]
    spec = factory.OffloadingSpecFactory.create_spec(config(a, session, ready_timeout=0.01))
    kv_cache_config = vllm_engine.kv_cache_config(names, a.blocks, vllm_registration.attention_spec(heads, head_size))
    connector = connector_worker.OffloadingConnectorWorker(spec, vllm_registration.worker_vllm_config(0, 1, heads),
                                                           kv_cache_config)
    vllm_registration.torch_2_untyped_storage()
    if a.registration == "cross_layer":
        tensors = [buf.view(a.blocks, 2 * a.layers * page)]
        connector.register_cross_layers_kv_cache(buf, vllm_registration.FlashAttentionStandIn)
    else:
        tensors = [buf[i * a.blocks * 2 * page:(i + 1) * a.blocks * 2 * page].view(a.blocks, 2 * page)
                   for i in range(a.layers)]
        connector.register_kv_caches({n: vllm_registration.attention_layer(t, heads, head_size)
                                      for n, t in zip(names, tensors)})
    return connector.worker, tensors, path


def triton_load():
    """vLLM's own Triton kernel for CPU -> GPU, with the real triton behind vllm.triton_utils; None if
    Triton cannot run here."""
    try:
        import triton
        import triton.language as tl
    except ImportError:
        return None
    sys.modules["vllm.triton_utils"].triton, sys.modules["vllm.triton_utils"].tl = triton, tl
    if "vllm._custom_ops" not in sys.modules:  # vLLM's compiled ops: only its n < MIN_N branch calls them
        vllm_harness._names_module("vllm._custom_ops")
    try:
        from vllm.v1.kv_offload.cpu import swap_blocks_triton as k
    except Exception as e:  # noqa: BLE001 - the peer falls back to a copy per block
        print(f"vLLM's Triton kernel does not load here ({e}); loads compared with a copy per block")
        return None
    return k


def jobs_of(a, g):
    perm = torch.randperm(a.blocks, generator=g).tolist()
    host = torch.randperm(a.blocks, generator=g).tolist()
    return [(perm[i:i + a.job_blocks], host[i:i + a.job_blocks]) for i in range(0, a.blocks, a.job_blocks)]


def run_kvtd(worker, base, jobs, store):
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    for j, (gpu, host) in enumerate(jobs):
        gspec = base.GPULoadStoreSpec(gpu, group_sizes=[len(gpu)], block_indices=[0])
        hspec = CPULoadStoreSpec(host)
        if store:
            worker.submit_store(j, gspec, hspec)
        else:
            worker.submit_load(j, hspec, gspec)
    done = set()
    while len(done) < len(jobs):
        for r in worker.get_finished():
            assert r.success, f"job {r.job_id} failed"
            done.add(r.job_id)


def run_peer(tensors, hosts, jobs, store, kernel, a):
    """A copy per block and tensor (what vLLM's swap_blocks does: a cudaMemcpyAsync per block; a
    memcpy on the host), or vLLM's Triton kernel for loads where it runs."""
    sync = torch.cuda.synchronize if a.device == "cuda" else (lambda: None)
    for gpu, host in jobs:
        for t, h in zip(tensors, hosts):
            if not store and kernel is not None:
                page = t.shape[1]
                src = torch.tensor([h.data_ptr() + b * page for b in host], dtype=torch.int64).pin_memory()
                dst = torch.tensor([t.data_ptr() + b * page for b in gpu], dtype=torch.int64).pin_memory()
                sizes = torch.full((len(gpu),), page, dtype=torch.int64).pin_memory()
                kernel.swap_blocks_batch(src, dst, sizes, bytes_per_chunk=min(8192, 1 << (page - 1).bit_length()))
                continue
            for g, c in zip(gpu, host):
                if store:
                    h[c].copy_(t[g], non_blocking=True)
                else:
                    t[g].copy_(h[c], non_blocking=True)
    sync()


def contiguous(tensors, hosts, a):
    """The ceiling: every tensor copied whole, one contiguous copy of the same bytes."""
    for t, h in zip(tensors, hosts):
        h.copy_(t, non_blocking=True)
    if a.device == "cuda":
        torch.cuda.synchronize()


def ordering_check(worker, base, tensors, a) -> None:
    """On a GPU: a store and a load submitted right behind the model's GPU work see its effect. Each
    tensor's first blocks are rewritten on the current stream behind a long GPU sleep and the store
    is submitted at once, with no synchronise (vLLM's worker submits as its step ends); then they
    are zeroed behind another sleep and loaded back at once. Every byte must be the rewritten one:
    the daemon's copies wait for the worker's event (kvtd.vllm records it as vLLM's CPU worker
    waits on its compute stream, cpu/gpu_worker.py:636-641). Without it the H100 took the old
    bytes in 0.4-2.5 ms."""
    if a.device != "cuda":
        return
    blocks = list(range(min(64, a.blocks)))
    job = [(blocks, blocks)]
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time queued ahead of the writes
    for t in tensors:
        t[blocks] = 7
    run_kvtd(worker, base, job, True)
    torch.cuda._sleep(200_000_000)
    for t in tensors:
        t[blocks] = 0
    run_kvtd(worker, base, job, False)
    torch.cuda.synchronize()
    wrong = sum(int((t[blocks] != 7).any(dim=1).sum()) for t in tensors)
    assert wrong == 0, f"{wrong} block-tensors of {len(blocks) * len(tensors)} hold bytes the model had not written"
    print(f"ORDERING ok: a store and a load submitted behind 0.1 s of queued GPU work moved the model's bytes "
          f"({len(blocks)} blocks x {len(tensors)} tensors)")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--page-kib", type=int, default=32)
    ap.add_argument("--blocks", type=int, default=512)
    ap.add_argument("--job-blocks", type=int, default=64)  # >= swap_blocks_triton.MIN_N (16)
    ap.add_argument("--rounds", type=int, default=3)
    # direct: the canonical tensors handed to the spec's get_worker (2 x layers of `--page-kib`);
    # per_layer / cross_layer: registered by vLLM's own register_kv_caches / register_cross_layers_kv_cache.
    ap.add_argument("--registration", choices=["direct", "per_layer", "cross_layer"], default="direct")
    a = ap.parse_args()
    vllm_harness.import_vllm()
    from vllm.v1.kv_offload import base, factory
    session = f"vlb{uuid.uuid4().hex[:6]}"
    extra = ["--device-backend", "cuda", "--device-id", str(torch.cuda.current_device())] if a.device == "cuda" else []
    worker = None
    if a.registration == "direct":
        spec = factory.OffloadingSpecFactory.create_spec(config(a, session))
        tensors, path = device_tensors(a)
        page = a.page_kib * 1024
        caches = base.CanonicalKVCaches(tensors=[base.CanonicalKVCacheTensor(t, page) for t in tensors],
                                        group_data_refs=[[base.CanonicalKVCacheRef(i, page) for i in range(len(tensors))]])
        from kvtd.vllm import geometry_of
        geometry = geometry_of(caches, 1, a.blocks, dtype="bfloat16")  # the dtype config() declares
    else:
        worker, tensors, path = registered_worker(a, session)
        geometry = worker._geometry
    daemons = kvtd.testing.Daemons(None, f"{session}_r0", geometry, extra, ranks=[0]).start()
    hosts = [torch.empty(tuple(t.shape), dtype=torch.int8, pin_memory=a.device == "cuda") for t in tensors]
    kernel = triton_load() if a.device == "cuda" else None
    nbytes = sum(t.numel() for t in tensors)  # int8: bytes
    figures = {k: [] for k in ("kvtd store", "peer store", "kvtd load", "peer load", "contiguous")}
    try:
        if worker is None:
            worker = spec.get_worker(caches)
        else:
            worker._session.wait_ready(60)
        g = torch.Generator().manual_seed(0)
        for _ in range(a.rounds):
            jobs = jobs_of(a, g)
            for name, fn in (("kvtd store", lambda: run_kvtd(worker, base, jobs, True)),
                             ("peer store", lambda: run_peer(tensors, hosts, jobs, True, kernel, a)),
                             ("kvtd load", lambda: run_kvtd(worker, base, jobs, False)),
                             ("peer load", lambda: run_peer(tensors, hosts, jobs, False, kernel, a)),
                             ("contiguous", lambda: contiguous(tensors, hosts, a))):
                t0 = time.perf_counter()
                fn()
                figures[name].append(nbytes / (time.perf_counter() - t0) / 1e9)
        before = [t.clone() for t in tensors]
        run_kvtd(worker, base, jobs, True)
        for t in tensors:
            t.zero_()
        run_kvtd(worker, base, jobs, False)
        assert all(torch.equal(x, y) for x, y in zip(tensors, before)), "a loaded byte differs"
        ordering_check(worker, base, tensors, a)
        med = {k: statistics.median(v) for k, v in figures.items()}
        peer_load = "vLLM's Triton kernel" if kernel is not None else "a copy per block"
        shape = (f"{a.blocks} blocks x {len(tensors)} tensors x {tensors[0].shape[1] // 1024} KiB = "
                 f"{nbytes / 2**30:.2f} GiB ({a.registration}), jobs of {a.job_blocks} random blocks, {a.device}, "
                 f"median of {a.rounds}")
        print(f"FIGURE vllm store (GPU -> host): kvtd {med['kvtd store']:.2f} GB/s, a copy per block "
              f"{med['peer store']:.2f} GB/s = {med['kvtd store'] / med['peer store']:.2f}x; {shape}")
        print(f"FIGURE vllm load (host -> GPU): kvtd {med['kvtd load']:.2f} GB/s, {peer_load} "
              f"{med['peer load']:.2f} GB/s = {med['kvtd load'] / med['peer load']:.2f}x; {shape}")
        print(f"FIGURE vllm ceiling (GPU -> host, every tensor whole): {med['contiguous']:.2f} GB/s; kvtd's store "
              f"{med['kvtd store'] / med['contiguous']:.2f}x, load {med['kvtd load'] / med['contiguous']:.2f}x of it")
        worker.shutdown()
        return 0
    finally:
        daemons.stop()
        if path:
            os.unlink(path)


if __name__ == "__main__":
    sys.exit(main())
