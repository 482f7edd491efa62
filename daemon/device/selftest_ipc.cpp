// The cross-process check of `kvtd selftest` (selftest_parts.h): an engine in another process
// exports tensors (interior offsets, as torch's caching allocator hands them out) and an event
// it recorded; this process opens them the way the daemon does (open_tensor, await_engine_event),
// swaps blocks to host and back, and the engine checks the bytes it then holds.
#include <sys/wait.h>
#include <unistd.h>

#include <cstring>
#include <fmt/format.h>
#include <numeric>
#include <vector>

#include "selftest_parts.h"
#include "kvtd/ipc/clock.h"

namespace kvtd::daemon::selftest {
namespace {

constexpr std::uint32_t kTensors = 4;       // key and value of two layers
constexpr std::int64_t kBlocks = 32;
constexpr std::uint64_t kBlockBytes = 4096;
constexpr std::uint64_t kOffset = 8192;     // the tensor starts inside its allocation
constexpr std::uint64_t kTensorBytes = kBlocks * kBlockBytes;

// The engine's bytes (`round` 0) and what the daemon writes back (`round` 1), position by position.
std::byte pattern(std::uint32_t round, std::uint32_t tensor, std::uint64_t i) {
  return static_cast<std::byte>((i * 131 + tensor * 17 + round * 89 + (i >> 12)) & 0xFF);
}

struct Exported {
  proto::TensorDesc desc[kTensors];
  std::uint8_t event[proto::kEngineEventBytes];
  std::int32_t error;  // 0, or the step that failed in the engine
};

bool write_all(int fd, const void* p, std::size_t n) {
  const auto* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = write(fd, c, n);
    if (w <= 0) return false;
    c += w;
    n -= static_cast<std::size_t>(w);
  }
  return true;
}

bool read_all(int fd, void* p, std::size_t n) {
  auto* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = read(fd, c, n);
    if (r <= 0) return false;
    c += r;
    n -= static_cast<std::size_t>(r);
  }
  return true;
}

// Fills the tensors, records the exported event on its copy stream, and publishes both.
std::int32_t export_engine(DeviceBackend& b, int device_id, std::vector<std::byte*>& tensors, Exported& out) {
  std::vector<std::byte> bytes(kTensorBytes);
  for (std::uint32_t t = 0; t < kTensors; ++t) {
    auto e = b.create_exported(kOffset + kTensorBytes, fmt::format("kvtd-selftest-{}-{}", getpid(), t));
    if (!e.ok()) return 1;
    tensors.push_back(e->ptr + kOffset);
    for (std::uint64_t i = 0; i < kTensorBytes; ++i) bytes[i] = pattern(0, t, i);
    if (!b.write_device(tensors.back(), bytes.data(), bytes.size()).ok()) return 2;
    proto::TensorDesc& d = out.desc[t];
    d.valid = 1;
    d.layer = t / 2;
    d.kind = t % 2;
    d.device_id = device_id;
    d.bytes = kTensorBytes;
    d.offset = kOffset;
    std::memcpy(d.handle, e->handle.data(), sizeof d.handle);
  }
  // The engine's event: recorded by a layer-by-layer copy of one block into a scratch tensor.
  auto events = b.export_layer_events(1);
  if (!events.ok()) return 3;
  if (!events->empty()) {
    std::memcpy(out.event, (*events)[0].data(), sizeof out.event);
    auto scratch = b.alloc_device(kBlockBytes);
    auto host = b.alloc_host(kBlockBytes);
    auto plan = kernels::plan_copy(std::vector<std::int32_t>{0}, std::vector<std::int32_t>{0}, 1, 1,
                                   std::vector<std::uint64_t>{kBlockBytes});
    if (!scratch.ok() || !host.ok() || !plan.ok()) return 4;
    const auto t = kernels::packed_target(*host, *scratch, kBlockBytes);
    if (!b.copy_layerwise(Direction::kToDevice, *plan, std::span(&t, 1), 1, {}, {}).ok()) return 5;
  }
  return 0;
}

// The engine's process: exports, waits for the daemon's swaps, then checks its tensors.
int engine_main(const std::string& backend_name, int device_id, int in, int out) {
  auto made = backend_name == "cuda" ? make_cuda_backend(device_id, ScatterMode::kBatch)
                                     : Result<std::unique_ptr<DeviceBackend>, DeviceErrc>(make_host_backend());
  Exported ex{};
  std::vector<std::byte*> tensors;
  ex.error = made.ok() ? export_engine(**made, device_id, tensors, ex) : 10;
  if (!write_all(out, &ex, sizeof ex) || ex.error != 0) return 1;
  char go = 0;
  if (!read_all(in, &go, 1)) return 1;  // the daemon swapped every block back
  std::vector<std::byte> back(kTensorBytes);
  std::int32_t bad = 0;
  for (std::uint32_t t = 0; t < kTensors && bad == 0; ++t) {
    if (!(*made)->read_device(back.data(), tensors[t], back.size()).ok()) bad = 20;
    for (std::uint64_t i = 0; i < kTensorBytes && bad == 0; ++i)
      if (back[i] != pattern(1, t, i)) bad = 30 + static_cast<std::int32_t>(t);
  }
  return write_all(out, &bad, sizeof bad) ? 0 : 1;
}

}  // namespace

EnginePeer start_engine_peer(const std::string& backend_name, int device_id) {
  int down[2], up[2];
  if (pipe(down) != 0) return {};
  if (pipe(up) != 0) {
    close(down[0]);
    close(down[1]);
    return {};
  }
  const pid_t pid = fork();
  if (pid == 0) {
    close(down[1]);
    close(up[0]);
    _exit(engine_main(backend_name, device_id, down[0], up[1]));
  }
  close(down[0]);
  close(up[1]);
  if (pid < 0) {
    close(down[1]);
    close(up[0]);
    return {};
  }
  return EnginePeer{pid, down[1], up[0]};
}

void check_across_processes(DeviceBackend& b, EnginePeer& peer, Tally& tally) {
  Exported ex{};
  const bool got = read_all(peer.from_engine, &ex, sizeof ex) && ex.error == 0;
  tally.check(got, "engine process exported its tensors and event",
              got ? "" : fmt::format("engine failed at step {}", ex.error));
  std::vector<kernels::CopyTarget> to_host, to_dev;
  std::vector<std::vector<std::byte>> expect(kTensors);
  std::vector<std::byte*> host(kTensors);
  bool opened = got;
  for (std::uint32_t t = 0; t < kTensors && opened; ++t) {
    auto dev = b.open_tensor(ex.desc[t]);
    auto h = b.alloc_host(kTensorBytes);
    opened = dev.ok() && h.ok();
    if (!opened) {
      tally.check(false, fmt::format("open the engine's tensor {}", t),
                  dev.ok() ? "host allocation" : dev.error().message);
      break;
    }
    host[t] = *h;
    to_host.push_back(kernels::packed_target(*dev, *h, kBlockBytes));
    to_dev.push_back(kernels::packed_target(*h, *dev, kBlockBytes));
  }
  if (opened) {
    std::array<std::uint8_t, proto::kEngineEventBytes> event{};
    std::memcpy(event.data(), ex.event, event.size());
    const auto bound = ipc::monotonic_now_ns() + 30'000'000'000;  // the exporter recorded it before it answered
    auto waited = b.name() == std::string("cuda")
                      ? b.await_engine_event(event, [bound]() -> std::optional<std::string> {
                          if (ipc::monotonic_now_ns() > bound) return "not within 30 s";
                          return std::nullopt;
                        })
                      : Status<DeviceErrc>{};
    tally.check(waited.ok(), "open and wait on the engine's interprocess event", waited.ok() ? "" : waited.error().message);
    std::vector<std::int32_t> ids(kBlocks), rev(kBlocks);
    std::iota(ids.begin(), ids.end(), 0);
    for (std::int64_t i = 0; i < kBlocks; ++i) rev[i] = static_cast<std::int32_t>(kBlocks - 1 - i);
    auto plan = kernels::plan_copy(ids, rev, kBlocks, kBlocks, std::vector<std::uint64_t>{kBlockBytes, kBlockBytes});
    Status<DeviceErrc> st = plan.ok() ? b.copy(Direction::kToHost, *plan, to_host)
                                      : make_error(DeviceErrc::kCopyFailed, plan.error().message);
    std::string diff = st.ok() ? "" : st.error().message;
    for (std::uint32_t t = 0; t < kTensors && diff.empty(); ++t)
      for (std::uint64_t i = 0; i < kTensorBytes && diff.empty(); ++i) {
        const std::uint64_t block = i / kBlockBytes, within = i % kBlockBytes;
        if (host[t][(kBlocks - 1 - block) * kBlockBytes + within] != pattern(0, t, i))
          diff = fmt::format("tensor {} block {} differs", t, block);
      }
    tally.check(diff.empty(), "swap the engine's blocks to host across processes", diff);
    // Back, in the engine's own order, with the second pattern: the engine checks it.
    for (std::uint32_t t = 0; t < kTensors; ++t)
      for (std::uint64_t i = 0; i < kTensorBytes; ++i) host[t][i] = pattern(1, t, i);
    auto same = kernels::plan_copy(ids, ids, kBlocks, kBlocks, std::vector<std::uint64_t>{kBlockBytes, kBlockBytes});
    st = same.ok() ? b.copy(Direction::kToDevice, *same, to_dev) : make_error(DeviceErrc::kCopyFailed, same.error().message);
    tally.check(st.ok(), "swap blocks to the engine's device tensors", st.ok() ? "" : st.error().message);
  }
  const char go = 1;
  std::int32_t bad = -1;
  if (opened && write_all(peer.to_engine, &go, 1) && read_all(peer.from_engine, &bad, sizeof bad))
    tally.check(bad == 0, "the engine reads back every byte the daemon wrote",
                bad == 0 ? "" : fmt::format("engine check {}", bad));
  b.close_tensors();
  close(peer.to_engine);
  close(peer.from_engine);
  int status = 0;
  waitpid(peer.pid, &status, 0);
  peer = EnginePeer{};
}

}  // namespace kvtd::daemon::selftest
