"""The Python client with real torch CUDA tensors on a GPU (run by scripts/gpu-check.sh).

Checks, printing one CHECK line each and exiting 1 if any failed:
  1. every layer's key and value are slices of ONE torch allocation, registered with
     register_torch_tensor (driver handle of the allocation plus offset);
  2. a `kvtd --device-backend cuda` daemon swaps blocks out and back byte for byte;
  3. a layer-by-layer load whose per-layer interprocess events the torch stream waits on, with
     no host-side wait between the layers;
  4. interference: swap bandwidth alone and while a bf16 GEMM loop runs in another process, and
     that GEMM's TFLOP/s alone and during the swaps (FIGURE lines);
  5. an engine event: the engine writes a block on its own stream, held back by a long kernel,
     and records a torch.cuda.Event(interprocess=True) after the write; the swap that names it
     (submit(engine_events=)) takes the written bytes, and the same swap without it is shown to
     take the old ones;
  6. clear_caches, then freeing the KV tensor returns its memory to the device
     (torch.cuda.memory_reserved drops): no torch IPC reference keeps it.
Interference is measured in the daemon's default scatter mode, or KVTD_SCATTER_MODE's.
Not run on this project's machines (no GPU); written against torch's public API.
"""
import os
import subprocess
import sys
import tempfile

import torch

import kvtd
import kvtd.testing as kt

failures = 0


def check(name, ok, detail=""):
    global failures
    failures += 0 if ok else 1
    print(f"CHECK {'PASS' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)


GEMM = """
import sys, time, torch
n = 8192
a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
end = time.time() + float(sys.argv[1])
done = 0
t0 = time.time()
while time.time() < end:
    for _ in range(10):
        a @ b
    torch.cuda.synchronize()
    done += 10
print(2 * n ** 3 * done / (time.time() - t0) / 1e12, flush=True)
"""


def gemm_tflops(seconds):
    """Starts the GEMM loop in its own process (its own CUDA context, as an engine's)."""
    return subprocess.Popen([sys.executable, "-c", GEMM, str(seconds)], stdout=subprocess.PIPE, text=True)


def swap_gbs(s, seconds):
    """Swaps 32 scattered blocks out and back for `seconds`; GB/s of the copies."""
    import time
    src = list(range(0, 64, 2))
    moved, t0 = 0, time.time()
    while time.time() - t0 < seconds:
        s.wait(s.swap_to_host(src, list(range(32))))
        s.wait(s.swap_to_device(list(range(32)), src))
        moved += 2 * 32 * g.block_bytes("key") * 2 * layers
    return moved / (time.time() - t0) / 1e9


def engine_event_orders_the_copy(s, kv):
    """The engine's write is still queued behind ~1 s of GPU spinning when it submits the swap."""
    stream = torch.cuda.Stream()

    def held_write(block, value):
        with torch.cuda.stream(stream):
            torch.cuda._sleep(2_000_000_000)  # about a second of cycles before the write runs
            kv[:, :, block].fill_(value)
        ev = torch.cuda.Event(interprocess=True)
        ev.record(stream)
        return ev

    import time
    # Both kernels once first: CUDA loads a kernel's module on its first launch (lazy loading),
    # and that load waited for the sleep, so the first "held" write had landed before the swap
    # without the event ran (H100, torch 2.11: it took the new bytes in 0.4 ms).
    held_write(52, 3)
    torch.cuda.synchronize()
    kv[:, :, [50, 51]] = 1
    torch.cuda.synchronize()
    held_write(50, 7)  # no event passed: the daemon cannot know the write is pending
    t0 = time.time()
    out = s.wait(s.swap_to_host([50], [10]))
    t1 = time.time()
    ev = held_write(51, 9)
    with_event = s.wait(s.swap_to_host([51], [11], engine_events=[ev]))
    t2 = time.time()
    torch.cuda.synchronize()
    back = s.wait(s.swap_to_device([10, 11], [60, 61]))
    torch.cuda.synchronize()
    seen_without = sorted({float(x) for x in kv[:, :, 60].float().unique().tolist()})
    seen_with = sorted({float(x) for x in kv[:, :, 61].float().unique().tolist()})
    detail = (f"swap ok {out.ok}/{with_event.ok}/{back.ok}; without the event it took {seen_without} in "
              f"{1e3 * (t1 - t0):.1f} ms, with it {seen_with} in {1e3 * (t2 - t1):.1f} ms")
    check("without the engine's event the swap took the old bytes (the hazard is real)",
          out.ok and seen_without == [1.0], detail)
    check("with the engine's event the swap took the written bytes", with_event.ok and back.ok and seen_with == [9.0],
          detail)


def gemm_and_swaps(s):
    alone_swap = swap_gbs(s, 5)
    alone_gemm = float(gemm_tflops(5).communicate()[0])
    p = gemm_tflops(6)
    with_gemm = swap_gbs(s, 10)  # covers the GEMM's 6 timed seconds and its process's start
    during = float(p.communicate()[0])
    mode = os.environ.get("KVTD_SCATTER_MODE") or "default"
    print(f"FIGURE [{mode}] swaps alone {alone_swap:.2f} GB/s, beside a bf16 GEMM {with_gemm:.2f} GB/s", flush=True)
    print(f"FIGURE [{mode}] bf16 GEMM alone {alone_gemm:.1f} TFLOP/s, during swaps {during:.1f} TFLOP/s "
          f"({100 * (1 - during / alone_gemm):.1f}% slower)", flush=True)
    check("GEMM interference measured", alone_gemm > 0 and during > 0)


layers, blocks, host_blocks = 4, 256, 64
shape = (blocks, 8, 16, 128)
g = kvtd.Geometry(num_ranks=1, num_layers=layers, key_shape=shape, value_shape=shape, num_host_blocks=host_blocks)
kv = torch.randn(layers, 2, *shape, device="cuda").to(torch.bfloat16)
suffix = f"gpucheck{os.getpid()}"
log = tempfile.NamedTemporaryFile(prefix="kvtd_gpucheck_", suffix=".log", delete=False)
with kvtd.Session(suffix, g) as s:
    for layer in range(layers):
        s.register_torch_tensor(0, layer, "key", kv[layer, 0])
        s.register_torch_tensor(0, layer, "value", kv[layer, 1])
    check("register_torch_tensor (slices of one allocation)", True)
    s.publish()
    mode = ["--scatter-mode", os.environ["KVTD_SCATTER_MODE"]] if os.environ.get("KVTD_SCATTER_MODE") else []
    args = kt.daemon_args(kt.find_binary(), suffix, 0, g, ["--device-backend", "cuda", "--numa-node", "none", *mode])
    daemon = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
    try:
        s.wait_ready(60)
        ref = kv.clone()
        torch.cuda.synchronize()  # no engine event here: the engine synchronises before submitting
        out = s.wait(s.swap_to_host([1, 2, 3, 9, 40], [0, 1, 2, 3, 4]))
        kv[:, :, [1, 2, 3, 9, 40]] = 0
        torch.cuda.synchronize()
        back = s.wait(s.swap_to_device([0, 1, 2, 3, 4], [20, 21, 22, 30, 77]))
        check("swap out and back byte for byte", out.ok and back.ok and
              torch.equal(kv[:, :, [20, 21, 22, 30, 77]], ref[:, :, [1, 2, 3, 9, 40]]))
        kv[:, :, [100, 101]] = 0
        torch.cuda.synchronize()
        tid = s.swap_to_device([0, 1], [100, 101], layerwise=True)
        got = []
        for layer in range(layers):
            s.wait_layer(tid, layer, stage="enqueued")
            torch.cuda.current_stream().wait_event(s.layer_event(0, layer, 0))
            got.append(kv[layer, :, [100, 101]].clone())
        torch.cuda.synchronize()
        s.wait(tid)
        check("layer-by-layer load, the torch stream waiting on each layer's event",
              all(torch.equal(got[layer], ref[layer, :, [1, 2]]) for layer in range(layers)))
        engine_event_orders_the_copy(s, kv)
        gemm_and_swaps(s)
        s.clear_caches()
        reserved = torch.cuda.memory_reserved()
        nbytes = kv.numel() * kv.element_size()
        del kv, ref, got
        torch.cuda.empty_cache()
        freed = reserved - torch.cuda.memory_reserved()
        check("clear_caches returns the KV memory to the device", freed >= nbytes,
              f"{freed >> 20} MiB freed of {nbytes >> 20} MiB")
    except Exception as e:  # noqa: BLE001
        check("torch check", False, repr(e))
    finally:
        daemon.terminate()
        code = daemon.wait(30)
        check("daemon exits 0 on SIGTERM", code == 0, f"exit {code}, log {log.name}")
sys.exit(1 if failures else 0)
