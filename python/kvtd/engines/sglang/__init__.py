"""sglang's HiCache L3 through kvtd: backend.py is the HiCacheStorage its StorageBackendFactory
loads (as kvtd.sglang); layout.py maps its host-pool layouts to kvtd's tensors.

Written against sglang v0.5.18 (../shared/reference/sglang/PROVENANCE).
"""

UPSTREAM = "sglang v0.5.18"
