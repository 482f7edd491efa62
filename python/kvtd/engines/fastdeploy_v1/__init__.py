"""FastDeploy's cache manager v1 (cache_manager/v1) through kvtd: manager.py is the transfer
manager its plugin installs in every FastDeploy process; support.py names, geometry and host
reservation.

Written against FastDeploy develop c1b7c083 (../shared/reference/fastdeploy-v1/PROVENANCE).
"""

UPSTREAM = "FastDeploy develop c1b7c083 (cache manager v1)"
