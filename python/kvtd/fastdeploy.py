"""`kvtd.fastdeploy`: the name FastDeploy's v0 transfer process imports (docs/engines/fastdeploy.md). This
module is kvtd.engines.fastdeploy.queue itself (one module object under both names, so its classes
and state are one)."""

import sys

from .engines.fastdeploy import queue as _adapter

sys.modules[__name__] = _adapter
