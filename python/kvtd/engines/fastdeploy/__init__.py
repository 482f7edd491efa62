"""FastDeploy's v0 cache transfer process (cache_transfer_manager.py) through kvtd: queue.py is
the cache task queue kvtd stands in for, signals.py FastDeploy's IPCSignals, support.py its
geometry, control responder and version.yaml.

Written against FastDeploy develop c1b7c083 (../shared/reference/fastdeploy/PROVENANCE).
"""

UPSTREAM = "FastDeploy develop c1b7c083"
