// The CUDA daemon under faults and delays injected through the stand-in (-DKVTD_CUDA_SIM=ON
// only): a sticky error fails its task and ends the daemon for a restart; a swap waits for the
// engine's event while the engine's stream is still busy writing its blocks; an engine killed
// with its event pending never wedges a lane; a copy that never finishes ends the daemon (8).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>

#include <algorithm>

#include "cuda_daemon_fixture.h"
#include "http_client.h"
#include "kvtd/cudasim/control.h"

namespace kvtd {
namespace {

TEST_F(CudaDaemonTest, StickyErrorFailsItsTaskAndTheDaemonExitsForARestart) {
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0));
  setenv("KVTD_CUDASIM_FAULTS", "cudaLaunchKernel:1:700", 1);  // rank 1's first kernel faults
  daemons_.push_back(start_cuda_daemon(1, "kernel", 0));
  unsetenv("KVTD_CUDASIM_FAULTS");
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2, 3}, {4, 5, 6}).ok());  // a run: no kernel
  const auto failed = run(TaskKind::kSwapToHost, {9, 17}, {0, 11});    // scattered: the kernel
  EXPECT_EQ(failed.status, TaskStatus::kDeviceError);
  ASSERT_FALSE(failed.failures.empty());
  EXPECT_EQ(failed.failures[0].rank, 1u);
  EXPECT_NE(failed.failures[0].message.find("cudaErrorIllegalAddress"), std::string::npos) << failed.failures[0].message;
  EXPECT_EQ(daemons_[1].wait_exit(std::chrono::seconds(30)), 7) << test::read_file(log_path(1));
  EXPECT_NE(test::read_file(log_path(1)).find("device context is lost"), std::string::npos);
  // systemd restarts it: the session goes on with a new context.
  daemons_[1] = start_cuda_daemon(1, "kernel", 1);
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(1, 1));
  cuda_round_trip({9, 17}, {0, 11}, {20, 21});
}


// The engine's stream still writes a block when it submits SWAP_TO_HOST of it (its kernels are
// queued, not done): the daemon's streams know nothing of the engine's, so the copy took the old
// bytes and reported ok (vllm#45704 is this bug class in-process). With the engine's
// interprocess event recorded after the write, the daemon's stream waits for it on the device.
// The stand-in delays the engine's stream by 300 ms so the write is certainly still queued.
TEST_F(CudaDaemonTest, ASwapToHostWaitsForTheEnginesEventAndOnlyThenSeesItsWrite) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  daemons_.push_back(start_cuda_daemon(0, "batch", 0));
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  cudaStream_t engine_stream{};
  ASSERT_EQ(cudaStreamCreateWithFlags(&engine_stream, cudaStreamNonBlocking), cudaSuccess);
  cudasim::set_stream_delay_us(engine_stream, 300'000);
  std::vector<std::vector<std::byte>> sources;  // alive until the queued copies ran
  auto engine_writes = [&](std::int32_t block, std::byte value) {
    for (auto& [key, p] : dev_) {
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(std::get<2>(key)));
      sources.emplace_back(bb, value);
      ASSERT_EQ(cudaMemcpyAsync(p + static_cast<std::uint64_t>(block) * bb, sources.back().data(), bb,
                                cudaMemcpyHostToDevice, engine_stream),
                cudaSuccess);
    }
  };
  auto block_is = [&](std::int32_t block, std::byte value) {
    for (auto& [key, p] : dev_) {
      const std::uint64_t bb = g_.block_bytes(static_cast<proto::TensorKind>(std::get<2>(key)));
      std::vector<std::byte> got(bb);
      EXPECT_EQ(cudaMemcpy(got.data(), p + static_cast<std::uint64_t>(block) * bb, bb, cudaMemcpyDeviceToHost),
                cudaSuccess);
      if (std::count(got.begin(), got.end(), value) != static_cast<std::ptrdiff_t>(bb)) return false;
    }
    return true;
  };

  // Without the event: the copy ran before the queued write, and said ok.
  ASSERT_NO_FATAL_FAILURE(engine_writes(5, std::byte{0xAB}));
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {5}, {0}).ok());
  ASSERT_EQ(cudaStreamSynchronize(engine_stream), cudaSuccess);
  ASSERT_TRUE(run(TaskKind::kSwapToDevice, {0}, {9}).ok());
  for (std::uint32_t l = 0; l < g_.num_layers; ++l)
    EXPECT_TRUE(holds(0, l, 9, 5)) << "layer " << l << ": block 9 should hold block 5's old pattern (the hazard)";

  // With the event: the daemon's copy waits for the engine's write on the device.
  cudaEvent_t ev{};
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess), cudaSuccess);
  ASSERT_NO_FATAL_FAILURE(engine_writes(6, std::byte{0xCD}));
  ASSERT_EQ(cudaEventRecord(ev, engine_stream), cudaSuccess);
  std::array<std::uint8_t, proto::kEngineEventBytes> handle{};
  cudaIpcEventHandle_t h{};
  ASSERT_EQ(cudaIpcGetEventHandle(&h, ev), cudaSuccess);
  std::memcpy(handle.data(), &h, sizeof h);
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  const std::vector<std::int32_t> src{6}, dst{1};
  req.src = src;
  req.dst = dst;
  req.engine_events = std::span(&handle, 1);
  auto out = submit_and_wait(req);
  ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
  ASSERT_EQ(cudaStreamSynchronize(engine_stream), cudaSuccess);
  ASSERT_TRUE(run(TaskKind::kSwapToDevice, {1}, {10}).ok());
  EXPECT_TRUE(block_is(10, std::byte{0xCD})) << "the copy did not wait for the engine's write";
  // One event per rank, and only on swaps: anything else is refused at submit.
  std::array<std::array<std::uint8_t, proto::kEngineEventBytes>, 2> two{handle, handle};
  req.engine_events = std::span(two);
  EXPECT_EQ(engine_->submit(req).error().code, IpcErrc::kInvalidArgument);
  cudaEventDestroy(ev);
  cudaStreamDestroy(engine_stream);
}

// On an H100, a stream waiting (cudaStreamWaitEvent) on an interprocess event whose
// exporting process died with its record queued had not moved after 120 s. The daemon made its
// lane's stream wait on the engine's event on the device, so an engine SIGKILLed between
// submitting a swap with its event and the record running left that lane wedged for good: every
// later swap of that direction, in every later session, queued behind a wait that never ends.
// Now the lane polls the event on the host, bounded by the engine's heartbeat.
TEST_F(CudaDaemonTest, AnEngineKilledWithItsEventPendingNeverWedgesTheDaemon) {
  g_ = test::small_geometry(1);
  int up[2];
  ASSERT_EQ(pipe(up), 0);
  const pid_t first = fork();
  if (first == 0) {  // the first engine, a process of its own: SIGKILL takes its CUDA context
    close(up[0]);
    auto say = [&](char c) { return write(up[1], &c, 1) == 1; };
    start_cuda_engine();
    if (HasFatalFailure() || !say('P')) _exit(1);
    if (!engine_->wait_ready(30'000'000'000).ok()) _exit(2);
    cudaStream_t held{};
    cudaEvent_t ev{};
    if (cudaStreamCreateWithFlags(&held, cudaStreamNonBlocking) != cudaSuccess ||
        cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess) != cudaSuccess)
      _exit(3);
    cudasim::set_stream_delay_us(held, 600'000'000);  // the record would run in ten minutes
    cudaIpcEventHandle_t h{};
    if (cudaEventRecord(ev, held) != cudaSuccess || cudaIpcGetEventHandle(&h, ev) != cudaSuccess) _exit(4);
    std::array<std::uint8_t, proto::kEngineEventBytes> handle{};
    std::memcpy(handle.data(), &h, sizeof h);
    TaskRequest req;
    req.kind = TaskKind::kSwapToHost;
    const std::vector<std::int32_t> src{3}, dst{2};
    req.src = src;
    req.dst = dst;
    req.engine_events = std::span(&handle, 1);
    if (!engine_->submit(req).ok() || !say('S')) _exit(5);
    pause();
    _exit(0);
  }
  close(up[1]);
  char c = 0;
  ASSERT_EQ(read(up[0], &c, 1), 1);
  ASSERT_EQ(c, 'P') << "the first engine could not publish";
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0));
  ASSERT_EQ(read(up[0], &c, 1), 1) << test::read_file(log_path(0));
  ASSERT_EQ(c, 'S') << "the first engine could not submit its swap";
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the lane is waiting for the event
  ASSERT_EQ(kill(first, SIGKILL), 0);
  ASSERT_EQ(waitpid(first, nullptr, 0), first);
  const auto killed = std::chrono::steady_clock::now();

  // The next engine of this rank: the daemon follows it and serves it, both directions.
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  ASSERT_NO_FATAL_FAILURE(cuda_round_trip({9, 17}, {0, 11}, {20, 21}));
  const auto took = std::chrono::steady_clock::now() - killed;
  // The bound: the engine's heartbeat timeout (1 s here) plus a re-attach, far below the old
  // forever; generous for a loaded CI machine.
  EXPECT_LT(took, std::chrono::seconds(20));
  const std::string log = test::read_file(log_path(0));
  EXPECT_NE(log.find("engine_event_not_fired"), std::string::npos) << log;
  EXPECT_NE(log.find("stopped heartbeating"), std::string::npos) << log;
}

// A copy that never finishes (a device that stopped; the stand-in's "hang" fault on a
// scattered swap's kernel) held its task forever and nothing was said: the daemon can neither
// answer the task (the copy may still write engine memory) nor take the lane back. Now the rank
// says so (log, /readyz, kvtd_copy_running_seconds) and exits 8 at twice --stuck-copy-timeout;
// systemd restarts it, and the host tier written before is still there for the new process.
TEST_F(CudaDaemonTest, ACopyThatNeverFinishesEndsTheDaemonForARestartAndTheHostTierSurvives) {
  g_ = test::small_geometry(1);
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  setenv("KVTD_CUDASIM_FAULTS", "cudaLaunchKernel:2:hang", 1);  // the second kernel never ends
  // No checksum kernels (--verify-swaps): the second launch is the second swap's copy.
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0, {"--stuck-copy-timeout", "0.5", "--verify-swaps", "off"}));
  unsetenv("KVTD_CUDASIM_FAULTS");
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  auto out = run(TaskKind::kSwapToHost, {9, 17}, {0, 11});  // the first kernel: ok
  ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
  TaskRequest req;
  req.kind = TaskKind::kSwapToHost;
  const std::vector<std::int32_t> src{5, 13}, dst{1, 12};
  req.src = src;
  req.dst = dst;
  auto id = engine_->submit(req);
  ASSERT_TRUE(id.ok());
  EXPECT_EQ(daemons_[0].wait_exit(std::chrono::seconds(30)), 8) << test::read_file(log_path(0));
  const std::string log = test::read_file(log_path(0));
  EXPECT_NE(log.find("without finishing"), std::string::npos) << log;
  EXPECT_NE(log.find("exiting with code 8"), std::string::npos) << log;
  auto stuck = engine_->wait(*id, 30'000'000'000);
  ASSERT_TRUE(stuck.ok());
  EXPECT_FALSE(stuck->ok()) << "a task whose copy never finished must not complete ok";
  // systemd restarts it: the new process serves, and the host blocks written before are intact.
  daemons_[0] = start_cuda_daemon(0, "kernel", 1);
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0, 1));
  ASSERT_NO_FATAL_FAILURE(scribble({20, 21}));
  auto back = run(TaskKind::kSwapToDevice, {0, 11}, {20, 21});
  ASSERT_TRUE(back.ok()) << (back.failures.empty() ? "" : back.failures[0].message);
  for (std::uint32_t l = 0; l < g_.num_layers; ++l) {
    EXPECT_TRUE(holds(0, l, 20, 9)) << "layer " << l;
    EXPECT_TRUE(holds(0, l, 21, 17)) << "layer " << l;
  }
}

// --verify-swaps. A byte of the host tier that changes between swap-out and swap-in
// (memory corruption, a stray writer into the shared pool) went back into the engine's blocks
// and the swap-in said ok: a wrong KV byte, a wrong answer, no error anywhere. Now the checksums
// the device took on the way out are checked after the way in, and the swap-in fails naming the
// rank, layer and blocks. A clean round trip passes, in every scatter mode.
TEST_F(CudaDaemonTest, AHostByteFlippedBetweenSwapOutAndSwapInFailsTheSwapIn) {
  g_ = test::small_geometry(1);
  int incarnation = 0;
  for (const char* mode : {"kernel", "kernel-per-layer", "batch", "memcpy"}) {
    SCOPED_TRACE(mode);
    daemons_.clear();  // a new engine session per mode: the last one counted its daemon gone
    engine_.reset();
    dev_.clear();
    ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
    daemons_.push_back(start_cuda_daemon(0, mode, incarnation++, {"--verify-swaps", "full"}));
    ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0, incarnation - 1));
    ASSERT_NO_FATAL_FAILURE(cuda_round_trip({9, 17}, {0, 11}, {20, 21}));  // clean: ok
    // Other blocks out; then one byte of block 25's copy in the host pool changes.
    auto out = run(TaskKind::kSwapToHost, {25, 29}, {3, 5});
    ASSERT_TRUE(out.ok()) << (out.failures.empty() ? "" : out.failures[0].message);
    char name[96];
    std::snprintf(name, sizeof name, "/dev/shm/kvtd_%u_%016llx_host0", static_cast<unsigned>(getuid()),
                  static_cast<unsigned long long>(engine_->generation()));
    const int fd = ::open(name, O_RDWR);
    ASSERT_GE(fd, 0) << name;
    struct stat st {};
    ASSERT_EQ(fstat(fd, &st), 0);
    auto* pool = static_cast<std::byte*>(mmap(nullptr, static_cast<std::size_t>(st.st_size), PROT_READ | PROT_WRITE,
                                              MAP_SHARED, fd, 0));
    ::close(fd);
    ASSERT_NE(pool, MAP_FAILED);
    // Block 33's key of layer 1, wherever the pool's layout put it: found by its pattern.
    std::vector<std::byte> needle(64);
    loadgen::fill_block(needle.data(), needle.size(), 0, 1, 0, 25);
    std::byte* end = pool + st.st_size;
    std::byte* at = std::search(pool, end, needle.begin(), needle.end());
    ASSERT_NE(at, end) << "block 25's bytes are not in the host pool";
    at[40] ^= std::byte{0x10};
    munmap(pool, static_cast<std::size_t>(st.st_size));
    auto back = run(TaskKind::kSwapToDevice, {3, 5}, {22, 23});
    EXPECT_EQ(back.status, TaskStatus::kIntegrity);
    ASSERT_FALSE(back.failures.empty());
    const std::string& m = back.failures[0].message;
    EXPECT_NE(m.find("layer 1"), std::string::npos) << m;
    EXPECT_NE(m.find("host block 3 -> device block 22"), std::string::npos) << m;
    // Block 29 alone is clean: ok.
    auto other = run(TaskKind::kSwapToDevice, {5}, {23});
    EXPECT_TRUE(other.ok()) << (other.failures.empty() ? "" : other.failures[0].message);
  }
}

// A host pool larger than the share pinned before serving: the daemon serves while the rest is
// pinned in the background, and a swap naming the pool's last block waits for that block's piece
// and moves every byte (before, the daemon pinned the whole pool before it served: at the 3-4
// GB/s an H100 machine pinned a MAP_SHARED pool, minutes for a terabyte).
TEST_F(CudaDaemonTest, ASwapOfHostBlocksStillBeingPinnedWaitsForThemAndMovesEveryByte) {
  g_ = test::small_geometry(1);
  const std::int64_t shape[4] = {32, 8, 16, 128};  // 32 KiB block-tensors, 192 KiB a block
  std::copy(shape, shape + 4, g_.key_shape);
  std::copy(shape, shape + 4, g_.value_shape);
  g_.num_host_blocks = 512;  // 96 MiB: 6 s at 16 MB/s on one thread, 1 MiB (5 blocks) first
  ASSERT_NO_FATAL_FAILURE(start_cuda_engine());
  const std::uint16_t port = test::free_tcp_port();
  setenv("KVTD_CUDASIM_PIN_MBPS", "16", 1);
  daemons_.push_back(start_cuda_daemon(0, "kernel", 0,
                                       {"--host-pool-pin-first-mib", "1", "--metrics-port", std::to_string(port)}));
  unsetenv("KVTD_CUDASIM_PIN_MBPS");
  ASSERT_TRUE(engine_->wait_ready(30'000'000'000).ok()) << test::read_file(log_path(0));
  EXPECT_NE(test::read_file(log_path(0)).find("serving; the other"), std::string::npos) << test::read_file(log_path(0));
  ASSERT_NO_FATAL_FAILURE(cuda_round_trip({1, 2, 30}, {0, 511, 300}, {5, 6, 7}));
  const std::string metrics = test::http_get(port, "/metrics");
  EXPECT_NE(metrics.find("kvtd_host_pool_pin_waits_total 1\n"), std::string::npos) << metrics;
  ASSERT_TRUE(test::eventually([&] { return test::read_file(log_path(0)).find("host pool pinned:") != std::string::npos; },
                               std::chrono::seconds(30)));
  EXPECT_NE(test::read_file(log_path(0)).find("first swap served"), std::string::npos) << test::read_file(log_path(0));
}

}  // namespace
}  // namespace kvtd
