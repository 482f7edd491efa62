// Prometheus metrics of a real daemon (--metrics-port): the exposition after real tasks, checked
// by value and by `promtool check metrics`; hostile HTTP never stops the endpoint.
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cstdio>
#include <fmt/format.h>
#include <fstream>

#include "daemon_fixture.h"
#include "storage_fixture.h"
#include "http_client.h"

namespace kvtd {
namespace {

std::uint16_t free_port() { return test::free_tcp_port(); }

int open_client(std::uint16_t port, const std::string& request) { return test::http_open(port, request); }
std::string http_exchange(std::uint16_t port, const std::string& request) { return test::http_exchange(port, request); }
std::string get(std::uint16_t port, const std::string& path) { return test::http_get(port, path); }

class MetricsTest : public DaemonTest {};

TEST_F(MetricsTest, ExpositionCountsRealTasksAndPassesPromtool) {
  g_ = test::small_geometry(1);
  const std::uint16_t port = free_port();
  extra_args_ = {"--metrics-port", std::to_string(port)};
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2}, {3, 4}).ok());
  ASSERT_TRUE(run(TaskKind::kSwapToDevice, {3, 4}, {5, 6}).ok());
  EXPECT_EQ(run(TaskKind::kSwapToHost, {99}, {0}).status, TaskStatus::kIdOutOfRange);
  const std::string reply = get(port, "/metrics");
  ASSERT_NE(reply.find("HTTP/1.1 200"), std::string::npos) << reply << test::read_file(log_path(0));
  EXPECT_NE(reply.find("text/plain; version=0.0.4"), std::string::npos) << reply;
  const std::string body = reply.substr(reply.find("\r\n\r\n") + 4);
  const auto bytes = 2 * g_.bytes_per_block_all_layers();
  for (const std::string& want :
       {std::string("kvtd_tasks_total{kind=\"SWAP_TO_HOST\",status=\"ok\"} 1\n"),
        std::string("kvtd_tasks_total{kind=\"SWAP_TO_DEVICE\",status=\"ok\"} 1\n"),
        std::string("kvtd_tasks_total{kind=\"SWAP_TO_HOST\",status=\"id_out_of_range\"} 1\n"),
        fmt::format("kvtd_bytes_total{{direction=\"to_host\"}} {}\n", bytes),
        fmt::format("kvtd_bytes_total{{direction=\"to_device\"}} {}\n", bytes),
        std::string("kvtd_task_seconds_count{kind=\"SWAP_TO_HOST\"} 2\n"),
        std::string("kvtd_task_queue_seconds_bucket{kind=\"SWAP_TO_DEVICE\",le=\"+Inf\"} 1\n"),
        std::string("kvtd_attached 1\n"), std::string("kvtd_epoch 1\n"), std::string("kvtd_ring_depth_bytes 0\n")})
    EXPECT_NE(body.find(want), std::string::npos) << "missing: " << want << body;
  EXPECT_NE(body.find("kvtd_host_pool_bytes "), std::string::npos) << body;
  EXPECT_NE(body.find("kvtd_host_pool_pin_seconds "), std::string::npos) << body;
  EXPECT_NE(body.find("kvtd_host_pool_pinned_bytes "), std::string::npos) << body;
  EXPECT_NE(body.find("kvtd_host_pool_pin_waits_total 0\n"), std::string::npos) << body;  // the host backend pins nothing
  EXPECT_NE(body.find("kvtd_host_pool_pin_wait_seconds_total "), std::string::npos) << body;
  // promtool (Debian's prometheus package) must accept the exposition as it is.
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) GTEST_SKIP() << "promtool is not installed";
  const std::string file = ::testing::TempDir() + "/" + suffix_ + ".prom";
  { std::ofstream(file) << body; }
  const std::string out_file = file + ".out";
  const int rc = std::system(("promtool check metrics < " + file + " > " + out_file + " 2>&1").c_str());
  EXPECT_EQ(rc, 0) << test::read_file(out_file) << body;
  std::remove(file.c_str());
  std::remove(out_file.c_str());
}

// What an operator asks of the storage tier - lookups by tier and agreed result,
// what the store holds, failed agreements by cause - from a real daemon and its real file store.
class StorageMetricsTest : public StorageTaskTest {};

TEST_F(StorageMetricsTest, LookupsStoreSizeAndFailedAgreementsAreExported) {
  g_ = test::small_geometry(1);
  const std::uint16_t port = free_port();
  extra_args_.insert(extra_args_.end(), {"--metrics-port", std::to_string(port)});
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(storage(TaskKind::kStorageWrite, make_keys("m", 3), iota_ids(0, 3)).ok());
  auto q = storage(TaskKind::kStorageQuery, {"m0", "m1", "m2", "x0", "x1"}, {});
  ASSERT_TRUE(q.ok());
  ASSERT_EQ(q.blocks_done, 3u);
  ASSERT_TRUE(storage(TaskKind::kStorageRead, {"m0", "x9"}, {10, 11}).ok());
  const std::vector<std::string> late_keys{"late0"};
  const std::vector<std::int32_t> late_blocks{4};
  TaskRequest late;
  late.kind = TaskKind::kStorageWrite;
  late.keys = late_keys;
  late.blocks = late_blocks;
  late.deadline_ns = 1;  // long past: this rank fails it before agreeing and tells its peers
  EXPECT_EQ(submit_and_wait(late).status, TaskStatus::kDeadlineExceeded);
  const std::string reply = get(port, "/metrics");
  const std::string body = reply.substr(reply.find("\r\n\r\n") + 4);
  for (const std::string& want :
       {std::string("kvtd_storage_lookups_total{kind=\"STORAGE_QUERY\",tier=\"file\",result=\"hit\"} 3\n"),
        std::string("kvtd_storage_lookups_total{kind=\"STORAGE_QUERY\",tier=\"file\",result=\"miss\"} 2\n"),
        std::string("kvtd_storage_lookups_total{kind=\"STORAGE_READ\",tier=\"file\",result=\"hit\"} 1\n"),
        std::string("kvtd_storage_lookups_total{kind=\"STORAGE_READ\",tier=\"file\",result=\"miss\"} 1\n"),
        std::string("kvtd_storage_operations_total{tier=\"file\",op=\"put\",result=\"ok\"} 3\n"),
        std::string("kvtd_store_objects{tier=\"file\"} 3\n"),
        std::string("kvtd_agreement_failures_total{cause=\"deadline_exceeded\",by=\"this_rank\"} 1\n")})
    EXPECT_NE(body.find(want), std::string::npos) << "missing: " << want << body;
  EXPECT_NE(body.find("kvtd_store_bytes{tier=\"file\"} "), std::string::npos) << body;
  EXPECT_EQ(body.find("kvtd_store_bytes{tier=\"file\"} 0\n"), std::string::npos) << body;
  if (std::system("command -v promtool > /dev/null 2>&1") != 0) GTEST_SKIP() << "promtool is not installed";
  const std::string file = ::testing::TempDir() + "/" + suffix_ + ".prom";
  { std::ofstream(file) << body; }
  const int rc = std::system(("promtool check metrics < " + file + " > " + file + ".out 2>&1").c_str());
  EXPECT_EQ(rc, 0) << test::read_file(file + ".out") << body;
}

TEST_F(MetricsTest, HostileRequestsGetErrorsAndTheEndpointKeepsServing) {
  g_ = test::small_geometry(1);
  const std::uint16_t port = free_port();
  extra_args_ = {"--metrics-port", std::to_string(port)};
  ASSERT_NO_FATAL_FAILURE(start_all());
  EXPECT_NE(get(port, "/").find("HTTP/1.1 404"), std::string::npos);
  EXPECT_NE(http_exchange(port, "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
                .find("HTTP/1.1 405"),
            std::string::npos);
  EXPECT_NE(http_exchange(port, "GARBAGE\r\n\r\n").find("HTTP/1.1 400"), std::string::npos);
  EXPECT_NE(http_exchange(port, "GET /metrics HTTP/1.1\r\nX-Big: " + std::string(20000, 'a') + "\r\n\r\n").find("HTTP/1.1 400"),
            std::string::npos);
  // A client that connects, says nothing and keeps the connection open is cut off by the 2 s
  // deadline (the server closes first: the read ends before the client's own 5 s timeout).
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(http_exchange(port, ""), "");
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::milliseconds(4500));
  EXPECT_NE(get(port, "/metrics").find("kvtd_attached 1"), std::string::npos);
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());  // and the rank still serves
}

// The endpoint served one connection at a time: one keep-alive client delayed
// a scrape 11.6 s, and 40 half-sent requests blocked it for over 30 s. Connections are served
// concurrently now, each bounded: a scrape answers within a second under both.
TEST_F(MetricsTest, AScrapeAnswersWithinASecondWhileOtherClientsHoldConnections) {
  g_ = test::small_geometry(1);
  const std::uint16_t port = free_port();
  extra_args_ = {"--metrics-port", std::to_string(port)};
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::vector<int> held;
  // A keep-alive client that scraped once and keeps its connection open, reading nothing more.
  held.push_back(open_client(port, "GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n"));
  // Forty clients that send half a request and stall.
  for (int i = 0; i < 40; ++i) held.push_back(open_client(port, "GET /metr"));
  for (int fd : held) ASSERT_GE(fd, 0);
  for (int round = 0; round < 3; ++round) {
    const auto t0 = std::chrono::steady_clock::now();
    const std::string body = get(port, "/metrics");
    const auto took = std::chrono::steady_clock::now() - t0;
    EXPECT_NE(body.find("kvtd_attached 1"), std::string::npos) << body.substr(0, 200);
    EXPECT_LT(took, std::chrono::seconds(1)) << "scrape " << round << " waited behind other clients";
  }
  for (int fd : held) ::close(fd);
}

TEST_F(MetricsTest, APortInUseStopsStartUpNamingIt) {
  const int s = socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a), 0);
  ASSERT_EQ(listen(s, 1), 0);
  socklen_t len = sizeof a;
  getsockname(s, reinterpret_cast<sockaddr*>(&a), &len);
  extra_args_ = {"--metrics-port", std::to_string(ntohs(a.sin_port))};
  Child d = start_daemon(0);
  EXPECT_EQ(d.wait_exit(std::chrono::seconds(20)), 2);
  EXPECT_NE(test::read_file(log_path(0)).find("--metrics-port"), std::string::npos) << test::read_file(log_path(0));
  ::close(s);
}

}  // namespace
}  // namespace kvtd
