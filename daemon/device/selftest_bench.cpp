// Bandwidth figures of `kvtd selftest` (selftest_parts.h).
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <random>

#include "selftest_parts.h"
#include "kvtd/daemon/host_pool.h"

namespace kvtd::daemon::selftest {
namespace {

// The geometry of a bf16 cache whose blocks are `kib` KiB (1 head of 128, 4 x kib tokens), with
// twice as many device and host blocks as are moved, so the ids can scatter.
proto::CacheGeometry bench_geometry(const BenchShape& s) {
  proto::CacheGeometry g{};
  g.num_ranks = 1;
  g.num_layers = s.layers;
  g.dtype = static_cast<std::uint32_t>(proto::CacheDtype::kBFloat16);
  g.num_host_blocks = 2 * s.blocks;
  const std::int64_t shape[4] = {2 * static_cast<std::int64_t>(s.blocks), 1, 4 * static_cast<std::int64_t>(s.kib), 128};
  std::copy(shape, shape + 4, g.key_shape);
  std::copy(shape, shape + 4, g.value_shape);
  return g;
}

const char* direction_name(Direction d) { return d == Direction::kToHost ? "to-host" : "to-device"; }

}  // namespace

bool measure_bandwidth(DeviceBackend& backend, const std::string& mode, const BenchShape& s, const Figures* reference,
                       Figures* out) {
  const proto::CacheGeometry g = bench_geometry(s);
  const std::uint64_t bb = std::uint64_t{s.kib} << 10;
  const std::uint64_t generation = 0x5E1F0000'00000000ull ^ (static_cast<std::uint64_t>(getpid()) << 20) ^
                                   (std::uint64_t{s.kib} << 8) ^ (s.contiguous ? 1u : 0u);
  auto pool = HostPool::open(backend, g, generation, 0, s.host_layout, backend.numa_node());
  if (!pool.ok()) {
    std::printf("FAIL  bandwidth [%s]: host pool: %s\n", mode.c_str(), pool.error().message.c_str());
    return false;
  }
  std::vector<kernels::CopyTarget> to_host, to_dev;
  for (std::uint32_t l = 0; l < s.layers; ++l)
    for (auto kind : {proto::TensorKind::kKey, proto::TensorKind::kValue}) {
      auto d = backend.alloc_device(static_cast<std::size_t>(bb * g.num_device_blocks()));
      if (!d.ok()) {
        std::printf("FAIL  bandwidth [%s]: device allocation: %s\n", mode.c_str(), d.error().message.c_str());
        (*pool)->remove();
        return false;
      }
      std::byte* host = (*pool)->region(l, kind);
      const std::uint64_t hs = (*pool)->stride(kind);
      to_host.push_back(kernels::CopyTarget{*d, host, bb, bb, hs});
      to_dev.push_back(kernels::CopyTarget{host, *d, bb, hs, bb});
    }
  std::vector<std::int32_t> src(2 * s.blocks), dst(2 * s.blocks);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937 rng(3);
  if (!s.contiguous) {
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
  }
  src.resize(s.blocks);
  dst.resize(s.blocks);
  auto plan = kernels::plan_copy(src, dst, 2 * s.blocks, 2 * s.blocks, std::vector<std::uint64_t>{bb, bb});
  bool ok = plan.ok();
  // The stand-in runs on the CPU: its figures say nothing about a GPU.
  const char* note = cuda_stand_in() && backend.name() == std::string("cuda") ? "; CUDA stand-in on the CPU, not a GPU figure" : "";
  for (Direction dir : {Direction::kToHost, Direction::kToDevice}) {
    if (!ok) break;
    const auto& t = dir == Direction::kToHost ? to_host : to_dev;
    const int reps = 8;
    std::chrono::steady_clock::time_point t0;
    for (int i = -1; i < reps && ok; ++i) {  // -1: warm-up
      if (i == 0) t0 = std::chrono::steady_clock::now();
      auto st = s.layerwise ? backend.copy_layerwise(dir, *plan, t, 2, {}, {}) : backend.copy(dir, *plan, t);
      if (!st.ok()) {
        std::printf("FAIL  bandwidth %s [%s]: %s\n", direction_name(dir), mode.c_str(), st.error().message.c_str());
        ok = false;
      }
    }
    if (!ok) break;
    const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gb = static_cast<double>(bb) * s.blocks * static_cast<double>(t.size()) * reps / 1e9;
    const std::size_t d = dir == Direction::kToHost ? 0 : 1;
    if (out != nullptr) (*out)[d] = gb / secs;
    char ratio[48] = "";
    if (reference != nullptr && (*reference)[d] > 0)
      std::snprintf(ratio, sizeof ratio, " = %.2fx contiguous", gb / secs / (*reference)[d]);
    std::printf("bandwidth %-9s [%s] %2u KiB: %.2f GB/s%s (%u %s blocks x %zu tensors, %s host pool%s%s)\n",
                direction_name(dir), s.contiguous ? "contiguous" : mode.c_str(), s.kib, gb / secs, ratio, s.blocks,
                s.contiguous ? "consecutive" : "random", t.size(),
                s.host_layout == HostLayout::kPageFirst ? "page_first" : "layer_first",
                s.layerwise ? ", layer by layer" : "", note);
  }
  (*pool)->remove();
  return ok;
}

}  // namespace kvtd::daemon::selftest
