"""vLLM's engine loop around its own offloading connector, for tests: the scheduler side is vLLM's
OffloadingConnectorScheduler (offloading/scheduler.py) and each rank's worker side vLLM's
OffloadingConnectorWorker (offloading/worker.py), both inside kvtd.vllm.KvtdOffloadingConnector;
this file plays only the engine parts that are not vendored (vllm/v1/core/sched/scheduler.py, the
model runner, KVOutputAggregator), making the connector calls in the order they make them:

- a request is added (on_new_request), looked up (get_num_new_matched_tokens), given GPU blocks
  and, on a hit, a load (update_state_after_alloc) it waits for, unscheduled, until every worker
  reported it received (WAITING_FOR_REMOTE_KVS); GPU blocks in invalid_block_ids are recomputed
  (kv_load_failure_policy "recompute": computed tokens cut back to the first invalid block);
- each step: build_connector_meta; per worker, handle_preemptions (the model runner calls it as
  its step starts, gpu_model_runner.py) and then its connector context
  (kv_connector_model_runner_mixin.py:78-112): bind, start_load_kv, the forward pass,
  get_finished, get_block_ids_with_load_errors, build_connector_worker_meta, clear;
  then the outputs of all workers merged (finished_recving once every worker reported it,
  invalid blocks unioned, worker metadata aggregated pairwise) into update_connector_output;
- a finished request: request_finished, then its id in the next step's finished_req_ids.

The "model" writes each token chunk's KV as bytes drawn from (rank, chunk hash), so every byte a
load brings back can be checked against what the model would have computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
import types
from typing import Dict, List, Optional, Set

import torch

import vllm_harness

TOKENS_PER_BLOCK = 16


def chunk_bytes(rank: int, chunk_hash: bytes, nbytes: int) -> torch.Tensor:
    seed = int.from_bytes(hashlib.sha256(bytes([rank]) + chunk_hash).digest()[:8], "little") & ((1 << 63) - 1)
    return torch.randint(-128, 127, (nbytes,), dtype=torch.int8, generator=torch.Generator().manual_seed(seed))


@dataclasses.dataclass
class Request:
    """The fields of vllm/v1/request.py's Request the offloading scheduler reads."""
    request_id: str
    prompt_token_ids: List[int]
    block_hashes: List[bytes] = dataclasses.field(default_factory=list)
    num_computed_tokens: int = 0
    status: object = None
    kv_transfer_params: Optional[dict] = None
    skip_reading_prefix_cache: bool = False
    lora_request: object = None

    def __post_init__(self):
        self.status = vllm_harness.RequestStatus.WAITING
        parent = b""
        for i in range(len(self.prompt_token_ids) // TOKENS_PER_BLOCK):  # chained, as vLLM hashes blocks
            toks = self.prompt_token_ids[i * TOKENS_PER_BLOCK:(i + 1) * TOKENS_PER_BLOCK]
            parent = hashlib.sha256(parent + repr(toks).encode()).digest()[:16]
            self.block_hashes.append(parent)

    @property
    def all_token_ids(self):
        return self.prompt_token_ids

    @property
    def num_prompt_tokens(self):
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self):
        return len(self.prompt_token_ids)

    def is_finished(self):
        return self.status.name.startswith("FINISHED")


@dataclasses.dataclass
class Block:
    """vllm/v1/core/kv_cache_utils.py's KVCacheBlock, as a fresh allocation (no hash yet)."""
    block_id: int
    block_hash: Optional[bytes] = None
    is_null: bool = False


def scheduler_output(new=(), finished=()):
    """SchedulerOutput (vllm/v1/core/sched/output.py): the new requests scheduled this step with
    their blocks and token counts, and the ids of requests that finished before it."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r.request_id,
                                                  block_ids=tuple(b) if isinstance(b, tuple) else (list(b),))
                            for r, b, _ in new],
        scheduled_cached_reqs=types.SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set()),
        num_scheduled_tokens={r.request_id: n for r, _, n in new}, finished_req_ids=set(finished),
        preempted_req_ids=set(), partial_tail_offloads=None)


def vllm_config(world: int):
    return types.SimpleNamespace(speculative_config=None, cache_config=types.SimpleNamespace(enable_prefix_caching=True),
                                 parallel_config=types.SimpleNamespace(world_size=world,
                                                                       decode_context_parallel_size=1))


def kv_cache_config(layer_names, num_blocks=0, spec=None):
    """The scheduler's KVCacheConfig: one full-attention group of `layer_names` (vLLM's KV cache
    interface stand-ins, vllm_kv_cache_specs.py). `new` blocks per request: a list (one group) or a
    tuple of lists, one per KV cache group."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    if spec is None:
        spec = FullAttentionSpec(block_size=TOKENS_PER_BLOCK, num_kv_heads=1, head_size=64, dtype=torch.bfloat16)
    tensors = [KVCacheTensor(size=num_blocks * spec.page_size_bytes, shared_by=[n]) for n in layer_names]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=tensors,
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layer_names), kv_cache_spec=spec)])


class Engine:
    """One engine over `ranks` (objects with .rank, .connector (vLLM's OffloadingConnectorWorker),
    .tensors (the rank's KV tensors, one row per GPU block)); `spec` is the scheduler process's."""

    def __init__(self, spec, ranks, num_gpu_blocks: int, layer_names, config=None):
        """`config`: the scheduler's KVCacheConfig (default: one full-attention group of
        `layer_names`)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.scheduler import OffloadingConnectorScheduler
        from kvtd.vllm import KvtdOffloadingConnector
        self.ranks = ranks
        self.scheduler = self._shell(KvtdOffloadingConnector)
        self.scheduler.connector_scheduler = OffloadingConnectorScheduler(spec, vllm_config(len(ranks)),
                                                                          config or kv_cache_config(layer_names))
        self.workers = []
        for r in ranks:
            w = self._shell(KvtdOffloadingConnector)
            w.connector_worker = r.connector
            self.workers.append(w)
        self.free_gpu = list(range(1, num_gpu_blocks))  # block 0 is vLLM's null block
        self.recomputed_blocks: Set[int] = set()
        self.events: List[object] = []
        self._finished: Set[str] = set()
        self._recv_counts: Dict[str, int] = {}

    @staticmethod
    def _shell(cls):
        c = object.__new__(cls)  # its __init__ builds the config from a whole VllmConfig
        c.connector_scheduler = c.connector_worker = None
        c._connector_metadata = None
        return c

    @property
    def manager(self):
        return self.scheduler.connector_scheduler.manager

    def step(self, new=(), forward=lambda rank: None):
        """One engine step; returns (finished_recving, invalid_block_ids) merged over the workers."""
        out = scheduler_output(new, self._finished)
        self._finished = set()
        meta = self.scheduler.build_connector_meta(out)
        recving = self._recv_counts  # across steps: each worker reports a request once
        invalid: Set[int] = set()
        worker_meta = None
        for rank, w in zip(self.ranks, self.workers):
            w.handle_preemptions(meta)
            w.bind_connector_metadata(meta)
            w.start_load_kv(None)
            forward(rank)
            for req_id in w.get_finished(out.finished_req_ids)[1]:
                recving[req_id] = recving.get(req_id, 0) + 1
            invalid |= w.get_block_ids_with_load_errors()
            m = w.build_connector_worker_meta()
            if m is not None:
                worker_meta = m if worker_meta is None else worker_meta.aggregate(m)
            w.clear_connector_metadata()
        done = {r for r, n in recving.items() if n == len(self.workers)}
        for r in done:
            del recving[r]
        self.scheduler.update_connector_output(types.SimpleNamespace(
            kv_connector_worker_meta=worker_meta, finished_recving=done, finished_sending=set(),
            invalid_block_ids=invalid))
        self.events += list(self.scheduler.take_events())
        return done, invalid

    def idle_until(self, pred, what: str, timeout: float = 30.0, step=None):
        """Steps with nothing scheduled (has_pending_push_work keeps vLLM stepping) until pred()."""
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine: {what} did not happen in {timeout} s")
            (step or self.step)()
            time.sleep(0.002)

    def matched(self, req: Request):
        """on_new_request, then get_num_new_matched_tokens until it settles: (hit tokens, async)."""
        sched = self.scheduler
        sched.on_new_request(req)
        # None: the connector needs more time; vLLM asks again in a later step.
        hit, load_async = sched.get_num_new_matched_tokens(req, 0)
        for _ in range(3000):
            if hit is not None:
                return hit or 0, load_async
            self.step()
            time.sleep(0.002)
            hit, load_async = sched.get_num_new_matched_tokens(req, 0)
        raise TimeoutError(f"engine: the lookup of {req.request_id} never settled")

    def wait_loaded(self, req: Request):
        """Steps until every worker reported `req`'s load; returns the GPU blocks vLLM was told to
        recompute (invalid_block_ids)."""
        received, invalid = set(), set()

        def step():
            got, bad = self.step()
            received.update(got)
            invalid.update(bad)

        self.idle_until(lambda: req.request_id in received, f"the load of {req.request_id}", step=step)
        return invalid

    def serve(self, req: Request) -> int:
        """Runs `req` to completion as vLLM's scheduler does; returns the tokens loaded from the
        offload tier (0 on a miss), recomputing any GPU block a load could not fill."""
        sched = self.scheduler
        hit, load_async = self.matched(req)
        n_blocks = -(-req.num_prompt_tokens // TOKENS_PER_BLOCK)
        blocks = [self.free_gpu.pop(0) for _ in range(n_blocks)]
        if hit:
            assert load_async
            sched.update_state_after_alloc(req, types.SimpleNamespace(blocks=([Block(b) for b in blocks],)), hit)
            req.status = vllm_harness.RequestStatus.WAITING_FOR_REMOTE_KVS
            invalid = self.wait_loaded(req)
            # A whole-prompt hit still computes the last token (the engine scheduler's
            # _update_waiting_for_remote_kv), so that the step has logits to sample from.
            req.num_computed_tokens = min(hit, req.num_tokens - 1)
            bad = [i for i, b in enumerate(blocks) if b in invalid]
            if bad:  # recompute from the first block the load did not fill
                req.num_computed_tokens = min(req.num_computed_tokens, bad[0] * TOKENS_PER_BLOCK)
                self.recomputed_blocks.update(blocks[bad[0]:hit // TOKENS_PER_BLOCK])
        req.status = vllm_harness.RequestStatus.RUNNING
        first = req.num_computed_tokens // TOKENS_PER_BLOCK
        to_compute = req.num_prompt_tokens - req.num_computed_tokens

        def forward(rank):  # the model computes the scheduled tokens' KV, on this worker's rank
            for i in range(first, min(n_blocks, len(req.block_hashes))):
                rank.write_block(blocks[i], chunk_bytes(rank.rank, req.block_hashes[i], rank.block_bytes))

        self.step(new=[(req, blocks, to_compute)], forward=forward)
        req.num_computed_tokens = req.num_prompt_tokens
        req.status = vllm_harness.RequestStatus.FINISHED_STOPPED
        sched.request_finished(req, blocks)
        self._finished.add(req.request_id)
        self.last_blocks = blocks
        self.free_gpu.extend(blocks)  # freed at once, as vLLM does: reuse is fenced by jobs_to_flush
        self.idle_until(lambda: not sched.has_pending_push_work(), f"the stores of {req.request_id}")
        return hit
