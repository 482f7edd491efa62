#include "cuda/copy_wait.h"

#include <sys/prctl.h>

#include <algorithm>
#include <thread>

#include "cuda/cuda_backend.h"
#include "cuda/cuda_check.h"
#include "kvtd/ipc/clock.h"

namespace kvtd::daemon::cuda {

CopyWait plan_copy_wait(std::uint64_t bytes, double bytes_per_ns, std::int64_t spin_ns) {
  if (spin_ns <= 0) return {};
  const double rate = bytes_per_ns > 0 ? bytes_per_ns : kFirstGuessBytesPerNs;
  const auto expected = static_cast<std::int64_t>(static_cast<double>(bytes) / rate);
  CopyWait w;
  w.sleep_ns = std::max<std::int64_t>(0, expected - spin_ns / 2);
  w.poll_until_ns = std::max<std::int64_t>(expected + spin_ns / 2, spin_ns);
  return w;
}

double next_copy_rate(double bytes_per_ns, std::uint64_t bytes, std::int64_t elapsed_ns, bool done_at_first_look) {
  constexpr std::uint64_t kMeasuredFrom = std::uint64_t{4} << 20;
  // Far beyond any host link: growth from censored copies stops here.
  constexpr double kCeiling = 20 * kFirstGuessBytesPerNs;
  if (bytes < kMeasuredFrom || elapsed_ns <= 0) return bytes_per_ns;
  const double seen = static_cast<double>(bytes) / static_cast<double>(elapsed_ns);
  if (done_at_first_look) return std::min(kCeiling, 1.25 * std::max(bytes_per_ns, seen));
  return bytes_per_ns > 0 ? 0.75 * bytes_per_ns + 0.25 * seen : seen;
}

namespace {

// Host sleeps of tens of microseconds must end on time: the default timer slack (50 us) would
// add its whole width to each. Set once per thread that waits for copies.
void tighten_timer_slack() {
  thread_local bool done = false;
  if (!done) {
    (void)prctl(PR_SET_TIMERSLACK, 1000UL, 0UL, 0UL, 0UL);
    done = true;
  }
}

}  // namespace

Status<DeviceErrc> CudaBackend::wait_lane(Lane& lane, std::uint64_t bytes, std::int64_t enqueued_ns) {
  const CopyWait w = plan_copy_wait(bytes, lane.bytes_per_ns, static_cast<std::int64_t>(wait_spin_us_) * 1000);
  bool done = false, first_look = true, done_at_first_look = false;
  if (w.poll_until_ns > 0) {
    tighten_timer_slack();
    if (w.sleep_ns > 0) std::this_thread::sleep_for(std::chrono::nanoseconds(w.sleep_ns));
    for (;; first_look = false) {
      const cudaError_t e = cudaStreamQuery(lane.stream);
      if (e == cudaSuccess) {
        done = true;
        done_at_first_look = first_look && w.sleep_ns > 0;
        break;
      }
      if (e != cudaErrorNotReady) return make_error(errc_of(e), cuda_text("cudaStreamQuery", e));
      if (ipc::monotonic_now_ns() - enqueued_ns > w.poll_until_ns) break;
      std::this_thread::yield();
    }
  }
  if (!done) KVTD_CUDA_TRY(cudaStreamSynchronize(lane.stream));
  lane.bytes_per_ns = next_copy_rate(lane.bytes_per_ns, bytes, ipc::monotonic_now_ns() - enqueued_ns, done_at_first_look);
  return {};
}

}  // namespace kvtd::daemon::cuda
