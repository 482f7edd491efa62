"""`kvtd.sglang`: the module_path sglang's HiCache extra config names. This module is
kvtd.engines.sglang.backend itself (one module object under both names, so its classes and state
are one)."""

import sys

from .engines.sglang import backend as _adapter

sys.modules[__name__] = _adapter
