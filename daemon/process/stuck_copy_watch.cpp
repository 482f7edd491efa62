#include "stuck_copy_watch.h"

#include <unistd.h>

#include <chrono>

#include "kvtd/daemon/exit_codes.h"
#include "kvtd/daemon/log.h"
#include "kvtd/ipc/clock.h"

namespace kvtd::daemon {

namespace {

void flush_and_exit(std::int64_t running_ns) {
  ::spdlog::critical("a device copy has run for {} s and cannot be taken back in this process: exiting with code {} "
                "so systemd starts a new one (the host pool survives; the engine sees this rank's tasks fail)",
                running_ns / 1'000'000'000, kExitCopyStuck);
  if (auto logger = ::spdlog::default_logger()) logger->flush();
  ::_exit(kExitCopyStuck);  // no destructor may wait on the stuck stream
}

}  // namespace

std::int64_t StuckCopyWatch::running_ns(const CopyEngine& copies) {
  const std::int64_t since = copies.busy_since_ns();
  return since == 0 ? 0 : ipc::monotonic_now_ns() - since;
}

StuckCopyWatch::StuckCopyWatch(const CopyEngine& copies, std::int64_t timeout_ns, GiveUp give_up)
    : copies_(copies), timeout_ns_(timeout_ns), give_up_(give_up ? std::move(give_up) : GiveUp(flush_and_exit)) {
  thread_ = std::thread([this] { loop(); });
}

StuckCopyWatch::~StuckCopyWatch() {
  {
    MutexLock g(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

void StuckCopyWatch::loop() {
  std::int64_t warned_since = 0;  // busy_since of the copy already reported
  MutexLock lk(mu_);
  while (!stop_) {
    cv_.wait_for(lk, std::chrono::milliseconds(100));
    if (stop_ || timeout_ns_ <= 0) continue;
    const std::int64_t since = copies_.busy_since_ns();
    if (since == 0) continue;
    const std::int64_t running = ipc::monotonic_now_ns() - since;
    if (running >= 2 * timeout_ns_) {
      lk.unlock();
      give_up_(running);
      lk.lock();
      continue;
    }
    if (running >= timeout_ns_ && warned_since != since) {
      warned_since = since;
      KVTD_ERROR("a device copy has run for {} ms without finishing (--stuck-copy-timeout {} ms): this rank is not "
                 "ready; it exits at {} ms unless the copy finishes",
                 running / 1'000'000, timeout_ns_ / 1'000'000, 2 * timeout_ns_ / 1'000'000);
    }
  }
}

}  // namespace kvtd::daemon
