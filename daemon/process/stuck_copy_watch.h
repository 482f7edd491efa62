// stuck_copy_watch.h (daemon-internal) - the last line of defence for a device copy that never
// finishes (a device that stopped, a stream behind a wait that can never end). kvtd waits for an
// engine's event on the host with a bound, so no copy of its own should ever stall; if one does,
// no task can be answered (the copy may still write engine memory) and nothing in the process
// can take the lane back. So the rank says so, then exits for systemd to start a new process;
// the host pool, a named shared-memory object, survives the restart.
#pragma once

#include <cstdint>
#include <functional>
#include <thread>

#include "kvtd/base/mutex.h"
#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {

// Watches copies.busy_since_ns() every 100 ms: a copy running `timeout_ns` is logged as stuck
// (once); one running 2 x timeout_ns calls `give_up` (default: flush the logs, _exit(8)). Borrows
// `copies`, which must outlive the watch. Not copyable; the destructor stops and joins the thread.
class StuckCopyWatch {
 public:
  using GiveUp = std::function<void(std::int64_t running_ns)>;
  StuckCopyWatch(const CopyEngine& copies, std::int64_t timeout_ns, GiveUp give_up = {});
  ~StuckCopyWatch();
  StuckCopyWatch(const StuckCopyWatch&) = delete;
  StuckCopyWatch& operator=(const StuckCopyWatch&) = delete;

  // How long the oldest running copy has run, ns (0: none). Any thread.
  static std::int64_t running_ns(const CopyEngine& copies);

 private:
  void loop();
  const CopyEngine& copies_;
  const std::int64_t timeout_ns_;
  GiveUp give_up_;
  Mutex mu_;
  CondVar cv_;
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

}  // namespace kvtd::daemon
