#include "kvtd/daemon/selftest.h"

#include <sys/mman.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "kvtd/daemon/device_backend.h"

namespace kvtd::daemon {
namespace {

using kernels::CopyPlan;
using kernels::CopyTarget;

struct Tally {
  int passed = 0;
  int failed = 0;
  void check(bool ok, const std::string& what, const std::string& detail = "") {
    (ok ? passed : failed)++;
    std::printf("%s  %s%s%s\n", ok ? "PASS" : "FAIL", what.c_str(), detail.empty() ? "" : ": ", detail.c_str());
  }
};

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
      if (readback != t.dev_mirror) return "device tensor " + std::to_string(i) + " differs";
      if (std::memcmp(t.host, t.host_mirror.data(), t.host_mirror.size()) != 0)
        return "host tensor " + std::to_string(i) + " differs";
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

// GB/s of one direction: 256 random blocks of `kib` KiB (32 KiB: 16-token bf16 blocks of 8 heads x
// 128) per tensor; `contiguous`: blocks 0..255 to 0..255 instead, one plain copy per tensor (the
// link's own figure, next to which the scattered ones are read). A copy that fails is reported
// (and fails the self-test), never timed.
bool measure(DeviceBackend& backend, const std::string& mode, std::uint32_t layers, std::uint32_t kib,
             bool contiguous) {
  const std::int64_t blocks = 512;
  const std::uint64_t bb = std::uint64_t{kib} << 10;
  std::vector<TensorPair> ts;
  std::vector<CopyTarget> to_host, to_dev;
  for (std::uint32_t i = 0; i < layers * 2; ++i) {
    auto d = backend.alloc_device(static_cast<std::size_t>(bb * blocks));
    auto h = backend.alloc_host(static_cast<std::size_t>(bb * blocks));
    if (!d.ok() || !h.ok()) {
      std::printf("bandwidth [%s]: allocation failed\n", mode.c_str());
      return false;
    }
    to_host.push_back(kernels::packed_target(*d, *h, bb));
    to_dev.push_back(kernels::packed_target(*h, *d, bb));
  }
  std::vector<std::int32_t> src(blocks), dst(blocks);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937 rng(3);
  if (!contiguous) {
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
  }
  src.resize(256);
  dst.resize(256);
  auto plan = kernels::plan_copy(src, dst, blocks, blocks, std::vector<std::uint64_t>{bb});
  if (!plan.ok()) return false;
  // The stand-in runs on the CPU: its figures say nothing about a GPU.
  const char* note = cuda_stand_in() && backend.name() == std::string("cuda") ? "; CUDA stand-in on the CPU, not a GPU figure" : "";
  for (Direction dir : {Direction::kToHost, Direction::kToDevice}) {
    const auto& t = dir == Direction::kToHost ? to_host : to_dev;
    const int reps = 8;
    std::chrono::steady_clock::time_point t0;
    for (int i = -1; i < reps; ++i) {  // -1: warm-up
      if (i == 0) t0 = std::chrono::steady_clock::now();
      if (auto st = backend.copy(dir, *plan, t); !st.ok()) {
        std::printf("FAIL  bandwidth %s [%s]: %s\n", dir == Direction::kToHost ? "to-host" : "to-device",
                    mode.c_str(), st.error().message.c_str());
        return false;
      }
    }
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double gb = static_cast<double>(bb) * 256.0 * static_cast<double>(t.size()) * reps / 1e9;
    std::printf("bandwidth %-9s [%s] %2u KiB: %.2f GB/s (256 %s blocks x %zu tensors%s)\n",
                dir == Direction::kToHost ? "to-host" : "to-device", contiguous ? "contiguous" : mode.c_str(), kib,
                gb / s, contiguous ? "consecutive" : "random", t.size(), note);
  }
  return true;
}

// How long pinning host memory takes here (the daemon pins its whole host pool at start, ~0.1 s
// per GB on CUDA): `mib` MiB of fresh pages, registered and released.
void measure_pinning(HostMemory& backend, std::uint32_t mib, Tally& tally) {
  if (mib == 0 || !backend.pins_memory()) return;
  const std::size_t bytes = std::size_t{mib} << 20;
  void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    tally.check(false, "pin " + std::to_string(mib) + " MiB", "mmap failed");
    return;
  }
  std::memset(p, 0, bytes);  // faulted in first, as the pool's pages are before it is pinned
  const auto start = std::chrono::steady_clock::now();
  auto st = backend.pin_host(static_cast<std::byte*>(p), bytes);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  tally.check(st.ok(), "pin " + std::to_string(mib) + " MiB of host memory", st.ok() ? "" : st.error().message);
  if (st.ok()) {
    std::printf("pinning: %u MiB in %.3f s (%.2f GB/s; a host pool of N GB takes N / this at start)\n", mib, s,
                static_cast<double>(bytes) / s / 1e9);
    backend.unpin_host(static_cast<std::byte*>(p));
  }
  munmap(p, bytes);
}

}  // namespace

int run_selftest(int argc, char** argv) {
  CLI::App app{"kvtd selftest - check a device backend's bytes against the host executor"};
  std::string backend_name = "host", mode_name;
  int device_id = 0;
  std::uint32_t bench_layers = 8;
  app.add_option("--device-backend", backend_name, "cuda | host")->check(CLI::IsMember({"cuda", "host"}));
  app.add_option("--device-id,--device_id", device_id, "CUDA device ordinal");
  app.add_option("--scatter-mode", mode_name, "Only this scatter mode (default: every mode)");
  app.add_option("--bench-layers", bench_layers, "Layers in the bandwidth measurement (0 = skip)");
  std::uint32_t pin_mib = 256;
  std::vector<std::uint32_t> block_kib{32};
  app.add_option("--bench-block-kib", block_kib, "Block sizes (KiB) of the bandwidth measurement, e.g. 8,16,32,64")
      ->delimiter(',')
      ->check(CLI::Range(1u, 1024u));
  app.add_option("--pin-mib", pin_mib, "MiB of host memory to pin and time, as the host pool is (0 = skip)");
  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    return app.exit(e) == 0 ? 0 : 2;
  }

  std::vector<config::ScatterMode> modes;
  if (!mode_name.empty()) {
    config::ScatterMode m{};
    if (!config::parse_scatter_mode(mode_name, &m)) {
      std::fprintf(stderr, "kvtd selftest: --scatter-mode '%s' is not one of kernel, kernel-per-layer, batch, memcpy\n",
                   mode_name.c_str());
      return 2;
    }
    modes.push_back(m);
  } else {
    modes = {config::ScatterMode::kKernelAllLayers, config::ScatterMode::kKernelPerLayer, config::ScatterMode::kBatch,
             config::ScatterMode::kMemcpy};
  }

  Tally tally;
  // The host backend has one way to copy; the CUDA backend is checked in every mode.
  const std::size_t runs = backend_name == "host" ? 1 : modes.size();
  for (std::size_t m = 0; m < runs; ++m) {
    std::unique_ptr<DeviceBackend> backend;
    std::string label = "host";
    if (backend_name == "cuda") {
      label = config::scatter_mode_name(modes[m]);
      auto b = make_cuda_backend(device_id, modes[m]);
      if (!b.ok()) {
        if (modes[m] == config::ScatterMode::kBatch && cuda_compiled_in() && modes.size() > 1 &&
            b.error().message.find("CUDA 13") != std::string::npos) {
          std::printf("SKIP  mode batch: %s\n", b.error().message.c_str());
          continue;
        }
        std::fprintf(stderr, "kvtd selftest: no usable GPU for --device-backend cuda: %s\n", b.error().message.c_str());
        return kSelftestUnavailable;
      }
      backend = std::move(b).value();
    } else {
      backend = make_host_backend();
    }
    // 3 layers of key, value (4 KiB blocks: the 16-byte path of the kernels), fp8-style scales
    // (24-byte blocks: the 8-byte path) and a 6-byte tensor (the byte path).
    Fixture f{*backend, 64, 64, 3, {4096, 4096, 24, 24, 6}, {}, std::mt19937_64{17}, {}};
    if (!f.allocate()) {
      tally.check(false, "allocate test tensors [" + label + "]", f.error);
      continue;
    }
    check_copies(f, tally, label);
    check_layout(f, tally, label);
    for (std::uint32_t kib : bench_layers > 0 ? block_kib : std::vector<std::uint32_t>{}) {
      if (!measure(*backend, label, bench_layers, kib, false)) ++tally.failed;
      // The contiguous figure once per block size (it does not depend on the scatter mode).
      if (m == 0 && !measure(*backend, label, bench_layers, kib, true)) ++tally.failed;
    }
    if (m == 0) measure_pinning(*backend, pin_mib, tally);
  }
  std::printf("selftest (%s): %d passed, %d failed\n", backend_name.c_str(), tally.passed, tally.failed);
  return tally.failed == 0 ? 0 : 1;
}

}  // namespace kvtd::daemon
