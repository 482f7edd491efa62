#include "io_pool.h"

#include <pthread.h>

#include <algorithm>

namespace kvtd::storage::detail {

IoPool::IoPool(unsigned threads) {
  for (unsigned t = 1; t < threads; ++t) {
    helpers_.emplace_back([this] { helper_loop(); });
    pthread_setname_np(helpers_.back().native_handle(), "kvtd-store-io");
  }
}

IoPool::~IoPool() {
  {
    MutexLock g(mu_);
    stopping_ = true;
  }
  work_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

void IoPool::work(Batch& b) {
  for (std::size_t i = b.next.fetch_add(1); i < b.n; i = b.next.fetch_add(1)) (*b.fn)(i);
}

void IoPool::run(std::size_t n, unsigned threads, const std::function<void(std::size_t)>& fn) {
  if (n == 0) return;
  Batch b;
  b.n = n;
  b.fn = &fn;
  const std::size_t most = std::min<std::size_t>({n, std::max(1u, threads), helpers_.size() + 1});
  b.helpers_wanted = static_cast<unsigned>(most - 1);
  if (b.helpers_wanted != 0) {
    {
      MutexLock g(mu_);
      batches_.push_back(&b);
    }
    if (b.helpers_wanted == 1) {
      work_cv_.notify_one();
    } else {
      work_cv_.notify_all();
    }
  }
  work(b);
  if (b.helpers_wanted == 0) return;
  MutexLock g(mu_);
  // No helper joins from here on; those inside finish the calls they took.
  batches_.erase(std::remove(batches_.begin(), batches_.end(), &b), batches_.end());
  done_cv_.wait(g, [&]() REQUIRES(mu_) { return b.helpers_in == 0; });
}

void IoPool::helper_loop() {
  MutexLock g(mu_);
  for (;;) {
    work_cv_.wait(g, [&]() REQUIRES(mu_) { return stopping_ || !batches_.empty(); });
    if (stopping_) return;
    Batch* b = batches_.front();
    // Every call of it taken already (its caller will finish and take it out): never join it
    // again, or a helper would spin joining and leaving it until the caller's last call returns.
    if (b->next.load() >= b->n) {
      batches_.pop_front();
      continue;
    }
    if (++b->helpers_in >= b->helpers_wanted) batches_.pop_front();  // it has all the help it asked for
    g.unlock();
    work(*b);
    g.lock();
    --b->helpers_in;
    done_cv_.notify_all();
  }
}

}  // namespace kvtd::storage::detail
