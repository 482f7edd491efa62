#include "kvtd/ipc/populate.h"

#include <sys/mman.h>
#include <unistd.h>

#include <atomic>
#include <cstdint>

#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

namespace kvtd::ipc {

void populate_for_write(void* addr, std::size_t bytes) {
  if (addr == nullptr || bytes == 0) return;
  const auto page = static_cast<std::uintptr_t>(sysconf(_SC_PAGESIZE));
  const auto begin = reinterpret_cast<std::uintptr_t>(addr) / page * page;
  const auto end = reinterpret_cast<std::uintptr_t>(addr) + bytes;
  if (madvise(reinterpret_cast<void*>(begin), end - begin, MADV_POPULATE_WRITE) == 0) return;
  // Older kernel: a write fault per page, without changing the contents.
  for (std::uintptr_t p = begin; p < end; p += page) {
    auto* word = reinterpret_cast<std::atomic<std::uint8_t>*>(p < reinterpret_cast<std::uintptr_t>(addr) ? reinterpret_cast<std::uintptr_t>(addr) : p);
    word->fetch_add(0, std::memory_order_relaxed);
  }
}

}  // namespace kvtd::ipc
