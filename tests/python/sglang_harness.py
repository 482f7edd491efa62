"""sglang's own source for tests: v0.5.18 in $KVTD_SGLANG_SRC, else ../shared/reference/sglang beside
the checkout, else /work/shared/reference/sglang (see its PROVENANCE: hicache_storage.py imports on
Debian's torch 1.13 with nothing replaced; HiCacheFile's evictor needs one helper of the
unvendored sglang.srt.utils, below)."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Optional

from reference_source import reference_source

def sglang_source() -> Optional[Path]:
    return reference_source("KVTD_SGLANG_SRC", "sglang", "python/sglang/srt/mem_cache/hicache_storage.py")


def skip_reason() -> str:
    return ("sglang's source is not here: set KVTD_SGLANG_SRC to a checkout of sglang v0.5.18, or place it at "
            "../shared/reference/sglang beside this checkout")


def _stand_in_for_unvendored_utils():
    """sglang.srt.utils is not vendored (PROVENANCE); HiCacheFile's evictor imports one helper from it,
    human_readable_int, to parse its optional size limit (lru_file_evictor.py:34-53). The tests set
    no limit, so the stand-in parses plain integers only and refuses anything else."""
    if "sglang.srt.utils" in sys.modules:
        return
    utils = types.ModuleType("sglang.srt.utils")
    common = types.ModuleType("sglang.srt.utils.common")

    def human_readable_int(text):
        return int(text)

    common.human_readable_int = human_readable_int
    utils.common = common
    sys.modules["sglang.srt.utils"] = utils
    sys.modules["sglang.srt.utils.common"] = common


def import_hicache_storage():
    """sglang.srt.mem_cache.hicache_storage, loaded from the reference tree unmodified."""
    src = sglang_source()
    if src is None:
        raise RuntimeError(skip_reason())
    path = str(src / "python")
    if path not in sys.path:
        sys.path.insert(0, path)
    _stand_in_for_unvendored_utils()
    import sglang.srt.mem_cache.hicache_storage as hs  # noqa: E402
    return hs
