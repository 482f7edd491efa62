// kvtd/daemon/numa.h - keep the host side of every copy on the NUMA node of the rank's GPU: the
// host pool's pages and the threads that copy (swap lanes, storage workers).
//
// The node comes from sysfs, never from shelling out to nvidia-smi: first the PCI device
// (/sys/bus/pci/devices/<bus id>/numa_node), then the NVIDIA driver's class directory
// (/sys/class/nvidia-gpu/*/device, matched by bus id, else nvidia<ordinal>), which exists where
// the PCI tree is not fully visible (some containers). Binding uses libnuma and mbind. The sysfs
// root is a parameter so tests can point it at a directory they made.
//
// Thread-safety: stateless; bind_this_thread_to_numa_node affects only the calling thread.
#pragma once

#include <cstddef>
#include <string>

namespace kvtd::daemon {

// NUMA node of a PCI device given as CUDA or NVML print it ("0000:3B:00.0",
// "00000000:3B:00.0"), or -1 when sysfs does not say (no such device, no NUMA, or "-1").
int numa_node_of_pci_device(const std::string& pci_bus_id, const std::string& sysfs_root = "/sys");

// The GPU's node: the PCI path, else /sys/class/nvidia-gpu (by bus id, else by `ordinal`); -1
// when neither says. `how` (if non-null) names the sysfs file that answered.
int numa_node_of_gpu(const std::string& pci_bus_id, int ordinal, const std::string& sysfs_root = "/sys",
                     std::string* how = nullptr);

// Makes `node` the preferred node of [addr, addr+bytes) (page aligned) before it is touched
// (mbind, MPOL_PREFERRED: a full node spills over instead of failing). False (with `why`) if
// NUMA is not usable here, the node does not exist or the kernel refused; the memory stays
// usable either way.
bool bind_to_numa_node(void* addr, std::size_t bytes, int node, std::string* why);

// Runs the calling thread only on `node`'s CPUs (those this process may use) and prefers
// `node` for its allocations. False (with `why`) if NUMA is unavailable, the node does not exist
// or none of its CPUs is allowed here; the thread then keeps running where it was allowed.
bool bind_this_thread_to_numa_node(int node, std::string* why);

// At the start of a copy thread: names it (`name`, at most 15 characters, shown in top and
// /proc/<pid>/task/*/comm) and binds it to `node` (-1: no binding); a failed bind is logged as
// a warning and the thread runs unbound.
void start_copy_thread(const char* name, int node);

}  // namespace kvtd::daemon
