// The C ABI of libkvtd_client.so (kvtd/kvtd_client.h), linked as the shared library an engine
// loads: every entry point with good and hostile input, against an in-process rank.
#include "kvtd/kvtd_client.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <chrono>
#include <sys/wait.h>

#include <climits>
#include <cstring>
#include <string>
#include <vector>
#include <thread>
#include <atomic>

#include "endpoint_helpers.h"
#include "kvtd/ipc/clock.h"
#include "kvtd/endpoint/rank_endpoint.h"
#include "kvtd/ipc/task_codec.h"
#include "test_support.h"

namespace kvtd::ipc {

// The daemon's end of the session (daemon/endpoint), against the C ABI in this process.
using endpoint::RankEndpoint;
namespace {

using proto::TaskStatus;
using test::endpoint_options;
using test::report;

// One rank, fp16, 8 device and 4 host blocks of 1 head x 4 tokens x 8 dims, no value cache.
kvtd_geometry c_geometry(std::uint32_t layers) {
  kvtd_geometry g{};
  g.num_ranks = 1;
  g.num_layers = layers;
  g.dtype = KVTD_DTYPE_FLOAT16;
  g.num_host_blocks = 4;
  const std::int64_t shape[4] = {8, 1, 4, 8};
  for (int i = 0; i < 4; ++i) g.key_shape[i] = shape[i];
  return g;
}

// c_geometry(1) as the daemon side sees it.
proto::CacheGeometry c_geometry_as_proto() {
  proto::CacheGeometry pg = test::small_geometry(1);
  pg.num_layers = 1;
  pg.num_host_blocks = 4;
  pg.dtype = static_cast<std::uint32_t>(proto::CacheDtype::kFloat16);
  const std::int64_t shape[4] = {8, 1, 4, 8};
  for (int i = 0; i < 4; ++i) {
    pg.key_shape[i] = shape[i];
    pg.value_shape[i] = 0;
  }
  return pg;
}

TEST(CApi, CreatePublishSubmitAndReportErrors) {
  const auto suffix = test::unique_suffix("capi");
  const kvtd_geometry g = c_geometry(2);
  kvtd_session* s = nullptr;
  char err[256] = {0};
  ASSERT_EQ(kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  EXPECT_NE(kvtd_host_device_tensor(s, 0, 1, 0, nullptr), nullptr);
  EXPECT_EQ(kvtd_host_device_tensor(s, 0, 1, 1, nullptr), nullptr);  // no value cache
  ASSERT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
  int32_t src[1] = {0}, dst[1] = {0};
  uint64_t id = 0;
  EXPECT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 10, &id, err, sizeof err), KVTD_E_NOT_READY);
  EXPECT_NE(std::string(err).find("rank 0"), std::string::npos) << err;
  EXPECT_EQ(kvtd_wait_ready(s, 20, err, sizeof err), KVTD_E_TIMEOUT);
  EXPECT_EQ(kvtd_rank_alive(s, 0), 0);
  // Null sessions and huge timeouts are errors or saturate; nothing crashes or wraps.
  EXPECT_EQ(kvtd_publish(nullptr, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_wait(nullptr, 1, 1, nullptr, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_wait_ready(nullptr, 1, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_create_host_device_tensors(nullptr, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_rank_alive(nullptr, 0), 0);
  EXPECT_EQ(kvtd_wait(s, 12345, INT64_MAX, nullptr, err, sizeof err), KVTD_E_UNKNOWN_TASK);
  kvtd_session_destroy(s);
  kvtd_session* bad = nullptr;
  EXPECT_EQ(kvtd_session_create("bad/name", &g, &bad, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("suffix"), std::string::npos);
}

// The C ABI end to end: register tensors by handle, submit, and wait for the merged result.
// A published one-rank session with its rank attached in this process (it reports nothing
// unless told to).
struct AttachedCSession {
  std::string suffix;
  kvtd_session* s = nullptr;
  Result<std::unique_ptr<RankEndpoint>, IpcErrc> ep = make_error(IpcErrc::kClosed, "");
  explicit AttachedCSession(const std::string& name) : suffix(test::unique_suffix(name)) {
    const kvtd_geometry g = c_geometry(1);
    char err[256] = {0};
    EXPECT_EQ(kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
    const std::uint8_t handle[64] = {'x'};
    EXPECT_EQ(kvtd_register_tensor(s, 0, 0, 0, -1, handle, 0, 8 * 64, err, sizeof err), KVTD_OK) << err;
    EXPECT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
    ep = RankEndpoint::attach(endpoint_options(suffix, 0, c_geometry_as_proto()));
    EXPECT_TRUE(ep.ok());
  }
  std::uint64_t submit() {
    int32_t src[1] = {1}, dst[1] = {2};
    uint64_t id = 0;
    char err[256] = {0};
    EXPECT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 1000, &id, err, sizeof err), KVTD_OK) << err;
    return id;
  }
};

// A completion thread waiting in kvtd_wait while the main thread destroys the
// session at shutdown is ordinary engine code; destroy unmapped the segment under the waiter
// (SIGSEGV 3 of 3). Now the waiter returns KVTD_E_CLOSED and destroy frees once it left.
TEST(CApi, DestroyWhileAnotherThreadWaitsWakesItWithClosed) {
  AttachedCSession a("capi_close");
  const std::uint64_t id = a.submit();  // never reported: the waiter would wait 30 s
  std::atomic<int> rc{-1};
  std::string message;
  std::thread waiter([&] {
    char err[256] = {0};
    kvtd_completion c{};
    rc = kvtd_wait(a.s, id, 30'000, &c, err, sizeof err);
    message = err;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));
  const auto t0 = std::chrono::steady_clock::now();
  kvtd_session_destroy(a.s);
  waiter.join();
  EXPECT_EQ(rc.load(), KVTD_E_CLOSED) << message;
  EXPECT_STREQ(kvtd_error_name(KVTD_E_CLOSED), "closed");
  EXPECT_NE(message.find("closed"), std::string::npos) << message;
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(2));
}

// Documented misuse is refused, never a use after free. A call on a destroyed
// handle answers KVTD_E_CLOSED, and two threads destroying one handle at once free it once. On the
// old library both read freed memory (ASan: heap-use-after-free; double free).
TEST(CApi, CallsAfterDestroyAndTwoDestroysAreRefusedNotUseAfterFree) {
  for (int round = 0; round < 20; ++round) {
    AttachedCSession a("capi_misuse");
    kvtd_session* s = a.s;
    std::atomic<bool> go{false};
    std::thread t1([&] {
      while (!go) {
      }
      kvtd_session_destroy(s);
    });
    std::thread t2([&] {
      while (!go) {
      }
      kvtd_session_destroy(s);
    });
    go = true;
    t1.join();
    t2.join();
    char err[256] = {0};
    kvtd_completion c{};
    EXPECT_EQ(kvtd_poll(s, 1, &c, err, sizeof err), KVTD_E_CLOSED);
    EXPECT_NE(std::string(err).find("destroyed"), std::string::npos) << err;
    int32_t src[1] = {1}, dst[1] = {2};
    uint64_t id = 0;
    EXPECT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 10, &id, err, sizeof err), KVTD_E_CLOSED);
    EXPECT_EQ(kvtd_in_flight(s), 0u);
    EXPECT_EQ(kvtd_weight_version(s), 0u);
    EXPECT_STREQ(kvtd_session_name(s), "");
    kvtd_session_destroy(s);  // a third time: nothing
  }
}

// A forked child (FastDeploy uses multiprocessing) shared its parent's session
// and the two took each other's completions (17-68% of waits never completed). The child is
// refused on every call, and destroying its copy leaves the parent's session alone.
TEST(CApi, AForkedChildCannotUseItsParentsSession) {
  AttachedCSession a("capi_fork");
  const pid_t pid = fork();
  if (pid == 0) {
    char err[256] = {0};
    int32_t src[1] = {1}, dst[1] = {2};
    uint64_t id = 0;
    kvtd_completion c{};
    int bad = 0;
    if (kvtd_submit(a.s, KVTD_SWAP_TO_HOST, src, dst, 1, 1000, &id, err, sizeof err) != KVTD_E_WRONG_PROCESS) bad |= 1;
    if (std::string(err).find("created by process") == std::string::npos) bad |= 2;
    if (kvtd_poll(a.s, 1, &c, err, sizeof err) != KVTD_E_WRONG_PROCESS) bad |= 4;
    if (kvtd_wait(a.s, 1, 10, &c, err, sizeof err) != KVTD_E_WRONG_PROCESS) bad |= 8;
    if (kvtd_rank_alive(a.s, 0) != 0) bad |= 16;
    kvtd_session_destroy(a.s);  // the child's copy: unmaps, unlinks nothing
    _exit(bad);
  }
  int status = 0;
  ASSERT_EQ(waitpid(pid, &status, 0), pid);
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), 0) << "bits of the child's failed checks";
  // The parent's session is intact: a task round trip works.
  const std::uint64_t id = a.submit();
  report(**a.ep, id, 0, TaskStatus::kOk, 1);
  kvtd_completion c{};
  char err[256] = {0};
  EXPECT_EQ(kvtd_wait(a.s, id, 1000, &c, err, sizeof err), KVTD_OK) << err;
  a.ep = make_error(IpcErrc::kClosed, "");
  kvtd_session_destroy(a.s);
}

TEST(CApi, RegisterSubmitAndWaitWithAnAttachedRank) {
  const auto suffix = test::unique_suffix("capi2");
  const kvtd_geometry g = c_geometry(1);
  kvtd_session* s = nullptr;
  char err[256] = {0};
  ASSERT_EQ(kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
  std::uint8_t handle[64] = {'x'};
  EXPECT_EQ(kvtd_register_tensor(s, 0, 0, 0, -1, handle, 0, 8, err, sizeof err), KVTD_E_INVALID);  // too small
  EXPECT_NE(std::string(err).find("needs"), std::string::npos) << err;
  EXPECT_EQ(kvtd_register_tensor(s, 0, 0, 0, -1, handle, 0, 8 * 64, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
  const proto::CacheGeometry pg = c_geometry_as_proto();
  auto ep = RankEndpoint::attach(endpoint_options(suffix, 0, pg));
  ASSERT_TRUE(ep.ok()) << ep.error().message;
  ASSERT_NE((*ep)->tensor(0, proto::TensorKind::kKey), nullptr);
  int32_t src[2] = {1, 2}, dst[2] = {3, 0};
  uint64_t id = 0;
  ASSERT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 2, 1000, &id, err, sizeof err), KVTD_OK) << err;
  report(**ep, id, 0, TaskStatus::kOk, 2);
  kvtd_completion c{};
  ASSERT_EQ(kvtd_wait(s, id, 1000, &c, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(c.task_id, id);
  EXPECT_EQ(c.blocks_done, 2u);
  EXPECT_EQ(c.failed_rank, -1);
  ASSERT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 2, 1000, &id, err, sizeof err), KVTD_OK) << err;
  report(**ep, id, 0, TaskStatus::kIdOutOfRange, 0);
  EXPECT_EQ(kvtd_wait(s, id, 1000, &c, err, sizeof err), KVTD_E_TASK_FAILED);
  EXPECT_EQ(c.failed_rank, 0);
  EXPECT_NE(std::string(err).find("rank 0"), std::string::npos) << err;
  EXPECT_EQ(kvtd_submit(s, 0, src, dst, 2, 1000, &id, err, sizeof err), KVTD_E_INVALID);  // reserved kind
  ep = make_error(IpcErrc::kClosed, "");  // detach before the session goes
  kvtd_session_destroy(s);
}

// Reports a swap as a daemon's copy lane does: ok, with the stamps of when it began and ended.
void report_timed(RankEndpoint& ep, std::uint64_t id, std::uint64_t blocks, std::int64_t start_ns, std::int64_t end_ns) {
  proto::CompletionRecord rec{};
  rec.task_id = id;
  rec.status = static_cast<std::int32_t>(TaskStatus::kOk);
  rec.blocks_done = blocks;
  rec.start_ns = start_ns;
  rec.end_ns = end_ns;
  ASSERT_TRUE(ep.complete(rec).ok());
}

// How many of `s`'s waits took a swap's result around a completion forecast, after two lone
// swaps: the first one's stamps (a 2 ms copy) teach the forecast, the second is waited for with it
// (reported at once, so taken before its window).
std::uint64_t forecast_waits_after_two_swaps(const std::string& suffix, std::uint32_t flags) {
  const kvtd_geometry g = c_geometry(1);
  kvtd_session_options opts{};
  opts.flags = flags;
  kvtd_session* s = nullptr;
  char err[256] = {0};
  EXPECT_EQ(kvtd_session_create_with(suffix.c_str(), &g, &opts, &s, err, sizeof err), KVTD_OK) << err;
  if (s == nullptr) return ~0ull;
  std::uint8_t handle[64] = {'x'};
  EXPECT_EQ(kvtd_register_tensor(s, 0, 0, 0, -1, handle, 0, 8 * 64, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
  auto ep = RankEndpoint::attach(endpoint_options(suffix, 0, c_geometry_as_proto()));
  EXPECT_TRUE(ep.ok()) << ep.error().message;
  kvtd_forecast_waits w{};
  if (ep.ok()) {
    int32_t src[1] = {1}, dst[1] = {3};
    for (int i = 0; i < 2; ++i) {
      uint64_t id = 0;
      EXPECT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 1000, &id, err, sizeof err), KVTD_OK) << err;
      const std::int64_t now = monotonic_now_ns();
      report_timed(**ep, id, 1, now, now + 2'000'000);
      kvtd_completion c{};
      EXPECT_EQ(kvtd_wait(s, id, 1000, &c, err, sizeof err), KVTD_OK) << err;
    }
    EXPECT_EQ(kvtd_session_forecast_waits(s, &w, err, sizeof err), KVTD_OK) << err;
    EXPECT_EQ(w.waits, w.before_window + w.in_window + w.after_window);
  }
  ep = make_error(IpcErrc::kClosed, "");  // detach before the session goes
  kvtd_session_destroy(s);
  return w.waits;
}

TEST(CApi, TheCompletionForecastIsOnByDefaultAndAFlagTurnsItOff) {
  EXPECT_EQ(forecast_waits_after_two_swaps(test::unique_suffix("capifc1"), 0), 1u);
  EXPECT_EQ(forecast_waits_after_two_swaps(test::unique_suffix("capifc2"), KVTD_SESSION_NO_COMPLETION_FORECAST), 0u);
  char err[256] = {0};
  EXPECT_EQ(kvtd_session_forecast_waits(nullptr, nullptr, err, sizeof err), KVTD_E_INVALID);
}

// Weight updates through the C ABI: clear refuses tasks until restore; the rank (a thread here)
// sees CLEAR_CACHE then RESTORE_CACHE, the second after the re-registered tensors.
// A registry with some tensors but not all is the engine's mistake and is refused naming one
// missing; none at all is how a FastDeploy engine publishes (its worker publishes the tensors by
// name and the daemons open those: daemon/process/fastdeploy_ipc.h).
TEST(CApi, PublishTakesEveryTensorOrNoneButNotSome) {
  const std::string suffix = fmt::format("capi_partial_{}", getpid());
  const kvtd_geometry g = c_geometry(2);
  char err[256] = {0};
  kvtd_session* some = nullptr;
  ASSERT_EQ(kvtd_session_create(suffix.c_str(), &g, &some, err, sizeof err), KVTD_OK) << err;
  const uint8_t handle[64] = {'x'};
  ASSERT_EQ(kvtd_register_tensor(some, 0, 0, KVTD_KEY, -1, handle, 0, uint64_t{1} << 20, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_publish(some, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("key of rank 0 layer 1 is not registered"), std::string::npos) << err;
  kvtd_session_destroy(some);
  kvtd_session* none = nullptr;
  ASSERT_EQ(kvtd_session_create(suffix.c_str(), &g, &none, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_publish(none, err, sizeof err), KVTD_OK) << err;
  kvtd_session_destroy(none);
}

TEST(CApi, ClearRefusesTasksUntilRestoreAndTheRankSeesBothInOrder) {
  const auto suffix = test::unique_suffix("capi_clear");
  const kvtd_geometry g = c_geometry(1);
  kvtd_session* s = nullptr;
  char err[256] = {0};
  ASSERT_EQ(kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_clear_caches(s, 0, 0, 1000, err, sizeof err), KVTD_E_INVALID);  // not published
  ASSERT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_free_host_device_tensors(s, err, sizeof err), KVTD_E_INVALID);  // mapped by ranks
  auto ep = RankEndpoint::attach(endpoint_options(suffix, 0, c_geometry_as_proto()));
  ASSERT_TRUE(ep.ok()) << ep.error().message;
  std::vector<std::uint16_t> seen;
  std::atomic<bool> done{false};
  std::thread rank([&] {  // answers every task ok, noting its kind and flags
    std::vector<std::byte> rec;
    while (!done.load()) {
      if ((*ep)->next_task(rec, monotonic_now_ns() + 20'000'000) != RankEndpoint::Next::kTask) continue;
      proto::TaskRecordHeader h{};
      std::memcpy(&h, rec.data(), sizeof h);
      seen.push_back(static_cast<std::uint16_t>(h.kind | (h.flags << 8)));
      report(**ep, h.task_id, 0, TaskStatus::kOk, 0);
    }
  });
  EXPECT_EQ(kvtd_clear_caches(s, 1u << 5, 0, 1000, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_clear_caches(s, KVTD_CLEAR_DROP_HOST_TIER | KVTD_CLEAR_SET_WEIGHT_VERSION, 42, 5000, err, sizeof err),
            KVTD_OK)
      << err;
  EXPECT_EQ(kvtd_cache_cleared(s), 1);
  EXPECT_EQ(kvtd_weight_version(s), 42u);
  int32_t src[1] = {1}, dst[1] = {2};
  uint64_t id = 0;
  EXPECT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 100, &id, err, sizeof err), KVTD_E_CACHE_CLEARED);
  EXPECT_STREQ(kvtd_error_name(KVTD_E_CACHE_CLEARED), "cache_cleared");
  EXPECT_STREQ(kvtd_status_name(19), "cache_cleared");
  ASSERT_EQ(kvtd_free_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_host_device_tensor(s, 0, 0, KVTD_KEY, nullptr), nullptr);
  ASSERT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_restore_caches(s, 5000, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(kvtd_cache_cleared(s), 0);
  ASSERT_EQ(kvtd_submit(s, KVTD_SWAP_TO_HOST, src, dst, 1, 1000, &id, err, sizeof err), KVTD_OK) << err;
  kvtd_completion c{};
  EXPECT_EQ(kvtd_wait(s, id, 5000, &c, err, sizeof err), KVTD_OK) << err;
  done.store(true);
  rank.join();
  const std::vector<std::uint16_t> want{static_cast<std::uint16_t>(8 | (proto::kTaskFlagDropHostTier << 8)), 9, 1};
  EXPECT_EQ(seen, want);
  ep = make_error(IpcErrc::kClosed, "");
  kvtd_session_destroy(s);
}

// Storage tasks through the C ABI: the record a rank reads carries exactly the keys, blocks and
// arguments given; the completion carries written and skipped counts.
TEST(CApi, StorageTasksCarryKeysBlocksAndSkippedCounts) {
  kvtd_session* s = nullptr;
  const auto csuffix = test::unique_suffix("capi3");
  const kvtd_geometry g = c_geometry(1);
  char err[256] = {0};
  ASSERT_EQ(kvtd_session_create(csuffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
  const proto::CacheGeometry pg = c_geometry_as_proto();
  auto cep = RankEndpoint::attach(endpoint_options(csuffix, 0, pg));
  ASSERT_TRUE(cep.ok()) << cep.error().message;
  const char* keys[2] = {"pfx:00", "pfx:01"};
  const int32_t blocks[2] = {3, 1};
  uint64_t id = 0;
  ASSERT_EQ(kvtd_set_weight_version(s, 9), KVTD_OK);
  ASSERT_EQ(kvtd_submit_storage(s, KVTD_STORAGE_WRITE, keys, blocks, 2, KVTD_STORAGE_HOST_BLOCKS, 0, 0, 1000, &id, err,
                                sizeof err),
            KVTD_OK)
      << err;
  std::vector<std::byte> rec;
  ASSERT_EQ((*cep)->next_task(rec, monotonic_now_ns() + 1'000'000'000), RankEndpoint::Next::kTask);
  proto::TaskRecordHeader h{};
  auto t = decode_task_record(rec, &h);
  ASSERT_TRUE(t.ok()) << t.error().message;
  EXPECT_EQ(h.kind, KVTD_STORAGE_WRITE);
  EXPECT_EQ(h.flags, proto::kTaskFlagHostBlocks);
  auto sec = decode_storage_section(t->src, h.num_keys);
  ASSERT_TRUE(sec.ok()) << sec.error().message;
  EXPECT_EQ(sec->keys, (std::vector<std::string>{"pfx:00", "pfx:01"}));
  EXPECT_EQ(sec->args.weight_version, 9u);
  EXPECT_EQ(std::vector<std::int32_t>(t->dst.begin(), t->dst.end()), (std::vector<std::int32_t>{3, 1}));
  proto::CompletionRecord c{};
  c.task_id = id;
  c.blocks_done = 1;
  c.blocks_skipped = 1;
  ASSERT_TRUE((*cep)->complete(c).ok());
  kvtd_completion out{};
  ASSERT_EQ(kvtd_wait(s, id, 1000, &out, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(out.blocks_done, 1u);
  EXPECT_EQ(out.blocks_skipped, 1u);
  // Bad input is refused with a message, never crashes.
  const char* bad_keys[1] = {"no/slash"};
  EXPECT_EQ(kvtd_submit_storage(s, KVTD_STORAGE_QUERY, bad_keys, nullptr, 1, 0, 0, 0, 100, &id, err, sizeof err),
            KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("key 0"), std::string::npos) << err;
  const char* null_key[1] = {nullptr};
  EXPECT_EQ(kvtd_submit_storage(s, KVTD_STORAGE_QUERY, null_key, nullptr, 1, 0, 0, 0, 100, &id, err, sizeof err),
            KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit_storage(s, KVTD_STORAGE_READ, keys, nullptr, 2, 0, 0, 0, 100, &id, err, sizeof err),
            KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit_storage(s, KVTD_STORAGE_READ, keys, blocks, 2, 0x80, 0, 0, 100, &id, err, sizeof err),
            KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit_storage(s, KVTD_CANCEL, nullptr, nullptr, 0, 0, 0, 0, 100, &id, err, sizeof err),
            KVTD_E_INVALID);  // no task to cancel
  EXPECT_EQ(kvtd_set_weight_version(nullptr, 1), KVTD_E_INVALID);
  cep = make_error(IpcErrc::kClosed, "");
  kvtd_session_destroy(s);
}

// Agreement across ranks (storage tasks): each rank publishes its count, every rank gets the MIN.
// A published one-rank session (c_geometry(2)) with an in-process rank attached.
struct CSession {
  kvtd_session* s = nullptr;
  std::unique_ptr<RankEndpoint> ep;
  char err[512] = {0};
  explicit CSession(const std::string& name) {
    const auto suffix = test::unique_suffix(name);
    const kvtd_geometry g = c_geometry(2);
    EXPECT_EQ(kvtd_session_create(suffix.c_str(), &g, &s, err, sizeof err), KVTD_OK) << err;
    EXPECT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
    EXPECT_EQ(kvtd_publish(s, err, sizeof err), KVTD_OK) << err;
    auto pg = c_geometry_as_proto();
    pg.num_layers = 2;
    auto e = RankEndpoint::attach(endpoint_options(suffix, 0, pg));
    EXPECT_TRUE(e.ok()) << e.error().message;
    if (e.ok()) ep = std::move(e).value();
    EXPECT_EQ(kvtd_wait_ready(s, 0, err, sizeof err), KVTD_E_TIMEOUT);  // no ready flags yet: not ready
  }
  ~CSession() {
    ep.reset();
    kvtd_session_destroy(s);
  }
  // The header of the next task the rank reads.
  proto::TaskRecordHeader next() {
    std::vector<std::byte> rec;
    proto::TaskRecordHeader h{};
    EXPECT_EQ(ep->next_task(rec, monotonic_now_ns() + 1'000'000'000), RankEndpoint::Next::kTask);
    EXPECT_TRUE(decode_task_record(rec, &h).ok());
    return h;
  }
};

TEST(CApi, SubmitTaskCarriesDeadlineOrderingAndLayerwiseAndPollReportsPending) {
  CSession c("capi_task");
  const int32_t src[2] = {0, 1}, dst[2] = {4, 5};
  kvtd_task t{};
  t.kind = KVTD_SWAP_TO_DEVICE;
  t.flags = KVTD_TASK_LAYERWISE;
  t.src = src;
  t.dst = dst;
  t.n = 2;
  t.after_task_id = 77;
  t.deadline_ns = kvtd_now_ns() + 5'000'000'000;
  t.submit_timeout_ms = 100;
  uint64_t id = 0;
  ASSERT_EQ(kvtd_submit_task(c.s, &t, &id, c.err, sizeof c.err), KVTD_OK) << c.err;
  const auto h = c.next();
  EXPECT_EQ(h.task_id, id);
  EXPECT_EQ(h.after_task_id, 77u);
  EXPECT_EQ(h.deadline_ns, t.deadline_ns);
  EXPECT_EQ(h.flags & proto::kTaskFlagLayerwise, proto::kTaskFlagLayerwise);
  kvtd_completion out{};
  EXPECT_EQ(kvtd_poll(c.s, id, &out, c.err, sizeof c.err), KVTD_E_PENDING);
  EXPECT_EQ(kvtd_in_flight(c.s), 1u);
  // Layer 0 done, layer 1 not yet: wait_layer(0) returns, wait_layer(1) times out.
  c.ep->progress_begin(h);
  c.ep->progress_update(h, 1, 1);
  EXPECT_EQ(kvtd_wait_layer(c.s, id, 0, 1000, KVTD_LAYER_DONE, c.err, sizeof c.err), KVTD_OK) << c.err;
  EXPECT_EQ(kvtd_wait_layer(c.s, id, 1, 20, KVTD_LAYER_DONE, c.err, sizeof c.err), KVTD_E_TIMEOUT);
  EXPECT_EQ(kvtd_wait_layer(c.s, id, 1, 20, 7, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_wait_layer(c.s, id, 2, 20, KVTD_LAYER_DONE, c.err, sizeof c.err), KVTD_E_INVALID);
  report(*c.ep, id, 0, TaskStatus::kOk, 2);
  ASSERT_TRUE(test::eventually([&] { return kvtd_poll(c.s, id, &out, c.err, sizeof c.err) == KVTD_OK; },
                               std::chrono::seconds(5)));
  EXPECT_EQ(out.blocks_done, 2u);
  EXPECT_EQ(kvtd_poll(c.s, id, &out, c.err, sizeof c.err), KVTD_E_PENDING);  // handed out once
  EXPECT_EQ(kvtd_wait(c.s, id, 10, &out, c.err, sizeof c.err), KVTD_E_UNKNOWN_TASK);
  // The host backend publishes no CUDA events.
  uint8_t handle[64];
  EXPECT_EQ(kvtd_layer_event_handle(c.s, 0, 0, handle), KVTD_E_NO_EVENT);
  EXPECT_EQ(kvtd_layer_event_handle(c.s, 5, 0, handle), KVTD_E_NO_EVENT);
  EXPECT_EQ(kvtd_layer_event_handle(nullptr, 0, 0, handle), KVTD_E_INVALID);
  uint32_t epoch = 0;
  EXPECT_EQ(kvtd_layer_event(c.s, 0, 0, handle, &epoch), KVTD_E_NO_EVENT);
  EXPECT_EQ(kvtd_layer_event(c.s, 0, 0, handle, nullptr), KVTD_E_INVALID);
}

TEST(CApi, FailedTaskNamesRankAndStatusInPollAndWait) {
  CSession c("capi_fail");
  const int32_t src[1] = {3}, dst[1] = {1};
  uint64_t id = 0;
  ASSERT_EQ(kvtd_submit(c.s, KVTD_SWAP_TO_HOST, src, dst, 1, 100, &id, c.err, sizeof c.err), KVTD_OK) << c.err;
  (void)c.next();
  report(*c.ep, id, 0, TaskStatus::kHostTierLost, 0);
  kvtd_completion out{};
  ASSERT_EQ(kvtd_wait(c.s, id, 2000, &out, c.err, sizeof c.err), KVTD_E_TASK_FAILED);
  EXPECT_EQ(out.status, static_cast<int32_t>(TaskStatus::kHostTierLost));
  EXPECT_STREQ(kvtd_status_name(out.status), "host_tier_lost");
  EXPECT_NE(std::string(c.err).find("rank 0: host_tier_lost"), std::string::npos) << c.err;
}

// A swap that carries the engine's events: one 64-byte handle per rank (this session has one),
// in the record for the daemon's stream to wait on; a wrong count or a non-swap is refused.
TEST(CApi, ASwapCarriesOneEngineEventPerRank) {
  CSession c("capi_events");
  const int32_t src[1] = {3}, dst[1] = {1};
  kvtd_task t{};
  t.kind = KVTD_SWAP_TO_HOST;
  t.src = src;
  t.dst = dst;
  t.n = 1;
  t.submit_timeout_ms = 100;
  uint8_t events[2 * 64];
  for (int i = 0; i < 128; ++i) events[i] = static_cast<uint8_t>(i);
  uint64_t id = 0;
  EXPECT_EQ(kvtd_submit_task_after_events(c.s, &t, events, 2, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_NE(std::string(c.err).find("2 engine events for 1 ranks"), std::string::npos) << c.err;
  EXPECT_EQ(kvtd_submit_task_after_events(c.s, &t, nullptr, 1, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  ASSERT_EQ(kvtd_submit_task_after_events(c.s, &t, events, 1, &id, c.err, sizeof c.err), KVTD_OK) << c.err;
  std::vector<std::byte> rec;
  ASSERT_EQ(c.ep->next_task(rec, monotonic_now_ns() + 1'000'000'000), RankEndpoint::Next::kTask);
  auto d = decode_task_record(rec, nullptr);
  ASSERT_TRUE(d.ok());
  EXPECT_TRUE(d->header.flags & proto::kTaskFlagEngineEvent);
  ASSERT_EQ(d->events.size(), 64u);
  EXPECT_EQ(std::memcmp(d->events.data(), events, 64), 0);
  t.kind = KVTD_STORAGE_QUERY;
  t.n = 0;
  const char* keys[1] = {"k"};
  t.keys = keys;
  t.num_keys = 1;
  EXPECT_EQ(kvtd_submit_task_after_events(c.s, &t, events, 1, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_NE(std::string(c.err).find("engine events are for swap tasks"), std::string::npos) << c.err;
}

// The hardening for every field of kvtd_task: each bad value is refused with
// a message naming it, and nothing reaches the ring.
TEST(CApi, SubmitTaskRefusesEveryBadFieldNamingIt) {
  CSession c("capi_bad");
  const int32_t ids[2] = {0, 1};
  const char* keys[1] = {"k0"};
  uint64_t id = 0;
  auto expect_refused = [&](const kvtd_task& t, const std::string& says) {
    EXPECT_EQ(kvtd_submit_task(c.s, &t, &id, c.err, sizeof c.err), KVTD_E_INVALID) << says;
    EXPECT_NE(std::string(c.err).find(says), std::string::npos) << c.err;
  };
  kvtd_task t{};
  t.kind = 0;
  expect_refused(t, "task kind 0");
  t.kind = 99;
  expect_refused(t, "task kind 99");
  t = {};
  t.kind = KVTD_SWAP_TO_HOST;
  t.flags = 1u << 9;
  expect_refused(t, "unknown task flags");
  t.flags = 0;
  t.reserved = 1;
  expect_refused(t, "reserved");
  t.reserved = 0;
  t.n = 2;
  expect_refused(t, "src and dst must not be null");
  t.src = ids;
  t.dst = ids;
  t.flags = KVTD_TASK_LAYERWISE;
  expect_refused(t, "KVTD_TASK_LAYERWISE is for KVTD_SWAP_TO_DEVICE");
  t.flags = 0;
  t.deadline_ns = -5;
  expect_refused(t, "deadline_ns");
  t.deadline_ns = 0;
  const int32_t wrapped[2] = {0, INT32_MIN};  // a caller's 2^31 in an int32
  t.dst = wrapped;
  expect_refused(t, "dst[1] is -2147483648: block ids are 0..2147483647");
  t = {};
  t.kind = KVTD_STORAGE_READ;
  t.src = ids;
  t.dst = ids;
  t.n = 2;
  expect_refused(t, "src/dst are for swaps");
  t = {};
  t.kind = KVTD_STORAGE_READ;
  t.keys = keys;
  t.num_keys = 1;
  expect_refused(t, "blocks must not be null");
  t.num_keys = 70000;
  t.blocks = ids;
  expect_refused(t, "exceed the limit");
  t = {};
  t.kind = KVTD_STORAGE_QUERY;
  t.num_keys = 1;
  expect_refused(t, "keys must not be null");
  EXPECT_EQ(kvtd_submit_task(c.s, nullptr, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  t = {};
  t.kind = KVTD_SWAP_TO_HOST;
  EXPECT_EQ(kvtd_submit_task(c.s, &t, nullptr, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit_task(nullptr, &t, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit(c.s, KVTD_STORAGE_QUERY, ids, ids, 1, 10, &id, c.err, sizeof c.err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_submit_storage(c.s, KVTD_SWAP_TO_HOST, keys, ids, 1, 0, 0, 0, 10, &id, c.err, sizeof c.err),
            KVTD_E_INVALID);
  EXPECT_EQ(kvtd_in_flight(c.s), 0u);
  // A message longer than the caller's buffer is truncated, still NUL-terminated.
  char tiny[8];
  std::memset(tiny, 'x', sizeof tiny);
  t = {};
  EXPECT_EQ(kvtd_submit_task(c.s, &t, &id, tiny, sizeof tiny), KVTD_E_INVALID);
  EXPECT_EQ(tiny[7], '\0');
}

TEST(CApi, NamesVersionAndGeometry) {
  EXPECT_EQ(kvtd_client_abi(), KVTD_CLIENT_ABI);
  EXPECT_STREQ(kvtd_status_name(0), "ok");
  EXPECT_STREQ(kvtd_status_name(12345), "unknown_status");
  EXPECT_STREQ(kvtd_error_name(KVTD_E_PENDING), "pending");
  EXPECT_STREQ(kvtd_error_name(-3), "unknown_error");
  const std::int64_t a = kvtd_now_ns(), b = monotonic_now_ns();
  EXPECT_LE(a, b);  // the same clock: deadlines made in C mean what the daemons read
  CSession c("capi_geo");
  kvtd_geometry g{};
  ASSERT_EQ(kvtd_session_geometry(c.s, &g), KVTD_OK);
  EXPECT_EQ(g.num_layers, 2u);
  EXPECT_EQ(g.key_shape[0], 8);
  uint64_t bytes = 0;
  EXPECT_NE(kvtd_host_device_tensor(c.s, 0, 1, KVTD_KEY, &bytes), nullptr);
  EXPECT_EQ(bytes, 8u * 1 * 4 * 8 * 2);
  EXPECT_EQ(kvtd_host_device_tensor(c.s, 0, 9, KVTD_KEY, &bytes), nullptr);
  EXPECT_EQ(bytes, 0u);
  EXPECT_EQ(kvtd_session_geometry(nullptr, &g), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_session_generation(c.s), c.ep->generation());
  EXPECT_NE(std::string(kvtd_session_name(c.s)).find("capi_geo"), std::string::npos);
  EXPECT_STREQ(kvtd_session_name(nullptr), "");
  EXPECT_EQ(kvtd_weight_version(c.s), 0u);
  ASSERT_EQ(kvtd_set_weight_version(c.s, 7), KVTD_OK);
  EXPECT_EQ(kvtd_weight_version(c.s), 7u);
  // Ready bits follow the rank's flags while it is alive (FastDeploy's ready signals).
  EXPECT_EQ(kvtd_rank_ready(c.s, 0), 0u);
  c.ep->heartbeat();
  c.ep->set_ready(proto::kReadyCacheAttached);
  EXPECT_EQ(kvtd_rank_ready(c.s, 0), uint32_t{KVTD_READY_CACHE});
  c.ep->set_ready(proto::kReadyCacheAttached | proto::kReadyHostPool);
  EXPECT_EQ(kvtd_rank_ready(c.s, 0), uint32_t{KVTD_READY_CACHE | KVTD_READY_HOST_POOL});
  EXPECT_EQ(kvtd_rank_ready(c.s, 3), 0u);
  EXPECT_EQ(kvtd_rank_ready(nullptr, 0), 0u);
}

}  // namespace
}  // namespace kvtd::ipc

namespace kvtd::ipc {
namespace {

// The geometry's rules and the version, asked of the library (the Python module does; it used to
// re-derive shapes and sizes itself, and wrote the version in a fourth place).
TEST(CApi, TheLibraryAnswersTheGeometrysShapesAndItsVersion) {
  EXPECT_STREQ(kvtd_version(), KVTD_PROJECT_VERSION);
  kvtd_geometry g = c_geometry(3);
  for (int i = 0; i < 4; ++i) g.value_shape[i] = g.key_shape[i];
  g.dtype = KVTD_DTYPE_BLOCK_WISE_FP8;
  g.scale_bytes = 4;
  char err[256] = {};
  ASSERT_EQ(kvtd_geometry_check(&g, err, sizeof err), KVTD_OK) << err;
  std::int64_t shape[4];
  std::uint32_t ndim = 0;
  std::uint64_t block_bytes = 0, bytes = 0;
  ASSERT_EQ(kvtd_tensor_shape(&g, 1, KVTD_KEY, shape, &ndim, &block_bytes, &bytes, err, sizeof err), KVTD_OK) << err;
  EXPECT_EQ(ndim, 4u);
  EXPECT_EQ(shape[0], g.key_shape[0]);
  EXPECT_EQ(block_bytes, static_cast<std::uint64_t>(g.key_shape[1] * g.key_shape[2] * g.key_shape[3]));  // fp8: 1 byte
  EXPECT_EQ(bytes, block_bytes * static_cast<std::uint64_t>(g.key_shape[0]));
  ASSERT_EQ(kvtd_tensor_shape(&g, 1, KVTD_VALUE_SCALE, shape, &ndim, &block_bytes, nullptr, err, sizeof err), KVTD_OK);
  EXPECT_EQ(ndim, 3u) << "scales drop head_dim";
  EXPECT_EQ(block_bytes, static_cast<std::uint64_t>(g.value_shape[1] * g.value_shape[2] * 4));
  // No value cache (MLA, as c_geometry is): the value tensors are absent, not an error.
  kvtd_geometry mla = c_geometry(1);
  ASSERT_EQ(kvtd_tensor_shape(&mla, 0, KVTD_VALUE, shape, &ndim, &block_bytes, &bytes, err, sizeof err), KVTD_OK);
  EXPECT_EQ(ndim, 0u);
  EXPECT_EQ(bytes, 0u);
  // The one validation names the problem; a layer outside the geometry is refused.
  kvtd_geometry bad = g;
  bad.value_shape[0] = bad.key_shape[0] + 1;
  EXPECT_EQ(kvtd_geometry_check(&bad, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("same block count"), std::string::npos) << err;
  EXPECT_EQ(kvtd_tensor_shape(&g, 3, KVTD_KEY, shape, &ndim, nullptr, nullptr, err, sizeof err), KVTD_E_INVALID);
}

}  // namespace
}  // namespace kvtd::ipc

namespace kvtd {
namespace {

// A state group (layer 0) and a full-attention group (layer 1), one rank.
kvtd_cache_groups c_groups() {
  kvtd_cache_groups gs{};
  gs.num_ranks = 1;
  gs.num_groups = 2;
  gs.page_tokens = 4;
  gs.groups[0].kind = KVTD_GROUP_STATE;
  gs.groups[0].num_tensors = 1;
  gs.groups[0].device_blocks = 3;
  gs.groups[0].host_blocks = 5;
  gs.groups[0].layers[0] = 1;
  gs.groups[0].tensors[0] = {4, 1, {16, 0, 0}};
  gs.groups[1].kind = KVTD_GROUP_FULL_ATTENTION;
  gs.groups[1].num_tensors = 2;
  gs.groups[1].block_tokens = 4;
  gs.groups[1].device_blocks = 8;
  gs.groups[1].host_blocks = 6;
  gs.groups[1].layers[0] = 2;
  gs.groups[1].tensors[0] = gs.groups[1].tensors[1] = {2, 2, {4, 8, 0}};
  return gs;
}

TEST(CApi, AGroupSessionMakesEachSlotsTensorAndSpellsItsGroupsAsFlags) {
  char err[256] = {0};
  const kvtd_cache_groups gs = c_groups();
  kvtd_session* s = nullptr;
  ASSERT_EQ(kvtd_session_create_groups(test::unique_suffix("cgroups").c_str(), &gs, &s, err, sizeof err), KVTD_OK) << err;
  ASSERT_EQ(kvtd_create_host_device_tensors(s, err, sizeof err), KVTD_OK) << err;
  std::uint64_t bytes = 0;
  EXPECT_NE(kvtd_host_device_tensor(s, 0, 0, 0, &bytes), nullptr);
  EXPECT_EQ(bytes, 3u * 16 * 4);  // the state slot tensor
  EXPECT_NE(kvtd_host_device_tensor(s, 0, 1, 1, &bytes), nullptr);
  EXPECT_EQ(bytes, 8u * 4 * 8 * 2);  // layer 1's value tensor
  EXPECT_EQ(kvtd_host_device_tensor(s, 0, 0, 1, &bytes), nullptr);  // layer 0 has one slot
  kvtd_session_destroy(s);

  char spec[512] = {0};
  ASSERT_EQ(kvtd_group_spec(&gs, 1, spec, sizeof spec, err, sizeof err), KVTD_OK) << err;
  EXPECT_STREQ(spec, "kind=full_attention,layers=1,tensors=4x8@2+4x8@2,device_blocks=8,host_blocks=6,block_tokens=4");
  EXPECT_EQ(kvtd_group_spec(&gs, 2, spec, sizeof spec, err, sizeof err), KVTD_E_INVALID);
  EXPECT_EQ(kvtd_group_spec(&gs, 1, spec, 8, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("the buffer has 8"), std::string::npos) << err;

  kvtd_cache_groups bad = gs;
  bad.groups[1].layers[0] = 3;  // layer 0 in two attention groups
  EXPECT_EQ(kvtd_session_create_groups("cgroups_bad", &bad, &s, err, sizeof err), KVTD_E_INVALID);
  EXPECT_NE(std::string(err).find("layer 0 is in groups 0 and 1"), std::string::npos) << err;
}

TEST(CApi, AGroupSessionTakesOnlyTheOptionsThatApplyToIt) {
  char err[256] = {0};
  const kvtd_cache_groups gs = c_groups();
  kvtd_session* s = nullptr;
  kvtd_session_options no_forecast{};
  no_forecast.flags = KVTD_SESSION_NO_COMPLETION_FORECAST;
  ASSERT_EQ(kvtd_session_create_groups_with(test::unique_suffix("cgroupsopt").c_str(), &gs, &no_forecast, &s, err,
                                            sizeof err),
            KVTD_OK)
      << err;
  kvtd_session_destroy(s);
  kvtd_session_options one_rank{};  // an engine with a process per rank (vLLM, sglang) and hybrid groups
  one_rank.flags = KVTD_SESSION_ONLY_RANK;
  one_rank.only_rank = gs.num_ranks - 1;
  s = nullptr;
  ASSERT_EQ(kvtd_session_create_groups_with(test::unique_suffix("cgroupsrank").c_str(), &gs, &one_rank, &s, err,
                                            sizeof err),
            KVTD_OK)
      << err;
  kvtd_session_destroy(s);
  for (const std::uint32_t flags : {std::uint32_t{KVTD_SESSION_ADOPT_HOST_TIER}, 1u << 9}) {
    kvtd_session_options opts{};
    opts.flags = flags;
    s = nullptr;
    EXPECT_EQ(kvtd_session_create_groups_with("cgroups_opt_bad", &gs, &opts, &s, err, sizeof err), KVTD_E_INVALID);
    EXPECT_EQ(s, nullptr);
    EXPECT_NE(std::string(err).find("do not apply to a session over cache groups"), std::string::npos) << err;
  }
}

}  // namespace
}  // namespace kvtd
