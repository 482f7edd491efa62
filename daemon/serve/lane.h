// lane.h (daemon/serve private) - the lanes a task runs on: a swap lane per direction (one thread
// each, its tasks in order) and the storage lane (the storage executor's workers, in no order).
// The block tracker keeps order across lanes; a lane keeps its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <iterator>

#include "kvtd/proto/task.h"

namespace kvtd::daemon {

enum class Lane : std::uint8_t { kToHost = 0, kToDevice = 1, kStorage = 2 };

inline constexpr Lane kLanes[] = {Lane::kToHost, Lane::kToDevice, Lane::kStorage};
inline constexpr Lane kSwapLanes[] = {Lane::kToHost, Lane::kToDevice};
inline constexpr std::size_t kLaneCount = std::size(kLanes);

// The lane's position in a per-lane array (kLanes' order).
constexpr std::size_t index_of(Lane lane) { return static_cast<std::size_t>(lane); }
// The swap lane of a swap of kind `k`: SWAP_TO_HOST goes to host, every other swap to device.
constexpr Lane swap_lane_of(proto::TaskKind k) {
  return k == proto::TaskKind::kSwapToHost ? Lane::kToHost : Lane::kToDevice;
}

}  // namespace kvtd::daemon
