"""vllm_engine.Engine for a hybrid model: several KV cache groups, one of them a sliding window,
the way vLLM's hybrid KV cache manager hands their blocks to the offloading connector.

What differs from one group (vllm/v1/core/single_type_kv_cache_manager.py, not vendored; the
offloading scheduler's reading of it is in offloading/scheduler.py:993-1101):
- every group gets its own GPU blocks from one block pool, so a block id is one group's;
- on a hit, a sliding-window group's blocks before the window (at the hit's end), and a Mamba
  group's before its last, are vLLM's null block (block id 0, is_null), which the connector skips; the scheduler asserts at most the
  window's chunks plus one are loaded into it (scheduler.py:1043-1048);
- SchedulerOutput names a request's blocks as one list per group.

The "model" writes each group's chunk as bytes drawn from (rank, chunk hash, group), so a group's
block loaded with another group's bytes is caught.
"""

from __future__ import annotations

import types
from typing import List, Optional

import vllm_harness
from vllm_engine import TOKENS_PER_BLOCK, Block, Engine, Request, chunk_bytes


def window_blocks(config) -> List[Optional[int]]:
    """Per KV cache group of `config`: the blocks a hit needs at its end, as the offloading
    scheduler counts them (scheduler.py:109-127): a sliding window's (rounded up), a Mamba state's
    one, None for full attention."""
    from vllm.v1.kv_cache_interface import MambaSpec, SlidingWindowSpec
    out = []
    for g in config.kv_cache_groups:
        spec = g.kv_cache_spec
        out.append(-(-spec.sliding_window // TOKENS_PER_BLOCK) if isinstance(spec, SlidingWindowSpec)
                   else 1 if isinstance(spec, MambaSpec) else None)
    return out


class HybridEngine(Engine):
    """One engine over ranks whose KV holds several groups (`config`, the scheduler's
    KVCacheConfig). Each rank has .rank, .connector, .block_bytes and .write_block(b, data)."""

    def __init__(self, spec, ranks, num_gpu_blocks: int, config):
        super().__init__(spec, ranks, num_gpu_blocks, [], config=config)
        self.windows = window_blocks(config)
        # Called with (request, blocks per group, hit tokens) once a load is in, before the model
        # runs (which recomputes the hit's last token, rewriting its block).
        self.on_loaded = None

    def group_bytes(self, rank, chunk_hash: bytes, group: int):
        return chunk_bytes(rank.rank, chunk_hash + bytes([group]), rank.block_bytes)

    def serve(self, req: Request) -> int:
        """Runs `req` to completion; returns the hit tokens."""
        sched = self.scheduler
        hit, load_async = self.matched(req)
        n_blocks = -(-req.num_prompt_tokens // TOKENS_PER_BLOCK)
        hit_blocks = -(-hit // TOKENS_PER_BLOCK)
        groups = []
        for window in self.windows:
            blocks = []
            for i in range(n_blocks):
                skipped = hit and window is not None and i < hit_blocks - window
                blocks.append(Block(0, is_null=True) if skipped else Block(self.free_gpu.pop(0)))
            groups.append(blocks)
        if hit:
            assert load_async
            sched.update_state_after_alloc(req, types.SimpleNamespace(blocks=tuple(groups)), hit)
            req.status = vllm_harness.RequestStatus.WAITING_FOR_REMOTE_KVS
            invalid = self.wait_loaded(req)
            assert not invalid, f"loads failed into GPU blocks {sorted(invalid)}"
            if self.on_loaded is not None:
                self.on_loaded(req, groups, hit)
            req.num_computed_tokens = min(hit, req.num_tokens - 1)
        req.status = vllm_harness.RequestStatus.RUNNING
        first = req.num_computed_tokens // TOKENS_PER_BLOCK

        def forward(rank):
            for g, blocks in enumerate(groups):
                for i in range(first, min(n_blocks, len(req.block_hashes))):
                    if not blocks[i].is_null:
                        rank.write_block(blocks[i].block_id, self.group_bytes(rank, req.block_hashes[i], g))

        ids = tuple([b.block_id for b in blocks] for blocks in groups)
        self.step(new=[(req, ids, req.num_prompt_tokens - req.num_computed_tokens)], forward=forward)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = vllm_harness.RequestStatus.FINISHED_STOPPED
        sched.request_finished_all_groups(req, ids)  # vLLM calls this one with KV cache groups
        self._finished.add(req.request_id)
        self.last_groups = groups
        self.free_gpu.extend(b.block_id for blocks in groups for b in blocks if not b.is_null)
        self.idle_until(lambda: not sched.has_pending_push_work(), f"the stores of {req.request_id}")
        return hit
