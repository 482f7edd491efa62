"""The engine library cannot be crashed or confused by its own users' threads and processes.
Each case failed on the library before the fix."""

from __future__ import annotations

import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
import uuid

import pytest

import kvtd
from kvtd.task_args import milliseconds as _ms


def test_close_while_another_thread_waits_raises_closed_in_it(cluster):
    c = cluster()
    s = c.ready()
    daemon = c.daemons.procs[0]
    daemon.send_signal(signal.SIGSTOP)  # the task below cannot complete while this rank is frozen
    try:
        tid = s.swap_to_host([1], [1])
        caught = []

        def waiter():
            try:
                s.wait(tid, timeout=30)
            except BaseException as e:  # noqa: BLE001 - recorded for the assertion
                caught.append(e)

        t = threading.Thread(target=waiter)
        t.start()
        time.sleep(0.2)
        t0 = time.monotonic()
        s.close()  # the engine shutting down while its completion thread waits (SIGSEGV before)
        t.join(10)
        assert not t.is_alive()
        assert time.monotonic() - t0 < 5
        assert len(caught) == 1 and isinstance(caught[0], kvtd.Closed), caught
    finally:
        daemon.send_signal(signal.SIGCONT)


def test_a_forked_child_is_refused_and_leaves_its_parents_session_alone(cluster):
    c = cluster()
    s = c.ready()
    pid = os.fork()
    if pid == 0:  # FastDeploy's multiprocessing forks engine processes like this
        code = 0
        try:
            s.swap_to_host([1], [1])
            code = 1
        except kvtd.WrongProcess as e:
            code = 0 if "created by process" in str(e) else 2
        except BaseException:  # noqa: BLE001
            code = 3
        try:
            s.close()  # the child's copy: must not unlink or close the parent's session
        except BaseException:  # noqa: BLE001
            code = code or 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, f"child status {status}"
    # The parent goes on: a round trip through the daemons still completes.
    assert s.wait(s.swap_to_host([2], [2]), timeout=30).ok


def test_a_view_read_after_close_does_not_kill_the_interpreter():
    # In a child interpreter: on the old library this read was a segfault.
    code = f"""
import sys, uuid
sys.path.insert(0, {os.path.join(os.path.dirname(kvtd.__file__), '..')!r})
import kvtd, torch
g = kvtd.Geometry(num_ranks=1, num_layers=2, key_shape=(8, 2, 4, 8), value_shape=(8, 2, 4, 8), num_host_blocks=4)
s = kvtd.Session("py_view_" + uuid.uuid4().hex[:8], g)
s.create_host_device_tensors()
t = s.host_tensor(0, 1, kvtd.KEY)
a = s.host_array(0, 0, kvtd.VALUE)
t.view(torch.uint8).flatten()[:3] = torch.tensor([1, 2, 3], dtype=torch.uint8)
a[:2] = 9
s.close()
print(t.view(torch.uint8).flatten()[:3].tolist(), a[:2].tolist())
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=dict(os.environ))
    assert out.returncode == 0, f"exit {out.returncode}\n{out.stderr}"
    assert out.stdout.strip() == "[1, 2, 3] [9, 9]"


def test_timeouts_none_and_inf_and_huge_wait_forever_and_nan_is_refused(cluster):
    assert _ms(None) == _ms(math.inf) == _ms(1e300) == 2**62  # 1e300 wrapped to negative: timed out at once
    assert _ms(0.5) == 500 and _ms(-1) == 0
    with pytest.raises(ValueError, match="NaN"):
        _ms(math.nan)
    c = cluster()
    s = c.ready()
    assert s.wait(s.swap_to_host([3], [3]), timeout=1e300).ok


def test_register_tensor_refuses_sizes_no_device_has():
    g = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(8, 2, 4, 8), num_host_blocks=4)
    with kvtd.Session("py_reg_" + uuid.uuid4().hex[:8], g) as s:
        handle = b"x" * 64
        for bad in (2**63, -1, 1.5):
            with pytest.raises(ValueError, match="nbytes"):
                s.register_tensor(0, 0, kvtd.KEY, handle, 0, bad)
        with pytest.raises(kvtd.InvalidArgument, match="beyond any device"):
            s.register_tensor(0, 0, kvtd.KEY, handle, 0, 2**50)
        s.register_tensor(0, 0, kvtd.KEY, handle, 0, 8 * 2 * 4 * 8 * 2)


# The client library never moves the wrong block silently. ctypes wraps an int
# into an int32 / uint32 field without a word: block id 2**32 + 5 was block 5, min_hits 2**32 + 1
# was 1, and a key's NUL byte cut it there (b"kx\0A" and b"kx\0B" named one object); each was
# answered ok on the old module. Each is refused now, naming the field, before anything is sent.
def test_ids_and_counts_that_would_wrap_and_keys_with_nul_are_refused():
    g = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(8, 2, 4, 8), num_host_blocks=4)
    with kvtd.Session("py_wrap_" + uuid.uuid4().hex[:8], g) as s:
        for bad in (2**31, 2**32 + 5, -1):
            with pytest.raises(ValueError, match=r"src\[1\] = .* is not a block id"):
                s.swap_to_host([1, bad], [0, 1])
            with pytest.raises(ValueError, match=r"dst\[0\]"):
                s.swap_to_device([0], [bad])
            with pytest.raises(ValueError, match=r"blocks\[0\]"):
                s.storage_read(["k0"], [bad])
        with pytest.raises(ValueError, match="min_hits"):
            s.prefetch(["k0"], [0], min_hits=2**32 + 1)
        with pytest.raises(ValueError, match="cancel_task_id"):
            s.cancel(2**64 + 3)
        with pytest.raises(ValueError, match="NUL"):
            s.storage_write([b"kx\0A"], [0])
        with pytest.raises(ValueError, match="NUL"):
            s.storage_query(["kx\0B"])
        assert s.in_flight == 0


# Documented misuse may be refused; it must not corrupt: two threads closing one session at once
# destroyed its handle twice (a double free in the library), and a call that started after close
# used freed memory. Now one close destroys it, and later calls are refused.
def test_two_threads_closing_one_session_and_calls_after_close_are_refused_not_corrupting():
    g = kvtd.Geometry(num_ranks=1, num_layers=1, key_shape=(8, 2, 4, 8), num_host_blocks=4)
    for _ in range(20):
        s = kvtd.Session("py_close2_" + uuid.uuid4().hex[:8], g)
        handle = s._handle()
        barrier = threading.Barrier(2)

        def closer():
            barrier.wait()
            s.close()

        threads = [threading.Thread(target=closer) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        with pytest.raises(ValueError, match="closed"):
            s.swap_to_host([1], [1])
        # A thread that took the handle before close and calls after it: refused by the library.
        rc = kvtd._native.lib.kvtd_in_flight(handle)
        assert rc == 0
        err = ctypes.create_string_buffer(256)
        assert kvtd._native.lib.kvtd_publish(handle, err, 256) == kvtd._native.E_CLOSED
        assert b"destroyed" in err.value
        s.close()
