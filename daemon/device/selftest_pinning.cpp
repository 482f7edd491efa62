// Pinning figures of `kvtd selftest` (selftest_parts.h): how fast cudaHostRegister pins each kind
// of memory a host pool can live in. On the H100 machine private anonymous memory (faulted in
// first) pinned at 18-21 GB/s and a fresh MAP_SHARED /dev/shm object at 3.3 GB/s: faulting the
// pages in, inside the driver, is the cost. Each /dev/shm figure pins a fresh object (a second pin
// of the same pages finds them faulted in: 21.7 GB/s "on 4 threads" once measured only that).
#include <sys/mman.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <thread>
#include <vector>

#include "selftest_parts.h"
#include "kvtd/daemon/host_pool.h"
#include "kvtd/ipc/populate.h"
#include "kvtd/ipc/shared_object.h"

namespace kvtd::daemon::selftest {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// Pins [p, p + bytes) in `threads` registrations made at once (1: one call), times it, unpins it.
// Returns GB/s, or a negative number after a FAIL line.
// With `fault_first`, the pages are first faulted in on `threads` threads (outside the driver)
// and then pinned in one call, as the daemon's host pool does.
double time_pin(HostMemory& backend, std::byte* p, std::size_t bytes, std::uint32_t threads, const std::string& what,
                Tally& tally, bool fault_first = false) {
  const std::size_t step = (bytes / threads + 4095) / 4096 * 4096;
  std::vector<std::pair<std::byte*, std::size_t>> pieces;
  for (std::size_t at = 0; at < bytes; at += step) pieces.emplace_back(p + at, std::min(step, bytes - at));
  std::vector<Status<DeviceErrc>> results(fault_first ? 1 : pieces.size());
  const auto start = std::chrono::steady_clock::now();
  std::vector<std::thread> workers;
  const auto work = [&](std::size_t i) {
    if (fault_first) ipc::populate_for_write(pieces[i].first, pieces[i].second);
    else results[i] = backend.pin_host(pieces[i].first, pieces[i].second);
  };
  for (std::size_t i = 1; i < pieces.size(); ++i) workers.emplace_back(work, i);
  work(0);
  for (auto& t : workers) t.join();
  if (fault_first) {
    pieces.assign(1, {p, bytes});
    results[0] = backend.pin_host(p, bytes);
  }
  const double secs = seconds_since(start);
  std::string error;
  for (std::size_t i = 0; i < pieces.size(); ++i) {
    if (results[i].ok()) backend.unpin_host(pieces[i].first);
    else if (error.empty()) error = results[i].error().message;
  }
  tally.check(error.empty(), fmt::format("pin {} MiB of {}", bytes >> 20, what), error);
  return error.empty() ? static_cast<double>(bytes) / secs / 1e9 : -1.0;
}

void print(const std::string& what, std::size_t bytes, double gbps, double reference) {
  char ratio[40] = "";
  if (reference > 0) std::snprintf(ratio, sizeof ratio, " = %.2fx private memory", gbps / reference);
  std::printf("pinning [%s]: %zu MiB at %.2f GB/s%s (a host pool of N GB takes N / this at start)\n", what.c_str(),
              bytes >> 20, gbps, ratio);
}

// A shared-memory object of `bytes` in `dir` (empty: /dev/shm), every page allocated, as the
// host pool's; removed on return. Null after a SKIP line when it cannot be made.
std::unique_ptr<ipc::SharedObject> pool_like_object(const std::string& dir, std::size_t bytes) {
  const std::string name = fmt::format("kvtd_{}_selftest_pin_{}", getuid(), getpid());
  ipc::SharedObject::remove(name, dir);
  auto o = ipc::SharedObject::create(name, bytes, {}, dir);
  ipc::SharedObject::remove(name, dir);  // the mapping stays; nothing is left behind
  if (!o.ok()) {
    std::printf("SKIP  pinning [%s]: %s\n", dir.empty() ? "/dev/shm" : dir.c_str(), o.error().message.c_str());
    return nullptr;
  }
  return std::move(o).value();
}

}  // namespace

void measure_pinning(HostMemory& backend, std::uint32_t mib, std::uint32_t threads, const std::string& hugetlbfs_dir,
                     Tally& tally) {
  if (mib == 0 || !backend.pins_memory()) return;
  const std::size_t bytes = std::size_t{mib} << 20;
  double reference = -1;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    tally.check(false, fmt::format("pin {} MiB", mib), "mmap failed");
  } else {
    std::memset(p, 0, bytes);  // faulted in first, as the pool's pages are before it is pinned
    reference = time_pin(backend, static_cast<std::byte*>(p), bytes, 1, "private memory", tally);
    if (reference > 0) print("private 4 KiB pages", bytes, reference, -1);
    munmap(p, bytes);
  }
  if (auto shm = pool_like_object({}, bytes)) {
    const double one = time_pin(backend, shm->data(), bytes, 1, "a /dev/shm object", tally);
    if (one > 0) print("/dev/shm, one call", bytes, one, reference);
  }
  const std::string n = std::to_string(std::max<std::uint32_t>(threads, 1));
  if (auto shm = threads > 1 ? pool_like_object({}, bytes) : nullptr) {
    const double many = time_pin(backend, shm->data(), bytes, threads, "a /dev/shm object", tally);
    if (many > 0) print("/dev/shm, " + n + " calls at once", bytes, many, reference);
  }
  if (auto shm = pool_like_object({}, bytes)) {  // the host pool's way
    const double faulted = time_pin(backend, shm->data(), bytes, threads, "a /dev/shm object", tally, true);
    if (faulted > 0) print("/dev/shm, faulted in on " + n + " threads, then one call", bytes, faulted, reference);
  }
  auto page = HostPool::hugetlbfs_page_bytes(hugetlbfs_dir);
  if (!page.ok()) {
    std::printf("SKIP  pinning [hugetlbfs]: %s\n", page.error().message.c_str());
    return;
  }
  const std::size_t huge_bytes = (bytes + *page - 1) / *page * *page;
  if (const std::int64_t free_pages = ipc::free_huge_pages(*page);
      free_pages >= 0 && static_cast<std::uint64_t>(free_pages) < huge_bytes / *page) {
    std::printf("SKIP  pinning [hugetlbfs]: %zu pages of %llu kB needed, %lld free (sysctl vm.nr_hugepages)\n",
                huge_bytes / *page, static_cast<unsigned long long>(*page >> 10), static_cast<long long>(free_pages));
    return;
  }
  if (auto huge = pool_like_object(hugetlbfs_dir, huge_bytes)) {
    const double gbps = time_pin(backend, huge->data(), huge_bytes, 1, "huge pages", tally);
    if (gbps > 0) print(fmt::format("hugetlbfs {} kB pages, one call", *page >> 10), huge_bytes, gbps, reference);
  }
}

}  // namespace kvtd::daemon::selftest
