"""Where an engine's reference source is: $<env> (one engine's), else $KVTD_REFERENCE_DIR/<name>
(a folder of them), else ../shared/reference/<name> beside the checkout. The first holding `marker`
(a path inside it) wins; None when none does. Where a machine keeps them for clones made elsewhere
is that machine's to say (.ci/run sets KVTD_REFERENCE_DIR), never this file's.
And stand_in_module, how a harness puts a stand-in for what cannot load in sys.modules."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def reference_source(env: str, name: str, marker: str) -> Optional[Path]:
    candidates = [Path(os.environ[env])] if os.environ.get(env) else []
    if os.environ.get("KVTD_REFERENCE_DIR"):
        candidates.append(Path(os.environ["KVTD_REFERENCE_DIR"]) / name)
    candidates.append(ROOT.parent / "shared" / "reference" / name)
    return next((c for c in candidates if (c / marker).exists()), None)


def stand_in_module(name: str, **attrs) -> types.ModuleType:
    """A module `name` holding `attrs`, in sys.modules so that imports of it find it."""
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m
