#include "uring_reads.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <liburing.h>
#include <unistd.h>

#include <cerrno>
#include <vector>

namespace kvtd::storage::detail {
namespace {

// One ring per thread, made on its first direct read and closed when the thread ends: a ring
// costs a few system calls and two mappings, too much per batch.
class ThreadRing {
 public:
  ThreadRing() { init_error_ = -io_uring_queue_init(kUringDepth, &ring_, 0); }
  ~ThreadRing() {
    if (init_error_ == 0) io_uring_queue_exit(&ring_);
  }
  ThreadRing(const ThreadRing&) = delete;
  ThreadRing& operator=(const ThreadRing&) = delete;
  int init_error() const { return broken_ ? EIO : init_error_; }
  void set_broken() { broken_ = true; }
  io_uring* get() { return &ring_; }

 private:
  io_uring ring_{};
  int init_error_ = 0;
  bool broken_ = false;
};

}  // namespace

int read_direct_with_uring(std::span<DirectRead> reads) {
  thread_local ThreadRing ring;
  if (ring.init_error() != 0) return ring.init_error();
  io_uring* r = ring.get();
  std::vector<int> fds(reads.size(), -1);
  std::size_t next = 0, finished = 0;
  unsigned in_flight = 0;
  while (finished < reads.size()) {
    // Fill the ring: an open that fails is a result at once (ENOENT: a missing object).
    while (next < reads.size() && in_flight < kUringDepth) {
      DirectRead& d = reads[next];
      // Non-blocking and checked, as a buffered read: a FIFO in the store must not hang the load.
      const int fd = ::open(d.path.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC | O_NONBLOCK);
      struct stat st {};
      if (fd < 0 || ::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
        d.error = fd < 0 ? errno : 0;  // not a regular file: nothing read, a corrupt object
        if (fd >= 0) ::close(fd);
        ++finished;
        ++next;
        continue;
      }
      // io_uring honours O_NONBLOCK on a file (-EAGAIN instead of waiting for the disk): clear it.
      (void)::fcntl(fd, F_SETFL, ::fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      io_uring_sqe* sqe = io_uring_get_sqe(r);  // never null: at most kUringDepth in flight
      io_uring_prep_read(sqe, fd, d.buffer.data(), static_cast<unsigned>(d.buffer.size()), 0);
      io_uring_sqe_set_data64(sqe, next);
      fds[next] = fd;
      ++in_flight;
      ++next;
    }
    if (in_flight == 0) continue;
    int rc = io_uring_submit_and_wait(r, 1);
    while (rc == -EINTR) rc = io_uring_submit_and_wait(r, 1);
    if (rc < 0) {
      // The submission failed: what is in flight must still end before its buffers go back to
      // the caller, so it is reaped one by one; a ring that cannot even do that is left broken
      // (every later call fails) rather than let the kernel write a buffer reused meanwhile.
      while (in_flight != 0) {
        io_uring_cqe* cqe = nullptr;
        if (io_uring_wait_cqe(r, &cqe) != 0 || cqe == nullptr) {
          ring.set_broken();
          break;
        }
        const auto i = static_cast<std::size_t>(io_uring_cqe_get_data64(cqe));
        io_uring_cqe_seen(r, cqe);
        ::close(fds[i]);
        fds[i] = -1;
        --in_flight;
      }
      for (std::size_t i = 0; i < next; ++i) {
        if (reads[i].error == 0 && reads[i].bytes == 0) reads[i].error = -rc;
        if (fds[i] >= 0) ::close(fds[i]);
      }
      for (std::size_t i = next; i < reads.size(); ++i) reads[i].error = -rc;
      return 0;
    }
    io_uring_cqe* cqe = nullptr;
    while (io_uring_peek_cqe(r, &cqe) == 0 && cqe != nullptr) {
      const auto i = static_cast<std::size_t>(io_uring_cqe_get_data64(cqe));
      if (cqe->res < 0) reads[i].error = -cqe->res;
      else reads[i].bytes = static_cast<std::size_t>(cqe->res);
      io_uring_cqe_seen(r, cqe);
      ::close(fds[i]);
      fds[i] = -1;
      --in_flight;
      ++finished;
    }
  }
  return 0;
}

}  // namespace kvtd::storage::detail
