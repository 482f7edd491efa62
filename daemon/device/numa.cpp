#include "kvtd/base/mutex.h"
#include "kvtd/daemon/numa.h"

#include <numa.h>
#include <pthread.h>
#include <numaif.h>
#include <sched.h>

#include <cctype>
#include <cerrno>
#include <cstring>
#include <fmt/format.h>
#include <mutex>
#include <vector>

#include "kvtd/daemon/log.h"
#include <filesystem>
#include <fstream>

namespace kvtd::daemon {
namespace {

// sysfs spells bus ids in lower case with a 4-digit domain; CUDA prints upper-case hex and
// NVML an 8-digit domain.
std::string normalize_bus_id(std::string id) {
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  const auto colon = id.find(':');
  if (colon == 8 && id.compare(0, 4, "0000") == 0) id.erase(0, 4);
  return id;
}

// libnuma builds its node-to-CPU table lazily on first use, without a lock: copy threads that
// bind at once raced on it (ThreadSanitizer, in the daemon's storage workers). Every libnuma
// call here holds this mutex.
Mutex& libnuma_mutex() {
  static Mutex m;
  return m;
}

// NUMA is supported here and `node` exists; else false with `why`. Caller holds libnuma_mutex.
bool usable_node(int node, std::string* why) {
  if (numa_available() < 0) {
    if (why) *why = "libnuma reports no NUMA support on this machine";
    return false;
  }
  if (node < 0 || node > numa_max_node()) {
    if (why) *why = fmt::format("NUMA node {} does not exist (max {})", node, numa_max_node());
    return false;
  }
  return true;
}

int read_node(const std::filesystem::path& file) {
  std::ifstream in(file);
  int node = -1;
  if (!(in >> node)) return -1;
  return node < 0 ? -1 : node;
}

}  // namespace

int numa_node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root) {
  if (pci_bus_id.empty()) return -1;
  return read_node(std::filesystem::path(sysfs_root) / "bus/pci/devices" / normalize_bus_id(pci_bus_id) / "numa_node");
}

int numa_node_of_gpu(const std::string& pci_bus_id, int ordinal, const std::string& sysfs_root, std::string* how) {
  namespace fs = std::filesystem;
  if (const int n = numa_node_of_pci_device(pci_bus_id, sysfs_root); n >= 0) {
    if (how) *how = sysfs_root + "/bus/pci/devices/" + normalize_bus_id(pci_bus_id) + "/numa_node";
    return n;
  }
  const fs::path cls = fs::path(sysfs_root) / "class/nvidia-gpu";
  std::error_code ec;
  if (!pci_bus_id.empty() && fs::is_directory(cls, ec)) {
    const std::string want = normalize_bus_id(pci_bus_id);
    for (const auto& entry : fs::directory_iterator(cls, ec)) {
      // <entry>/device links to the PCI device directory, whose name is the bus id.
      const fs::path dev = fs::canonical(entry.path() / "device", ec);
      if (ec || dev.filename().string() != want) continue;
      const int n = read_node(entry.path() / "device/numa_node");
      if (n >= 0 && how) *how = (entry.path() / "device/numa_node").string();
      return n;
    }
  }
  if (ordinal >= 0) {
    const fs::path file = cls / fmt::format("nvidia{}", ordinal) / "device/numa_node";
    const int n = read_node(file);
    if (n >= 0 && how) *how = file.string();
    return n;
  }
  return -1;
}

bool bind_to_numa_node(void* addr, std::size_t bytes, int node, std::string* why) {
  {
    MutexLock g(libnuma_mutex());
    if (!usable_node(node, why)) return false;
  }
  // mbind, not numa_tonode_memory: that returns void, so a refused bind would pass for done. A
  // preferred policy, not a strict bind: a full node falls back to another instead of the OOM
  // killer ending the daemon during the pool's first touch.
  constexpr std::size_t kBits = sizeof(unsigned long) * 8;
  std::vector<unsigned long> mask(static_cast<std::size_t>(node) / kBits + 1, 0);
  mask[static_cast<std::size_t>(node) / kBits] |= 1ul << (static_cast<std::size_t>(node) % kBits);
  if (mbind(addr, bytes, MPOL_PREFERRED, mask.data(), mask.size() * kBits, 0) != 0) {
    if (why) *why = std::string("mbind: ") + std::strerror(errno);
    return false;
  }
  return true;
}

bool bind_this_thread_to_numa_node(int node, std::string* why) {
  cpu_set_t allowed, set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof allowed, &allowed) != 0) CPU_ZERO(&allowed);
  {
    MutexLock g(libnuma_mutex());
    if (!usable_node(node, why)) return false;
    struct bitmask* cpus = numa_allocate_cpumask();
    if (numa_node_to_cpus(node, cpus) != 0) {
      numa_free_cpumask(cpus);
      if (why) *why = fmt::format("cannot read the CPUs of NUMA node {}", node);
      return false;
    }
    for (unsigned c = 0; c < cpus->size && c < CPU_SETSIZE; ++c)
      if (numa_bitmask_isbitset(cpus, c) && CPU_ISSET(c, &allowed)) CPU_SET(c, &set);
    numa_free_cpumask(cpus);
  }
  if (CPU_COUNT(&set) == 0) {
    if (why) *why = fmt::format("none of NUMA node {}'s CPUs is allowed for this process", node);
    return false;
  }
  if (sched_setaffinity(0, sizeof set, &set) != 0) {  // 0: the calling thread
    if (why) *why = "sched_setaffinity failed";
    return false;
  }
  {
    MutexLock g(libnuma_mutex());
    numa_set_preferred(node);  // this thread's policy
  }
  return true;
}

void start_copy_thread(const char* name, int node) {
  if (node >= 0) {
    std::string why;
    if (bind_this_thread_to_numa_node(node, &why))
      KVTD_DEBUG("thread {} runs on NUMA node {}", name, node);
    else
      KVTD_WARN("thread {} not bound to NUMA node {}: {}", name, node, why);
  }
  // Named last: a thread seen under its name has its final affinity.
  pthread_setname_np(pthread_self(), name);
}

}  // namespace kvtd::daemon
