"""Where an engine's reference source is: $<env>, else ../shared/reference/<name> beside the checkout,
else /work/shared/reference/<name> (where this project's machines keep them, for clones made
elsewhere, as CI's). The first holding `marker` (a path inside it) wins; None when none does.
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
    candidates += [ROOT.parent / "shared" / "reference" / name, Path("/work/shared/reference") / name]
    return next((c for c in candidates if (c / marker).exists()), None)


def stand_in_module(name: str, **attrs) -> types.ModuleType:
    """A module `name` holding `attrs`, in sys.modules so that imports of it find it."""
    m = types.ModuleType(name)
    m.__dict__.update(attrs)
    sys.modules[name] = m
    return m
