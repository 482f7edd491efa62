"""KV events from the daemons, received with a real ZeroMQ SUB socket (pyzmq)
and decoded with Debian's python3-msgpack, checked against vLLM's own layout:
vllm/distributed/kv_events.py (vllm-project/vllm 0181ea3173e5) - EventBatch(ts, events,
data_parallel_rank=None) and tagged events without array_like, so each event is a map whose
"type" is the class name; BlockStored(block_hashes, parent_block_hash, token_ids, block_size,
lora_id, medium, lora_name, ...defaults omitted); BlockRemoved(block_hashes, medium, ...);
AllBlocksCleared(). Medium STORAGE and locality LOCAL / REMOTE as vLLM main 017e9f44 names a
storage tier (kv_events.py:45-47, 76, 101; locality is a default-None field, so written in the map
layout only). The older array_like layout (commit b4e69e0af33f: arrays, the class name
first) is --kv-events-format array. Frames as ZmqEventPublisher._publisher_thread sends them:
(topic, 8-byte big-endian sequence number, payload)."""

from __future__ import annotations

import time

import pytest

from conftest import small_geometry

msgpack = pytest.importorskip("msgpack")
zmq = pytest.importorskip("zmq")


class Subscriber:
    def __init__(self, endpoint, topic=b""):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        time.sleep(0.5)  # ZeroMQ's slow joiner: the subscription must reach the publisher first

    def batches(self, until, timeout_s=10.0):
        """(topic, seq, batch) until `until(all so far)` holds; fails on timeout."""
        got = []
        deadline = time.monotonic() + timeout_s
        while not until(got):
            left = deadline - time.monotonic()
            assert left > 0, f"no more KV events; got {got}"
            if self.sock.poll(int(left * 1000)):
                topic, seq, payload = self.sock.recv_multipart()
                assert len(seq) == 8
                got.append((topic, int.from_bytes(seq, "big"), msgpack.unpackb(payload, raw=False)))
        return got

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def events_of(batches, fmt="map"):
    out = []
    for _, _, b in batches:
        out.extend(b["events"] if fmt == "map" else b[1])
    return out


def fill(s, g):
    import torch
    for r in range(g.num_ranks):
        for layer in range(g.num_layers):
            for k in ("key", "value"):
                t = s.host_tensor(r, layer, k, dtype=torch.uint8)
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))


def store_flags(tmp_path, endpoint, *more):
    return ["--storage-backend", "file", "--storage-path", str(tmp_path / "store"), "--model-id", "ev",
            "--kv-events-endpoint", endpoint, *more]


def test_stored_evicted_and_cleared_events_in_vllms_map_layout(cluster, tmp_path):
    endpoint = f"ipc://{tmp_path}/events.sock"
    # Objects of 768 payload bytes: a capacity of ~6 objects makes the LRU evict. Both ranks get
    # the flags; rank 0 publishes, rank 1 says so in its log.
    c = cluster(extra=store_flags(tmp_path, endpoint, "--storage-capacity-gib", "0.000005"))
    s = c.ready()
    fill(s, c.geometry)
    sub = Subscriber(endpoint)
    try:
        assert s.wait(s.storage_write(["1001", "1002", "1003", "1004"], [1, 2, 3, 4])).ok
        got = sub.batches(lambda b: len(events_of(b)) >= 1)
        topic, seq, batch = got[0]
        assert topic == b"" and seq == 0
        assert set(batch) == {"ts", "events", "data_parallel_rank"}
        assert isinstance(batch["ts"], float) and abs(batch["ts"] - time.time()) < 60
        assert batch["data_parallel_rank"] == 0
        stored = batch["events"][0]
        # Rank 0 speaks for the group: one event, not one per rank.
        assert stored == {"type": "BlockStored", "block_hashes": [1001, 1002, 1003, 1004], "parent_block_hash": None,
                          "token_ids": [], "block_size": 4, "lora_id": None, "medium": "STORAGE", "lora_name": None,
                          "locality": "LOCAL"}
        assert list(stored)[0] == "type"  # msgspec writes the tag first

        # Keys that are not decimal integers go out as their bytes (ExternalBlockHash = bytes | int).
        more = [f"pfx:{i:02d}" for i in range(8)]
        assert s.wait(s.storage_write(more, list(range(5, 13)))).ok
        got += sub.batches(lambda b: any(e["type"] == "BlockRemoved" for e in events_of(b)) and
                           any(e["type"] == "BlockStored" and b"pfx:07" in e["block_hashes"] for e in events_of(b)))
        removed = [h for e in events_of(got) if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert all(e["medium"] == "STORAGE" and e["locality"] == "LOCAL"
                   for e in events_of(got) if e["type"] == "BlockRemoved")
        assert 1001 in removed, removed  # the least recently used went first
        assert all(isinstance(h, (int, bytes)) for h in removed)

        # A new weight version: nothing stored before is reachable, routers are told.
        s.set_weight_version(7)
        assert s.wait(s.storage_query(["1001"])).blocks_done == 0
        got += sub.batches(lambda b: any(e["type"] == "AllBlocksCleared" for e in events_of(b)))
        assert {"type": "AllBlocksCleared"} in events_of(got)
        assert [seq for _, seq, _ in got] == list(range(len(got)))  # consecutive, none lost
        logs = c.daemons.logs()
        assert "KV events (map layout, medium STORAGE, locality LOCAL)" in logs and "rank 0 of this group publishes them" in logs
    finally:
        sub.close()


def test_array_layout_and_topic_for_older_subscribers(cluster, tmp_path):
    endpoint = f"ipc://{tmp_path}/events.sock"
    c = cluster(extra=store_flags(tmp_path, endpoint, "--kv-events-format", "array", "--kv-events-topic", "kv@w0",
                                  "--kv-events-medium", "SSD"))
    s = c.ready()
    fill(s, c.geometry)
    sub = Subscriber(endpoint, topic=b"kv@")
    try:
        assert s.wait(s.storage_write(["77", "-5", "007"], [1, 2, 3])).ok
        topic, seq, batch = sub.batches(lambda b: len(b) >= 1)[0]
        assert topic == b"kv@w0" and seq == 0
        ts, events, dp_rank = batch
        assert isinstance(ts, float) and dp_rank == 0
        # "-5" is a decimal integer; "007" is not how an integer prints, so it stays bytes.
        assert events == [["BlockStored", [77, -5, b"007"], None, [], 4, None, "SSD", None]]
    finally:
        sub.close()


def test_a_stalled_or_absent_subscriber_never_holds_a_task(cluster, tmp_path):
    endpoint = f"ipc://{tmp_path}/events.sock"
    c = cluster(extra=store_flags(tmp_path, endpoint))
    s = c.ready()
    fill(s, c.geometry)
    # No subscriber at all: 100 writes.
    for i in range(100):
        assert s.wait(s.storage_write([f"a{i}"], [1 + i % 20]), timeout=5).ok
    # A subscriber that never reads, with the smallest queue ZeroMQ allows.
    ctx = zmq.Context()
    stalled = ctx.socket(zmq.SUB)
    stalled.setsockopt(zmq.RCVHWM, 1)
    stalled.setsockopt(zmq.RCVBUF, 4096)
    stalled.setsockopt(zmq.SUBSCRIBE, b"")
    stalled.connect(endpoint)
    time.sleep(0.3)
    for i in range(300):
        assert s.wait(s.storage_write([f"b{i}"], [1 + i % 20]), timeout=5).ok
    # The publisher is still alive: a new subscriber gets the next events.
    sub = Subscriber(endpoint)
    try:
        assert s.wait(s.storage_write(["4242"], [1])).ok
        got = sub.batches(lambda b: any(4242 in e.get("block_hashes", []) for e in events_of(b)))
        assert got
    finally:
        sub.close()
        stalled.close(linger=0)
        ctx.term()


def test_gc_tells_routers_only_of_keys_that_are_gone(cluster, tmp_path):
    """A gc that keeps weight version 2 sent BlockRemoved for keys that version 2
    had stored again, so a router replaying the stream lost keys that were still there. Only keys
    with no object left are announced now."""
    import kvtd.control

    endpoint = f"ipc://{tmp_path}/events.sock"
    c = cluster(extra=store_flags(tmp_path, endpoint))
    s = c.ready()
    fill(s, c.geometry)
    sub = Subscriber(endpoint)
    try:
        assert s.wait(s.storage_write(["501", "502"], [1, 2])).ok  # weight version 0
        s.set_weight_version(2)
        assert s.wait(s.storage_write(["501"], [3])).ok  # 501 stored again for version 2
        got = sub.batches(lambda b: sum(e["type"] == "BlockStored" for e in events_of(b)) >= 2)
        reports = kvtd.control.storage_gc(c.suffix, 2)
        assert sum(r["removed"] for r in reports) == 2 * c.geometry.num_ranks  # 501 and 502 of version 0
        got += sub.batches(lambda b: any(e["type"] == "BlockRemoved" for e in events_of(b)))
        removed = [h for e in events_of(got) if e["type"] == "BlockRemoved" for h in e["block_hashes"]]
        assert removed == [502], removed
        s.set_weight_version(2)
        assert s.wait(s.storage_query(["501"])).blocks_done == 1  # still there, as the router believes
    finally:
        sub.close()
