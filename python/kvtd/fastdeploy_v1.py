"""`kvtd.fastdeploy_v1`: the module of FastDeploy's plugin entry point
(kvtd.fastdeploy_v1:register). This module is kvtd.engines.fastdeploy_v1.manager itself (one module
object under both names, so its classes and state are one)."""

import sys

from .engines.fastdeploy_v1 import manager as _adapter

sys.modules[__name__] = _adapter
