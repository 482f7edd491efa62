// kvtd/daemon/numa.h - place the host pool on the NUMA node of the rank's GPU.
//
// The node comes from sysfs (/sys/bus/pci/devices/<bus id>/numa_node), never from shelling out
// to nvidia-smi; binding uses libnuma. The sysfs root is a parameter so tests can point it at a
// directory they made.
#pragma once

#include <cstddef>
#include <string>

namespace kvtd::daemon {

// NUMA node of a PCI device given as CUDA prints it ("0000:3B:00.0"), or -1 when sysfs does not
// say (no such device, no NUMA, or "-1").
int numa_node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root = "/sys");

// Binds [addr, addr+bytes) to `node` before it is touched. False (with `why`) if libnuma is not
// usable here or the node does not exist; the memory stays usable either way.
bool bind_to_numa_node(void* addr, std::size_t bytes, int node, std::string* why);

}  // namespace kvtd::daemon
