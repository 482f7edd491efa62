"""GPU ordering of kvtd.vllm's swaps, as vLLM's own CPU worker orders its transfers.

vLLM's CPU worker makes its copy stream wait on the compute stream before every transfer
(vllm/v1/kv_offload/cpu/gpu_worker.py:636-641 at main 017e9f44: "Stores must wait for the model to
finish writing the KV they read. Loads must wait for pending writes ... to their destination
blocks"). On the H100 a kvtd swap submitted without the engine's event took the old bytes in
0.4-2.5 ms (docs/gpu-runs). So the worker records an interprocess event on the current stream of
its KV's device before each submit, and its daemon's copy waits for it on the GPU.

No GPU here: the KV is host memory (the host backend), torch.cuda's Event and current_stream are
recorders, and the daemon is handed each swap without the handles (a host daemon has no stream to
wait on). What is checked is the adapter's part: every store and load got an event recorded on the
current stream of the KV's device right before its submit, the handle in this rank's place. The
GPU half (the bytes stored are the ones the model wrote) is the vLLM step of the gpu-check.
"""

from __future__ import annotations

import os

import pytest
import torch

import vllm_harness
from test_vllm_engine import close, engine_of, prompt
from vllm_engine import Request

pytestmark = pytest.mark.skipif(vllm_harness.vllm_source() is None, reason=vllm_harness.skip_reason())

HANDLE_BYTES = 64


class RecordedEvent:
    """torch.cuda.Event's part kvtd.vllm uses, recording what it was asked."""

    def __init__(self, calls, interprocess=False, **kwargs):
        assert interprocess, "a daemon opens the engine's event by its IPC handle"
        self.calls = calls
        self.handle = os.urandom(HANDLE_BYTES)

    def record(self, stream):
        self.calls.append(("record", stream, self))

    def ipc_handle(self):
        return self.handle


def spy_on_swaps(monkeypatch, rank, calls):
    """Each swap of `rank`'s session is noted with the events it was given, then submitted without
    them (the host daemon has no stream)."""
    session = rank.connector.worker._session
    for name in ("swap_to_host", "swap_to_device"):
        real = getattr(session, name)

        def spy(*args, _real=real, _name=name, engine_events=None, **kwargs):
            calls.append((_name, rank.rank, engine_events))
            return _real(*args, **kwargs)

        monkeypatch.setattr(session, name, spy)


def test_every_store_and_load_waits_for_the_gpu_work_queued_before_it(monkeypatch):
    """Fails on the old code: no swap was given an event."""
    engine = engine_of(world=2)
    calls = []
    try:
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: RecordedEvent(calls, **kw))
        monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: ("current stream", device))
        for rank in engine.ranks:
            rank.connector.worker._device = 4 + rank.rank  # the KV's CUDA ordinal, as on a GPU
            spy_on_swaps(monkeypatch, rank, calls)
        tokens = prompt(7, 3)
        assert engine.serve(Request("o1", tokens)) == 0
        assert engine.serve(Request("o2", tokens)) == 3 * 16
        swaps = [i for i, c in enumerate(calls) if c[0].startswith("swap")]
        assert {calls[i][0] for i in swaps} == {"swap_to_host", "swap_to_device"}, calls
        for i in swaps:
            kind, rank, handles = calls[i]
            assert i > 0 and calls[i - 1][0] == "record", f"{kind} of rank {rank} submitted without an event"
            _, stream, event = calls[i - 1]
            assert stream == ("current stream", 4 + rank), "recorded on the current stream of the KV's device"
            assert handles is not None and len(handles) == 2, handles
            assert handles[rank] == event.handle
            assert handles[1 - rank] == bytes(HANDLE_BYTES), "the other rank's place: its own session's"
    finally:
        close(engine)


def test_host_kv_swaps_carry_no_event(monkeypatch):
    """KV in host memory (the host backend) has no stream to order: no event is made."""
    engine = engine_of(world=1)
    calls = []
    try:
        monkeypatch.setattr(torch.cuda, "Event", lambda **kw: pytest.fail("an event for host KV"))
        spy_on_swaps(monkeypatch, engine.ranks[0], calls)
        tokens = prompt(8, 2)
        engine.serve(Request("h1", tokens))
        assert engine.serve(Request("h2", tokens)) == 2 * 16
        assert calls and all(handles is None for _, _, handles in calls), calls
    finally:
        close(engine)
