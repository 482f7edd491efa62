#include "kvtd/daemon/selftest.h"

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fmt/format.h>
#include <map>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "selftest_parts.h"
#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {
namespace {

using kernels::CopyPlan;
using kernels::CopyTarget;
using selftest::Tally;


// One tensor on both sides: a device allocation and a host-pool allocation, each mirrored in
// ordinary memory so the host executor can compute the expected bytes.
struct TensorPair {
  std::byte* dev = nullptr;
  std::byte* host = nullptr;
  std::uint64_t block_bytes = 0;
  std::vector<std::byte> dev_mirror, host_mirror;
};

struct Fixture {
  DeviceBackend& backend;
  std::int64_t dev_blocks, host_blocks;
  std::uint32_t layers;
  std::vector<std::uint64_t> bytes_per_tensor;  // per tensor within a layer
  std::vector<TensorPair> tensors;              // layers x tensors, layer-major
  std::mt19937_64 rng{17};

  std::string error;

  bool allocate() {
    for (std::uint32_t l = 0; l < layers; ++l)
      for (auto bb : bytes_per_tensor) {
        TensorPair t;
        t.block_bytes = bb;
        auto d = backend.alloc_device(static_cast<std::size_t>(bb * static_cast<std::uint64_t>(dev_blocks)));
        auto h = backend.alloc_host(static_cast<std::size_t>(bb * static_cast<std::uint64_t>(host_blocks)));
        if (!d.ok() || !h.ok()) {
          error = !d.ok() ? d.error().message : h.error().message;
          return false;
        }
        t.dev = *d;
        t.host = *h;
        t.dev_mirror.resize(static_cast<std::size_t>(bb * static_cast<std::uint64_t>(dev_blocks)));
        t.host_mirror.resize(static_cast<std::size_t>(bb * static_cast<std::uint64_t>(host_blocks)));
        tensors.push_back(std::move(t));
      }
    return true;
  }

  // Random bytes everywhere, mirrors included.
  bool randomize() {
    for (auto& t : tensors) {
      for (auto& b : t.dev_mirror) b = static_cast<std::byte>(rng());
      for (auto& b : t.host_mirror) b = static_cast<std::byte>(rng());
      if (auto st = backend.write_device(t.dev, t.dev_mirror.data(), t.dev_mirror.size()); !st.ok()) {
        error = st.error().message;
        return false;
      }
      std::memcpy(t.host, t.host_mirror.data(), t.host_mirror.size());
    }
    return true;
  }

  std::vector<CopyTarget> targets(Direction dir, bool mirrors) {
    std::vector<CopyTarget> out;
    for (auto& t : tensors) {
      std::byte* d = mirrors ? t.dev_mirror.data() : t.dev;
      std::byte* h = mirrors ? t.host_mirror.data() : t.host;
      out.push_back(dir == Direction::kToHost ? kernels::packed_target(d, h, t.block_bytes)
                                              : kernels::packed_target(h, d, t.block_bytes));
    }
    return out;
  }

  // Compares both sides with their mirrors; returns a description of the first difference.
  std::string compare() {
    std::vector<std::byte> readback;
    for (std::size_t i = 0; i < tensors.size(); ++i) {
      auto& t = tensors[i];
      readback.resize(t.dev_mirror.size());
      if (auto st = backend.read_device(readback.data(), t.dev, readback.size()); !st.ok()) return st.error().message;
      if (readback != t.dev_mirror) return fmt::format("device tensor {} differs", i);
      if (std::memcmp(t.host, t.host_mirror.data(), t.host_mirror.size()) != 0)
        return fmt::format("host tensor {} differs", i);
    }
    return "";
  }
};

struct Shape {
  const char* name;
  std::vector<std::int32_t> src, dst;
};

std::vector<Shape> shapes(std::int64_t dev_blocks, std::int64_t host_blocks, std::mt19937_64& rng, bool to_host) {
  const std::int64_t src_blocks = to_host ? dev_blocks : host_blocks;
  const std::int64_t dst_blocks = to_host ? host_blocks : dev_blocks;
  std::vector<Shape> out;
  Shape runs{"runs-only", {}, {}};
  for (std::int32_t i = 0; i < 12; ++i) {
    runs.src.push_back(3 + i);
    runs.dst.push_back(20 + i);
  }
  for (std::int32_t i = 0; i < 5; ++i) {
    runs.src.push_back(40 + i);
    runs.dst.push_back(2 + i);
  }
  out.push_back(runs);
  std::vector<std::int32_t> s(static_cast<std::size_t>(src_blocks)), d(static_cast<std::size_t>(dst_blocks));
  std::iota(s.begin(), s.end(), 0);
  std::iota(d.begin(), d.end(), 0);
  std::shuffle(s.begin(), s.end(), rng);
  std::shuffle(d.begin(), d.end(), rng);
  Shape scattered{"scattered-only", {}, {}};
  for (std::size_t i = 0; i < 24; ++i) {
    // Avoid accidental runs so the shape really is scattered only.
    if (!scattered.src.empty() && s[i] == scattered.src.back() + 1 && d[i] == scattered.dst.back() + 1) continue;
    scattered.src.push_back(s[i]);
    scattered.dst.push_back(d[i]);
  }
  out.push_back(scattered);
  Shape mixed{"mixed", {}, {}};
  for (std::int32_t i = 0; i < 6; ++i) {
    mixed.src.push_back(50 + i);
    mixed.dst.push_back(30 + i);
  }
  for (std::size_t i = 0; i < 10; ++i) {
    if (d[i] >= 30 && d[i] < 36) continue;  // keep destinations unique
    mixed.src.push_back(s[i]);
    mixed.dst.push_back(d[i]);
  }
  out.push_back(mixed);
  return out;
}

// The expected bytes, computed without the planner or any executor kvtd ships: one memcpy per
// (pair, tensor), straight from the task's id lists. (It used to be copy_all_host, which is
// what the host backend runs, so the host self-test compared that executor with itself.)
void naive_copy(const std::vector<std::int32_t>& src, const std::vector<std::int32_t>& dst,
                const std::vector<CopyTarget>& targets) {
  for (const auto& t : targets)
    for (std::size_t i = 0; i < src.size(); ++i)
      std::memcpy(t.dst + static_cast<std::uint64_t>(dst[i]) * t.dst_stride,
                  t.src + static_cast<std::uint64_t>(src[i]) * t.src_stride, t.block_bytes);
}

void check_copies(Fixture& f, Tally& tally, const std::string& mode) {
  for (Direction dir : {Direction::kToHost, Direction::kToDevice}) {
    const bool to_host = dir == Direction::kToHost;
    for (const auto& shape : shapes(f.dev_blocks, f.host_blocks, f.rng, to_host)) {
      for (bool layerwise : {false, true}) {
        const std::string what = std::string(shape.name) + (to_host ? " to-host " : " to-device ") +
                                 (layerwise ? "layer-by-layer" : "all-layers") + " [" + mode + "]";
        auto plan = kernels::plan_copy(shape.src, shape.dst, to_host ? f.dev_blocks : f.host_blocks,
                                       to_host ? f.host_blocks : f.dev_blocks, f.bytes_per_tensor);
        if (!plan.ok()) {
          tally.check(false, what, plan.error().message);
          continue;
        }
        if (!f.randomize()) {
          tally.check(false, what, f.error);
          continue;
        }
        const auto real = f.targets(dir, false);
        const auto mirror = f.targets(dir, true);
        naive_copy(shape.src, shape.dst, mirror);
        Status<DeviceErrc> st;
        std::vector<std::uint32_t> order;
        if (layerwise) {
          std::vector<std::uint32_t> queued;
          st = f.backend.copy_layerwise(
              dir, *plan, real, f.bytes_per_tensor.size(), [&](std::uint32_t l) { queued.push_back(l); },
              [&](std::uint32_t l) {
                // A layer is reported done only after it was reported queued.
                order.push_back(queued.size() > l ? l : 1000 + l);
              });
        } else {
          st = f.backend.copy(dir, *plan, real);
        }
        if (!st.ok()) {
          tally.check(false, what, st.error().message);
          continue;
        }
        std::string diff = f.compare();
        if (diff.empty() && layerwise) {
          std::vector<std::uint32_t> want(f.layers);
          std::iota(want.begin(), want.end(), 0u);
          if (order != want) diff = "layer progress out of order or incomplete";
        }
        tally.check(diff.empty(), what, diff);
      }
    }
  }
}

void check_layout(Fixture& f, Tally& tally, const std::string& mode) {
  const std::string what = "layout transform gather+scatter [" + mode + "]";
  if (!f.randomize()) return tally.check(false, what, f.error);
  std::vector<kernels::LayerTensor> real, mirror;
  for (auto& t : f.tensors) {
    real.push_back({t.dev, t.block_bytes, t.block_bytes});
    mirror.push_back({t.dev_mirror.data(), t.block_bytes, t.block_bytes});
  }
  const std::vector<std::int32_t> ids{7, 3, 9, 10, 11, 0, 31};
  const std::vector<std::int32_t> back{1, 2, 3, 40, 41, 42, 60};
  const std::uint64_t object = kernels::staging_object_bytes(real);
  auto staging = f.backend.alloc_host(static_cast<std::size_t>(object * ids.size()));
  if (!staging.ok()) return tally.check(false, what, staging.error().message);
  std::vector<std::byte> expect(static_cast<std::size_t>(object * ids.size()));
  kernels::gather_to_staging_host(mirror, ids, expect.data());
  if (auto st = f.backend.gather_to_staging(real, ids, *staging); !st.ok()) return tally.check(false, what, st.error().message);
  if (std::memcmp(*staging, expect.data(), expect.size()) != 0) return tally.check(false, what, "staged objects differ");
  kernels::scatter_from_staging_host(mirror, back, expect.data());
  if (auto st = f.backend.scatter_from_staging(real, back, *staging); !st.ok())
    return tally.check(false, what, st.error().message);
  tally.check(f.compare().empty(), what, f.compare());
}

// Every flag of `kvtd selftest`.
struct SelftestOptions {
  std::string backend_name = "host", mode_name;
  int device_id = 0;
  std::uint32_t bench_layers = 8;
  std::uint32_t pin_mib = 256, pin_threads = 4;
  std::vector<std::uint32_t> block_kib{32};
  selftest::BenchShape bench;
  std::string host_layout = "layer_first", hugetlbfs_dir = "/dev/hugepages";
  bool across_processes = true;
};

void declare_options(CLI::App& app, SelftestOptions& o) {
  app.add_option("--device-backend", o.backend_name, "cuda | host")->check(CLI::IsMember({"cuda", "host"}));
  app.add_option("--device-id,--device_id", o.device_id, "CUDA device ordinal");
  app.add_option("--scatter-mode", o.mode_name, "Only this scatter mode (default: every mode)");
  app.add_option("--bench-layers", o.bench_layers, "Layers in the bandwidth measurement (0 = skip)");
  app.add_option("--bench-block-kib", o.block_kib, "Block sizes (KiB) of the bandwidth measurement, e.g. 8,16,32,64")
      ->delimiter(',')
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--bench-blocks", o.bench.blocks, "Blocks moved per tensor in the bandwidth measurement")
      ->check(CLI::Range(1u, 1u << 20));
  app.add_flag("--bench-layerwise", o.bench.layerwise, "Time layer-by-layer copies (an event per layer)");
  app.add_option("--bench-host-layout", o.host_layout, "Host pool layout of the measurement")
      ->check(CLI::IsMember({"layer_first", "page_first"}));
  app.add_option("--pin-mib", o.pin_mib,
                 "MiB of host memory to pin and time in each way a host pool can be mapped (0 = skip)");
  app.add_option("--pin-threads", o.pin_threads, "Threads of the parallel pinning figure (as --host-pool-pin-threads)")
      ->check(CLI::Range(1u, 64u));
  app.add_option("--hugetlbfs-dir", o.hugetlbfs_dir, "The hugetlbfs mount of the huge-page pinning figure");
  app.add_flag("--ipc,!--no-ipc", o.across_processes,
               "Also open an engine process's tensors and event, as the daemon does (default: on)");
}

// The scatter modes to check: the one named, or every one; false (after a message) for a bad name.
bool modes_of(const SelftestOptions& o, std::vector<ScatterMode>* modes) {
  if (o.mode_name.empty()) {
    *modes = {ScatterMode::kKernelAllLayers, ScatterMode::kKernelPerLayer, ScatterMode::kBatch,
              ScatterMode::kMemcpy};
    return true;
  }
  ScatterMode m{};
  if (!parse_scatter_mode(o.mode_name, &m)) {
    std::fprintf(stderr, "kvtd selftest: --scatter-mode '%s' is not one of kernel, kernel-per-layer, batch, memcpy\n",
                 o.mode_name.c_str());
    return false;
  }
  modes->push_back(m);
  return true;
}

// Every check and figure of one backend (the first run also measures the contiguous reference,
// pinning and the footprint).
void check_backend(DeviceBackend& backend, const std::string& label, bool first, SelftestOptions& o,
                   selftest::EnginePeer& peer, std::map<std::uint32_t, selftest::Figures>& contiguous,
                   Tally& tally) {
  // 3 layers of key, value (4 KiB blocks: the 16-byte path of the kernels), fp8-style scales
  // (24-byte blocks: the 8-byte path) and a 6-byte tensor (the byte path).
  Fixture f{backend, 64, 64, 3, {4096, 4096, 24, 24, 6}, {}, std::mt19937_64{17}, {}};
  if (!f.allocate()) return tally.check(false, "allocate test tensors [" + label + "]", f.error);
  check_copies(f, tally, label);
  check_layout(f, tally, label);
  if (peer.pid > 0) selftest::check_across_processes(backend, peer, tally);
  for (std::uint32_t kib : o.bench_layers > 0 ? o.block_kib : std::vector<std::uint32_t>{}) {
    o.bench.kib = kib;
    // The contiguous figure once per block size (it does not depend on the scatter mode), first:
    // every mode's line then says its ratio to it, the goal being the link's own speed.
    o.bench.contiguous = true;
    if (first && !selftest::measure_bandwidth(backend, label, o.bench, nullptr, &contiguous[kib])) ++tally.failed;
    o.bench.contiguous = false;
    const auto ref = contiguous.find(kib);
    if (!selftest::measure_bandwidth(backend, label, o.bench, ref != contiguous.end() ? &ref->second : nullptr))
      ++tally.failed;
  }
  if (!first) return;
  selftest::measure_pinning(backend, o.pin_mib, o.pin_threads, o.hugetlbfs_dir, tally);
  if (const std::string held = backend.device_footprint(); !held.empty())
    std::printf("footprint: this process holds %s\n", held.c_str());
}

}  // namespace

int run_selftest(int argc, char** argv) {
  CLI::App app{"kvtd selftest - check a device backend's bytes against the host executor"};
  SelftestOptions o;
  declare_options(app, o);
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }
  o.bench.layers = o.bench_layers;
  o.bench.host_layout = o.host_layout == "page_first" ? HostLayout::kPageFirst : HostLayout::kLayerFirst;
  std::vector<ScatterMode> modes;
  if (!modes_of(o, &modes)) return 2;

  // Forked before this process touches the device: a CUDA context does not survive fork.
  selftest::EnginePeer peer;
  if (o.across_processes) peer = selftest::start_engine_peer(o.backend_name, o.device_id);
  Tally tally;
  // The host backend has one way to copy; the CUDA backend is checked in every mode.
  const std::size_t runs = o.backend_name == "host" ? 1 : modes.size();
  std::map<std::uint32_t, selftest::Figures> contiguous;  // per block KiB: the reference of every mode
  for (std::size_t m = 0; m < runs; ++m) {
    if (o.backend_name != "cuda") {
      check_backend(*make_host_backend(), "host", m == 0, o, peer, contiguous, tally);
      continue;
    }
    auto b = make_cuda_backend(o.device_id, modes[m]);
    if (!b.ok()) {
      if (modes[m] == ScatterMode::kBatch && cuda_compiled_in() && modes.size() > 1 &&
          b.error().message.find("CUDA 13") != std::string::npos) {
        std::printf("SKIP  mode batch: %s\n", b.error().message.c_str());
        continue;
      }
      std::fprintf(stderr, "kvtd selftest: no usable GPU for --device-backend cuda: %s\n", b.error().message.c_str());
      return kSelftestUnavailable;
    }
    check_backend(**b, scatter_mode_name(modes[m]), m == 0, o, peer, contiguous, tally);
  }
  if (peer.pid > 0) tally.check(false, "cross-process check", "no backend ran it");
  std::printf("selftest (%s): %d passed, %d failed\n", o.backend_name.c_str(), tally.passed, tally.failed);
  return tally.failed == 0 ? 0 : 1;
}

}  // namespace kvtd::daemon
