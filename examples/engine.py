#!/usr/bin/env python3
"""A small engine loop over kvtd: a paged KV cache in torch tensors, an LRU prefix cache that
evicts to host memory and reloads on a hit, layer-by-layer loads, and a byte check.

Each request is a prefix shared with other requests (one of a few "system prompts") plus a few
blocks of its own. A block's KV is a pure function of (block key, rank, layer, tensor), so every
byte the engine reads can be checked. Per request the engine
  1. finds each block on the device (hit), in the host tier (reload) or nowhere (compute),
  2. makes room by evicting least-recently-used device blocks to host blocks (SWAP_TO_HOST),
  3. reloads host hits with one layer-by-layer SWAP_TO_DEVICE and runs "attention" on layer l
     as soon as layer l has arrived on every rank (wait_layer), while later layers still copy,
  4. checks every byte of the request's blocks on every rank and layer.
With --storage-path the daemons also keep a file store (write_through): evicted blocks are
backed up, and blocks that fell out of the host tier are found there (STORAGE_QUERY) and read
straight into device blocks (STORAGE_READ).

Runs on the host backend (the "device" tensors are shared memory made by the session; on a GPU
they would be CUDA tensors registered with Session.register_torch_tensor). By default it starts
its own kvtd daemons; --no-spawn attaches to daemons already running with the same flags.

    PYTHONPATH=python /usr/bin/python3 examples/engine.py --requests 200
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import zlib

try:
    import kvtd
except ImportError:  # in-tree use without PYTHONPATH
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))
    import kvtd

import kvtd.testing
import torch

KINDS = (kvtd.KEY, kvtd.VALUE)


class Engine:
    def __init__(self, s: kvtd.Session, g: kvtd.Geometry, storage: bool):
        self.s, self.g, self.storage = s, g, storage
        self.layers = g.num_layers
        # Byte views of every "device" tensor: [blocks, bytes per block].
        self.dev = {}
        for r in range(g.num_ranks):
            for layer in range(self.layers):
                for k in KINDS:
                    bb = g.block_bytes(k)
                    self.dev[r, layer, k] = s.host_tensor(r, layer, k, dtype=torch.uint8).view(-1, bb)
        self.block_bytes = g.block_bytes(kvtd.KEY)
        self.ramp = torch.arange(self.block_bytes, dtype=torch.int64)
        self.free_dev = list(range(int(g.key_shape[0])))
        self.free_host = list(range(g.num_host_blocks))
        self.on_dev = collections.OrderedDict()   # key -> device block (LRU order)
        self.on_host = collections.OrderedDict()  # key -> host block (LRU order)
        self.host_backup = {}                     # host block -> backup task id (write_through)
        self.backups_done = set()                 # backup ids already waited for
        self.stats = collections.Counter()

    # -- the model: what a block holds -----------------------------------------------------
    def pattern(self, key: str, r: int, layer: int, k: int) -> torch.Tensor:
        seed = zlib.crc32(f"{key}/{r}/{layer}/{k}".encode())
        return (((self.ramp * 2654435761 + seed) >> 7) & 0xFF).to(torch.uint8)

    def compute(self, key: str, block: int) -> None:
        for (r, layer, k), t in self.dev.items():
            t[block].copy_(self.pattern(key, r, layer, k))
        self.stats["computed"] += 1

    def attend(self, layer: int, blocks) -> None:
        """'Attention' over one layer: reads (and checks) every byte of the request's blocks."""
        for key, block in blocks:
            for r in range(self.g.num_ranks):
                for k in KINDS:
                    if not torch.equal(self.dev[r, layer, k][block], self.pattern(key, r, layer, k)):
                        raise SystemExit(f"byte check FAILED: block {key} (device block {block}) rank {r} "
                                         f"layer {layer} kind {k}")
                    self.stats["bytes_checked"] += self.block_bytes

    # -- tiers -------------------------------------------------------------------------------
    def host_block(self, keep) -> int:
        if not self.free_host:
            victim = next(k for k in self.on_host if k not in keep)
            hb = self.on_host.pop(victim)
            self.stats["host_dropped"] += 1
            self.free_host.append(hb)
        hb = self.free_host.pop()
        backup = self.host_backup.pop(hb, None)
        if backup is not None and backup not in self.backups_done:
            # The backup reads this host block (and others evicted with it): let it finish first.
            r = self.s.wait(backup, check=False)
            self.backups_done.add(backup)
            self.stats["backed_up"] += r.blocks_done
        return hb

    def make_room(self, need: int, keep) -> None:
        """Evicts LRU device blocks (not in `keep`) until `need` are free."""
        victims = []
        while len(self.free_dev) + len(victims) < need:
            key = next(k for k in self.on_dev if k not in keep and k not in victims)
            victims.append(key)
        if not victims:
            return
        dev_ids = [self.on_dev[k] for k in victims]
        host_ids = []
        for key in victims:
            if key in self.on_host:  # already has a host copy: reuse it, nothing to copy for it
                host_ids.append(None)
            else:
                host_ids.append(self.host_block(keep))
        pairs = [(d, h, key) for d, h, key in zip(dev_ids, host_ids, victims) if h is not None]
        if pairs:
            keys = [key for _, _, key in pairs] if self.storage else None
            tid = self.s.swap_to_host([d for d, _, _ in pairs], [h for _, h, _ in pairs], keys=keys)
            self.s.wait(tid)
            if keys:
                for _, h, _ in pairs:
                    self.host_backup[h] = tid + 1
            for d, h, key in pairs:
                self.on_host[key] = h
            self.stats["evicted"] += len(pairs)
        for key, d in zip(victims, dev_ids):
            del self.on_dev[key]
            self.free_dev.append(d)

    def serve(self, blocks) -> None:
        keep = set(blocks)
        hits = [k for k in blocks if k in self.on_dev]
        reload = [k for k in blocks if k not in self.on_dev and k in self.on_host]
        missing = [k for k in blocks if k not in self.on_dev and k not in self.on_host]
        self.stats["device_hits"] += len(hits)
        self.make_room(len(reload) + len(missing), keep)
        for k in hits:
            self.on_dev.move_to_end(k)
        placed = {k: self.on_dev[k] for k in hits}

        load_id = None
        if reload:
            dev_ids = [self.free_dev.pop() for _ in reload]
            load_id = self.s.swap_to_device([self.on_host[k] for k in reload], dev_ids, layerwise=True)
            for k, d in zip(reload, dev_ids):
                placed[k] = d
                self.on_host.move_to_end(k)
            self.stats["host_hits"] += len(reload)

        if missing and self.storage:
            # The longest stored prefix of the missing blocks, read straight into device blocks.
            q = self.s.wait(self.s.storage_query(missing))
            found = missing[: q.blocks_done]
            if found:
                dev_ids = [self.free_dev.pop() for _ in found]
                r = self.s.wait(self.s.storage_read(found, dev_ids))
                for k, d in zip(found[: r.blocks_done], dev_ids):
                    placed[k] = d
                for d in dev_ids[r.blocks_done:]:
                    self.free_dev.append(d)
                self.stats["storage_hits"] += r.blocks_done
            missing = [k for k in missing if k not in placed]

        for k in missing:
            d = self.free_dev.pop()
            self.compute(k, d)
            placed[k] = d

        for k in blocks:
            self.on_dev[k] = placed[k]
            self.on_dev.move_to_end(k)

        # Attention layer by layer: layer l starts once layer l of the reload has arrived.
        ordered = [(k, placed[k]) for k in blocks]
        for layer in range(self.layers):
            if load_id is not None:
                t0 = time.perf_counter()
                self.s.wait_layer(load_id, layer, timeout=30)
                self.stats["layer_wait_us"] += int((time.perf_counter() - t0) * 1e6)
            self.attend(layer, ordered)
        if load_id is not None:
            self.s.wait(load_id)
        self.stats["requests"] += 1


def requests(n: int, families: int, seed: int):
    import random

    rnd = random.Random(seed)
    for i in range(n):
        fam = min(int(rnd.paretovariate(1.2)) - 1, families - 1)
        prefix = [f"sys{fam}.b{j}" for j in range(4 + fam % 5)]
        yield prefix + [f"req{i}.b{j}" for j in range(rnd.randint(1, 3))]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--device-blocks", type=int, default=24)
    ap.add_argument("--host-blocks", type=int, default=64)
    ap.add_argument("--block-shape", default="2,16,32", help="kv_heads,block_size,head_dim")
    ap.add_argument("--requests", type=int, default=100)
    ap.add_argument("--families", type=int, default=12, help="distinct shared prefixes")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--session", default=f"engine_py_{os.getpid()}")
    ap.add_argument("--storage-path", default="", help="give the daemons a file store (write_through)")
    ap.add_argument("--no-spawn", action="store_true", help="attach to daemons already running")
    ap.add_argument("--kvtd", default=None, help="kvtd binary (default: $KVTD_BINARY or the in-tree build)")
    args = ap.parse_args(argv)

    heads, bsize, hdim = (int(v) for v in args.block_shape.split(","))
    if args.device_blocks < 12 or args.host_blocks < 12:
        ap.error("--device-blocks and --host-blocks must each hold the largest request (12 blocks)")
    shape = (args.device_blocks, heads, bsize, hdim)
    g = kvtd.Geometry(num_ranks=args.ranks, num_layers=args.layers, key_shape=shape, value_shape=shape,
                      num_host_blocks=args.host_blocks, dtype="bfloat16")
    extra = ["--storage-backend", "file", "--storage-path", args.storage_path, "--model-id", "engine-example",
             "--write-policy", "write_through"] if args.storage_path else []
    daemons = None if args.no_spawn else kvtd.testing.Daemons(args.kvtd, args.session, g, extra).start()
    try:
        with kvtd.Session(args.session, g) as s:
            s.create_host_device_tensors()
            s.publish()
            s.wait_ready(30)
            eng = Engine(s, g, bool(args.storage_path))
            t0 = time.perf_counter()
            for blocks in requests(args.requests, args.families, args.seed):
                eng.serve(blocks)
            elapsed = time.perf_counter() - t0
            st = eng.stats
            print(f"requests {st['requests']} in {elapsed:.2f} s: device hits {st['device_hits']}, "
                  f"host reloads {st['host_hits']}, storage reads {st['storage_hits']}, computed {st['computed']}, "
                  f"evicted {st['evicted']}, dropped from host {st['host_dropped']}, backed up {st['backed_up']}")
            if st["host_hits"]:
                print(f"layer-by-layer: {st['layer_wait_us'] / max(1, st['requests']):.0f} us waited per request")
            print(f"byte check: OK ({st['bytes_checked'] / 2**20:.1f} MiB read back and checked)")
    finally:
        if daemons is not None:
            codes = daemons.stop()
            if any(c != 0 for c in codes):
                print(f"daemon exit codes {codes}\n{daemons.logs()}", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
