"""Rank daemons for tests and examples: start one `kvtd` process per rank beside a Session.

    with kvtd.testing.Daemons(binary, "mysession", geometry) as d:
        ...  # d.procs[r] is rank r's process, d.log(r) its log

Every daemon is started with PR_SET_PDEATHSIG=SIGKILL, so it dies with the process that started
it even if that process is killed; on exit each one gets SIGTERM, then SIGKILL after a bound.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from .session import Geometry

_PR_SET_PDEATHSIG = 1


def _die_with_parent():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def find_binary() -> str:
    """$KVTD_BINARY, else the in-tree build, else `kvtd` on PATH."""
    env = os.environ.get("KVTD_BINARY")
    if env:
        return env
    tree = Path(__file__).resolve().parent.parent.parent / "build" / "daemon" / "kvtd"
    return str(tree) if tree.exists() else "kvtd"


def daemon_args(binary: str, suffix: str, rank: int, g, extra: Sequence[str] = ()) -> List[str]:
    """The flags that make a daemon agree with `g`, a Geometry or CacheGroups (host backend
    unless `extra` names one)."""
    flags = g.daemon_flags()
    if "--mp-num" not in flags:  # cache groups name their groups only
        flags = ["--mp-num", str(g.num_ranks), *flags]
    args = [binary, "--rank", str(rank), *flags, "--session", suffix, "--engine-timeout", "2",
            "--heartbeat-period", "0.02"]
    if "--device-backend" not in extra:
        args += ["--device-backend", "host"]
    return args + list(extra)


class Daemons:
    def __init__(self, binary: Optional[str], suffix: str, geometry: Geometry, extra: Sequence[str] = (),
                 log_dir: Optional[str] = None, ranks: Optional[Sequence[int]] = None):
        """One daemon per rank of `geometry` for session `suffix`, or only for `ranks` (a session
        that serves one rank: Session(only_rank=r))."""
        self.binary = binary or find_binary()
        self.suffix = suffix
        self.geometry = geometry
        self.ranks = list(range(geometry.num_ranks) if ranks is None else ranks)
        self.extra = list(extra)
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="kvtd_logs_")
        self.procs: List[subprocess.Popen] = []

    def log(self, rank: int) -> str:
        return os.path.join(self.log_dir, f"{self.suffix}_rank{rank}.log")

    def _spawn(self, rank: int) -> subprocess.Popen:
        with open(self.log(rank), "ab") as out:
            return subprocess.Popen(daemon_args(self.binary, self.suffix, rank, self.geometry, self.extra),
                                    stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    preexec_fn=_die_with_parent)

    def start(self) -> "Daemons":
        for r in self.ranks:
            self.procs.append(self._spawn(r))
        return self

    def kill(self, rank: int) -> None:
        """SIGKILLs rank `rank`'s daemon (a crash: nothing orderly runs) and reaps it."""
        p = self.procs[self.ranks.index(rank)]
        p.kill()
        p.wait()

    def restart(self, rank: int) -> None:
        """Starts rank `rank`'s daemon again with the same flags (after kill or its exit)."""
        i = self.ranks.index(rank)
        assert self.procs[i].poll() is not None, f"rank {rank}'s daemon is still running"
        self.procs[i] = self._spawn(rank)

    def kill_and_restart(self, rank: int, session=None, timeout: float = 30.0) -> None:
        """kill, then restart, as systemd's Restart=on-failure does. With `session`, the restart
        waits until that session saw the old daemon go: until then its ready bits may still be the
        old daemon's, and a wait_ready right after the restart would return on them."""
        self.kill(rank)
        deadline = time.monotonic() + timeout
        while session is not None and session.rank_alive(rank):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {rank}'s killed daemon still counts alive after {timeout} s")
            time.sleep(0.005)
        self.restart(rank)

    def stop(self, timeout: float = 10.0) -> List[Optional[int]]:
        codes = []
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                codes.append(p.wait(timeout))
            except subprocess.TimeoutExpired:
                p.kill()
                codes.append(p.wait())
        self.procs = []
        return codes

    def logs(self) -> str:
        text = []
        for r in self.ranks:
            try:
                text.append(f"--- rank {r} ---\n" + Path(self.log(r)).read_text(errors="replace")[-4000:])
            except OSError:
                pass
        return "\n".join(text)

    def __enter__(self) -> "Daemons":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
