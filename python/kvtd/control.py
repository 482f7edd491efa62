"""The engine's side of the daemons' control sockets (ZeroMQ REQ, JSON; see docs/operating.md "kvtd ctl"),
for requests an engine makes itself: storage garbage collection after a weight update.

Needs pyzmq (Debian: python3-zmq); the rest of the module does not. The socket directory is
found as the daemons find it (control/src/control.cpp, runtime_dir): $RUNTIME_DIRECTORY (the
unit's), /run/kvtd when it is this user's, $XDG_RUNTIME_DIR/kvtd, else /tmp/kvtd-<uid>.
"""

from __future__ import annotations

import json
import os
import re
from typing import Dict, List, Optional, Sequence

from .errors import KvtdError


def runtime_dir() -> str:
    d = os.environ.get("RUNTIME_DIRECTORY")
    if d:
        return d.split(":")[0]
    try:
        st = os.lstat("/run/kvtd")
        if os.path.isdir("/run/kvtd") and not os.path.islink("/run/kvtd") and st.st_uid == os.getuid():
            return "/run/kvtd"
    except OSError:
        pass
    x = os.environ.get("XDG_RUNTIME_DIR")
    return os.path.join(x, "kvtd") if x else f"/tmp/kvtd-{os.getuid()}"


def control_sockets(session: str, dp: int = 0, directory: Optional[str] = None) -> Dict[int, str]:
    """rank -> ipc:// endpoint of every daemon of `session` (data-parallel group `dp`) found."""
    d = directory or runtime_dir()
    pattern = re.compile(rf"^kvtd_{os.getuid()}_{re.escape(session)}_dp{dp}_r(\d{{1,2}})\.sock$")
    found = {}
    for name in os.listdir(d) if os.path.isdir(d) else []:
        m = pattern.match(name)
        if m:
            found[int(m.group(1))] = "ipc://" + os.path.join(d, name)
    return dict(sorted(found.items()))


def _ask(endpoint: str, request: dict, timeout_s: float) -> dict:
    import zmq  # pyzmq: only this module needs it

    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(endpoint)
        sock.send(json.dumps(request).encode())
        reply = json.loads(sock.recv())
    except zmq.Again:
        raise KvtdError(f"no daemon answered at {endpoint} within {timeout_s} s") from None
    finally:
        sock.close()
        ctx.term()
    return reply


def storage_gc(session: str, keep_weight_version: int, *, dp: int = 0, keep_models: Sequence[str] = (),
               max_seconds: float = 30.0, dry_run: bool = False, directory: Optional[str] = None) -> List[dict]:
    """Asks every daemon of `session` to remove stored objects of other weight versions (and
    layouts; and models, when `keep_models` names the ones to keep), as `kvtd ctl storage gc`
    does. Returns each rank's report ({"rank", "removed", "removed_bytes", "examined", "kept",
    "failed", "complete", "dry_run"}, or {"rank", "skipped"}); raises KvtdError naming the rank
    that refused or did not answer."""
    sockets = control_sockets(session, dp, directory)
    if not sockets:
        raise KvtdError(f"no daemon of session {session!r} (dp {dp}) has a control socket in {directory or runtime_dir()}")
    request = {"command": "storage-gc", "keep_weight_version": int(keep_weight_version), "max_seconds": float(max_seconds),
               "dry_run": bool(dry_run)}
    if keep_models:
        request["keep_models"] = list(keep_models)
    reports = []
    for rank, endpoint in sockets.items():
        reply = _ask(endpoint, request, max_seconds + 5)
        if not reply.get("ok"):
            raise KvtdError(f"rank {rank}: storage gc refused: {reply.get('error', '?')}")
        reports.append({"rank": rank, **reply["result"]})
    return reports
