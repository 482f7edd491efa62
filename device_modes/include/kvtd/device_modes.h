// kvtd/device_modes.h - the device room's choices that flags make: how the host pool lays
// out its blocks and how the CUDA backend moves scattered blocks. Header-only and free of any
// dependency, so the flag parser (config) converts the flags' text into them.
//
// Pure functions; thread-safe.
#pragma once

#include <cstdint>
#include <string_view>

namespace kvtd::daemon {

// How the host pool lays out its blocks (see kvtd/daemon/host_pool.h).
enum class HostLayout : std::uint32_t { kLayerFirst = 0, kPageFirst = 1 };

constexpr const char* host_layout_name(HostLayout l) {
  return l == HostLayout::kPageFirst ? "page_first" : "layer_first";
}
// Parses a host_layout_name; false for anything else.
constexpr bool parse_host_layout(std::string_view text, HostLayout* out) {
  for (auto l : {HostLayout::kLayerFirst, HostLayout::kPageFirst})
    if (text == host_layout_name(l)) {
      *out = l;
      return true;
    }
  return false;
}

// How the CUDA backend moves scattered (non-run) blocks; runs are one cudaMemcpyAsync each
// (in batch mode they join the batch).
//
// Default: batch. kvtd is a process of its own, so without MPS its kernels run in their own
// context and time-slice with the engine's on the SMs: a copy kernel stalls the model's compute
// for its time slice. The copy engines are scheduled apart from the SMs, so a batch of DMA copies
// overlaps the engine's kernels. With MPS (contexts share the SMs) `kernel` may move many small
// blocks with less per-copy overhead; measure with `kvtd selftest` on the target GPU. Builds whose
// toolkit has no cudaMemcpyBatchAsync (before CUDA 13) fall back to `kernel` unless the flag asks.
enum class ScatterMode {
  kKernelAllLayers,  // "kernel": one warp-per-block launch for every layer and tensor
  kKernelPerLayer,   // "kernel-per-layer": one launch per layer and tensor
  kBatch,            // "batch": cudaMemcpyBatchAsync, copy engines instead of SMs (default)
  kMemcpy,           // "memcpy": one cudaMemcpyAsync per block (reference; slow for small blocks)
};

constexpr const char* scatter_mode_name(ScatterMode m) {
  switch (m) {
    case ScatterMode::kKernelAllLayers: return "kernel";
    case ScatterMode::kKernelPerLayer: return "kernel-per-layer";
    case ScatterMode::kBatch: return "batch";
    case ScatterMode::kMemcpy: return "memcpy";
  }
  return "?";
}
// Parses a scatter_mode_name; false for anything else.
constexpr bool parse_scatter_mode(std::string_view text, ScatterMode* out) {
  for (auto m : {ScatterMode::kKernelAllLayers, ScatterMode::kKernelPerLayer, ScatterMode::kBatch, ScatterMode::kMemcpy})
    if (text == scatter_mode_name(m)) {
      *out = m;
      return true;
    }
  return false;
}

}  // namespace kvtd::daemon
