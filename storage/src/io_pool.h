// Internal: the file store's I/O threads. A batch's objects are spread over threads that live as
// long as the store, so a batch costs no thread start-up: the daemon's loads come in steps of a
// few objects (its cancel step), and a thread started per step arrived after the caller had done
// most of the step alone (STORAGE_READ 4.6 GB/s on 2 cores against 6.3 with 4x larger steps).
#pragma once

#include <atomic>
#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "kvtd/base/mutex.h"

namespace kvtd::storage::detail {

// Thread-safe: several callers may run batches at once; each caller works on its own batch and
// the pool's helpers join whichever batch has work left, so a batch never waits for a helper
// (a busy pool only means less help). Not copyable or movable. The destructor joins the helpers;
// no run() may be in progress then.
class IoPool {
 public:
  // `threads` counts the caller: threads - 1 helpers are started (none for 0 or 1).
  explicit IoPool(unsigned threads);
  ~IoPool();
  IoPool(const IoPool&) = delete;
  IoPool& operator=(const IoPool&) = delete;

  // Runs fn(i) for every i in [0, n) on the caller and up to threads - 1 helpers; returns when
  // every call has returned. fn must be safe to call from several threads at once.
  void run(std::size_t n, unsigned threads, const std::function<void(std::size_t)>& fn);

 private:
  struct Batch {
    std::size_t n = 0;
    const std::function<void(std::size_t)>* fn = nullptr;
    std::atomic<std::size_t> next{0};
    unsigned helpers_wanted = 0;  // guarded by the pool's mu_
    unsigned helpers_in = 0;      // guarded by the pool's mu_: helpers inside work(); run waits for 0
  };
  static void work(Batch& b);
  void helper_loop();

  Mutex mu_;
  CondVar work_cv_;  // a batch was queued, or the pool stops
  CondVar done_cv_;  // a helper left a batch
  std::deque<Batch*> batches_ GUARDED_BY(mu_);  // batches that still take helpers
  bool stopping_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> helpers_;
};

}  // namespace kvtd::storage::detail
