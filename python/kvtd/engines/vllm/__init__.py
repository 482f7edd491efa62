"""vLLM's KV offloading through kvtd: spec.py is the OffloadingSpec and connector vLLM's
factories load (as kvtd.vllm); manager.py the scheduler's CPU-tier manager; storage.py the
storage tier.

Written against vLLM main 017e9f44 (../shared/reference/vllm/PROVENANCE).
"""

UPSTREAM = "vLLM main 017e9f44"
