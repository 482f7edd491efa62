"""pytest fixtures: a Session with real kvtd daemons (host backend) per test, and a watchdog.

Run by ctest (label `python`) with KVTD_BINARY and KVTD_CLIENT_LIBRARY set; by hand:
    PYTHONPATH=python /usr/bin/python3 -m pytest tests/python
"""

from __future__ import annotations

import faulthandler
import os
import sys
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "python"))

import kvtd  # noqa: E402
import kvtd.testing  # noqa: E402

WATCHDOG_S = float(os.environ.get("KVTD_TEST_WATCHDOG_S", "120"))


@pytest.fixture(autouse=True)
def watchdog():
    """A hung test dumps every thread's stack and ends the run instead of blocking CI (the
    daemons die with this process: PR_SET_PDEATHSIG)."""
    faulthandler.dump_traceback_later(WATCHDOG_S, exit=True)
    yield
    faulthandler.cancel_dump_traceback_later()


def small_geometry(ranks=2, layers=3, **kw):
    shape = kw.pop("shape", (32, 2, 4, 8))
    args = dict(num_ranks=ranks, num_layers=layers, key_shape=shape, value_shape=shape, num_host_blocks=24)
    args.update(kw)
    return kvtd.Geometry(**args)


class Cluster:
    """A published session and its running daemons."""

    def __init__(self, geometry, extra=(), name="t", session_kw=None):
        self.suffix = f"py_{name[:20]}_{uuid.uuid4().hex[:8]}"
        self.geometry = geometry
        self.daemons = kvtd.testing.Daemons(None, self.suffix, geometry, extra)
        self.daemons.start()
        grouped = hasattr(geometry, "groups")  # kvtd.cache_groups.CacheGroups
        kw = session_kw or {}
        self.session = (kvtd.Session(self.suffix, groups=geometry, **kw) if grouped
                        else kvtd.Session(self.suffix, geometry, **kw))
        self.session.create_host_device_tensors()

    def ready(self):
        self.session.publish()
        try:
            self.session.wait_ready(30)
        except kvtd.KvtdError:
            raise AssertionError("daemons did not attach:\n" + self.daemons.logs())
        return self.session

    def close(self):
        self.session.close()
        return self.daemons.stop()


@pytest.fixture
def cluster(request):
    made = []

    def make(geometry=None, extra=(), **session_kw):
        c = Cluster(geometry or small_geometry(), extra, request.node.name, session_kw)
        made.append(c)
        return c

    yield make
    for c in made:
        codes = c.close()
        assert all(code == 0 for code in codes), f"daemon exit codes {codes}\n{c.daemons.logs()}"
