// swap_modes.h - kvtd-loadgen's swap modes (every session: one shape, or cache groups).
//   verify:     random block sets of every group swapped out, the device blocks overwritten,
//               swapped back into other blocks, every byte checked (one task per round trip).
//   latency:    one-block SWAP_TO_HOST round trips: p50 .. max, and where the time goes.
//   throughput: random swaps in both directions, GB/s per rank beside a plain memcpy.
#pragma once

#include "loadgen_common.h"

namespace kvtd::loadgen {

int run_verify(EngineSession& s, const Options& o);
int run_latency(EngineSession& s, const Options& o);
int run_throughput(EngineSession& s, const Options& o);

}  // namespace kvtd::loadgen
