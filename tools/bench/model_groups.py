"""Prints the --cache-group flags of a real model's cache at a tensor-parallel size, one flag and
its value per line, for the daemons and kvtd-loadgen (kvtd.models builds the groups from the
model's published config.json fields; tests/python/test_models.py cites each config).

    /usr/bin/python3 tools/bench/model_groups.py gpt-oss-20b 2 [--device-blocks N] [--host-blocks N]
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "python"))

from kvtd import models  # noqa: E402
from test_models import DEEPSEEK_V32, GPT_OSS_20B, LLAMA_31_8B, QWEN3_NEXT_80B  # noqa: E402

MODELS = {
    "llama-3.1-8b": lambda tp, d, h: models.plain_attention(LLAMA_31_8B, tp, device_blocks=d, host_blocks=h),
    "gpt-oss-20b": lambda tp, d, h: models.sliding_and_full(GPT_OSS_20B, tp, device_blocks=d, host_blocks=h),
    "qwen3-next-80b": lambda tp, d, h: models.linear_and_full(QWEN3_NEXT_80B, tp, device_blocks=d, host_blocks=h,
                                                              state_slots=max(2, d // 8), host_state_slots=max(2, h // 8)),
    "deepseek-v3.2": lambda tp, d, h: models.mla_with_indexer(DEEPSEEK_V32, tp, device_blocks=d, host_blocks=h),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("model", choices=sorted(MODELS))
    p.add_argument("tp", type=int)
    p.add_argument("--device-blocks", type=int, default=64)
    p.add_argument("--host-blocks", type=int, default=96)
    a = p.parse_args()
    groups = MODELS[a.model](a.tp, a.device_blocks, a.host_blocks)
    groups.check()
    print("\n".join(groups.daemon_flags()))


if __name__ == "__main__":
    main()
