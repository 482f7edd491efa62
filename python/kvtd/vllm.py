"""`kvtd.vllm`: the kv_connector_module_path and spec_module_path vLLM's configs name. This module
is kvtd.engines.vllm.spec itself (one module object under both names, so its classes and state are
one)."""

import sys

from .engines.vllm import spec as _adapter

sys.modules[__name__] = _adapter
