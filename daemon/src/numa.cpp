#include "kvtd/daemon/numa.h"

#include <numa.h>

#include <cctype>
#include <fstream>

namespace kvtd::daemon {

int numa_node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root) {
  // sysfs spells the bus id in lower case; CUDA prints upper-case hex digits.
  std::string id = pci_bus_id;
  for (char& c : id) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  std::ifstream in(sysfs_root + "/bus/pci/devices/" + id + "/numa_node");
  int node = -1;
  if (!(in >> node)) return -1;
  return node < 0 ? -1 : node;
}

bool bind_to_numa_node(void* addr, std::size_t bytes, int node, std::string* why) {
  if (numa_available() < 0) {
    if (why) *why = "libnuma reports no NUMA support on this machine";
    return false;
  }
  if (node < 0 || node > numa_max_node()) {
    if (why) *why = "NUMA node " + std::to_string(node) + " does not exist (max " + std::to_string(numa_max_node()) + ")";
    return false;
  }
  numa_tonode_memory(addr, bytes, node);
  return true;
}

}  // namespace kvtd::daemon
