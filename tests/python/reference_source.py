"""Where an engine's reference source is: $<env>, else ../shared/reference/<name> beside the checkout,
else /work/shared/reference/<name> (where this project's machines keep them, for clones made
elsewhere, as CI's). The first holding `marker` (a path inside it) wins; None when none does."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[2]


def reference_source(env: str, name: str, marker: str) -> Optional[Path]:
    candidates = [Path(os.environ[env])] if os.environ.get(env) else []
    candidates += [ROOT.parent / "shared" / "reference" / name, Path("/work/shared/reference") / name]
    return next((c for c in candidates if (c / marker).exists()), None)
