// kvtd/base/mutex.h - std::mutex and std::condition_variable with clang thread-safety
// capabilities, so GUARDED_BY fields are checked at compile time (libstdc++'s types carry no
// annotations).
//
// Mutex: not copyable or movable; lock()/unlock() from any thread, never recursively.
// MutexLock: holds the mutex for its scope; unlock()/lock() release and retake it inside the
// scope (for a section that must run without it). CondVar: waits with a MutexLock; the mutex is
// released while waiting and held again on return. A predicate passed to a CondVar wait runs with
// the mutex held; clang analyses a lambda on its own, so a predicate that reads guarded fields is
// written `[&]() REQUIRES(mu) { ... }`.
#pragma once

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "kvtd/base/thread_annotations.h"

namespace kvtd {

class CAPABILITY("mutex") Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void lock() ACQUIRE() { mu_.lock(); }
  void unlock() RELEASE() { mu_.unlock(); }
  // Tells the analysis the caller holds it (where it cannot see that, e.g. across a callback).
  void assert_held() const ASSERT_CAPABILITY(this) {}

 private:
  friend class MutexLock;
  std::mutex mu_;
};

class SCOPED_CAPABILITY MutexLock {
 public:
  explicit MutexLock(Mutex& mu) ACQUIRE(mu) : lock_(mu.mu_) {}
  ~MutexLock() RELEASE() {}
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

  void unlock() RELEASE() { lock_.unlock(); }
  void lock() ACQUIRE() { lock_.lock(); }

 private:
  friend class CondVar;
  std::unique_lock<std::mutex> lock_;
};

class CondVar {
 public:
  CondVar() = default;
  CondVar(const CondVar&) = delete;
  CondVar& operator=(const CondVar&) = delete;

  void notify_one() { cv_.notify_one(); }
  void notify_all() { cv_.notify_all(); }
  void wait(MutexLock& l) { cv_.wait(l.lock_); }
  template <typename Pred>
  void wait(MutexLock& l, Pred pred) {
    cv_.wait(l.lock_, pred);
  }
  // False when `d` passed (with the predicate: and it is still false).
  template <typename Rep, typename Period>
  bool wait_for(MutexLock& l, std::chrono::duration<Rep, Period> d) {
    return cv_.wait_for(l.lock_, d) == std::cv_status::no_timeout;
  }
  template <typename Rep, typename Period, typename Pred>
  bool wait_for(MutexLock& l, std::chrono::duration<Rep, Period> d, Pred pred) {
    return cv_.wait_for(l.lock_, d, pred);
  }
  template <typename Clock, typename Duration, typename Pred>
  bool wait_until(MutexLock& l, std::chrono::time_point<Clock, Duration> t, Pred pred) {
    return cv_.wait_until(l.lock_, t, pred);
  }

 private:
  std::condition_variable cv_;
};

}  // namespace kvtd
