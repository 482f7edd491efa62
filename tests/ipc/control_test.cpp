// The control plane through real processes: `kvtd ctl` against running daemons (status as a
// table and as JSON, log-level, drain), hostile requests on the socket, and no daemon at all.
#include <arpa/inet.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <zmq.hpp>

#include <atomic>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "daemon_fixture.h"
#include "kvtd/control/control.h"

namespace kvtd {
namespace {

using json = nlohmann::json;

class ControlTest : public DaemonTest {
 protected:
  // Runs `kvtd ctl <args>`; returns (exit code, stdout + stderr).
  std::pair<int, std::string> ctl(std::vector<std::string> args) {
    args.insert(args.begin(), {test::kvtd_binary(), "ctl"});
    const std::string out = ::testing::TempDir() + "/" + suffix_ + "_ctl.out";
    Child c(args, out);
    const int code = c.wait_exit(std::chrono::seconds(30));
    auto text = test::read_file(out);
    std::remove(out.c_str());
    return {code, text};
  }
  std::string socket_of(std::uint32_t rank) {
    auto dir = control::runtime_dir();
    EXPECT_TRUE(dir.ok());
    return "ipc://" + control::socket_path(dir.ok() ? *dir : "", suffix_, 0, rank);
  }
};

// Runs `kvtd ctl <args>` as uid/gid 65534 (another local user); (exit code, output). Root only.
std::pair<int, std::string> ctl_as_nobody(const std::string& suffix, std::vector<std::string> args) {
  const std::string out = ::testing::TempDir() + "/" + suffix + "_nobody.out";
  std::remove(out.c_str());
  const pid_t pid = fork();
  if (pid == 0) {
    const int fd = ::open(out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0666);
    if (fd >= 0) {
      ::dup2(fd, 1);
      ::dup2(fd, 2);
    }
    if (::setgid(65534) != 0 || ::setuid(65534) != 0) _exit(99);
    args.insert(args.begin(), {test::kvtd_binary(), "ctl"});
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execv(test::kvtd_binary().c_str(), argv.data());
    _exit(98);
  }
  int status = 0;
  waitpid(pid, &status, 0);
  auto text = test::read_file(out);
  std::remove(out.c_str());
  return {WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status), text};
}

// With --control-endpoint tcp://127.0.0.1:P any local user ran status, log-level,
// clear and drain. The TCP endpoint now needs a secret from a private file and answers nothing
// else; the ipc socket stays private to the daemon's user.
TEST_F(ControlTest, TheTcpEndpointAnswersOnlyRequestsWithTheSecretAndTheIpcSocketIsPrivate) {
  g_ = test::small_geometry(1);
  const std::string secret = ::testing::TempDir() + "/" + suffix_ + "_secret";
  std::ofstream(secret) << "correct-horse-battery-staple\n";
  ASSERT_EQ(::chmod(secret.c_str(), 0644), 0);
  const std::uint16_t port = test::free_tcp_port();
  const std::string tcp = fmt::format("tcp://127.0.0.1:{}", port);
  extra_args_ = {"--control-endpoint", tcp, "--control-secret-file", secret};
  {  // a secret others can read is refused at start, naming the file and its mode
    Child d = start_daemon(0);
    EXPECT_EQ(d.wait_exit(std::chrono::seconds(20)), 2);
    const auto log = test::read_file(log_path(0));
    EXPECT_NE(log.find(secret), std::string::npos) << log;
    EXPECT_NE(log.find("0644"), std::string::npos) << log;
  }
  ASSERT_EQ(::chmod(secret.c_str(), 0600), 0);
  ASSERT_NO_FATAL_FAILURE(start_all());
  auto [no_secret, refused] = ctl({"--endpoint", tcp, "--json", "status"});
  EXPECT_NE(no_secret, 0) << refused;
  EXPECT_NE(refused.find("unauthorized"), std::string::npos) << refused;
  EXPECT_EQ(refused.find("\"pid\""), std::string::npos) << "nothing about the daemon leaks: " << refused;
  auto [with_secret, status] = ctl({"--endpoint", tcp, "--secret-file", secret, "--json", "status"});
  EXPECT_EQ(with_secret, 0) << status;
  const json replies = json::parse(status, nullptr, false);
  ASSERT_TRUE(replies.is_array() && replies.size() == 1) << status;
  EXPECT_TRUE(replies[0]["result"]["attached"].get<bool>()) << status;
  if (::geteuid() == 0) {
    // Another local user: drain over TCP without the secret is refused and the daemon serves on;
    // the ipc socket (0600 in a 0700 directory) is out of its reach.
    auto [tcp_code, tcp_out] = ctl_as_nobody(suffix_, {"--endpoint", tcp, "--timeout", "2", "drain"});
    EXPECT_NE(tcp_code, 0) << tcp_out;
    EXPECT_NE(tcp_out.find("unauthorized"), std::string::npos) << tcp_out;
    auto [ipc_code, ipc_out] = ctl_as_nobody(suffix_, {"--endpoint", socket_of(0), "--timeout", "1", "drain"});
    EXPECT_NE(ipc_code, 0) << ipc_out;
    EXPECT_TRUE(daemons_[0].running()) << "another user stopped the daemon";
    ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  }
  std::remove(secret.c_str());
}

// A client that is not authorized costs only its own requests. Another local
// user, without the secret, sends the 5 bytes 01 00 02 00 78 and closes, every 20 ms, and a ZeroMQ
// client sends one frame without the envelope delimiter and closes. On the old REP socket the next
// request's routing frame was then taken as payload and its reply lost: 0 of 10 status requests
// were answered, and a log-level change was executed but reported as failed. With a ROUTER that
// checks each envelope itself, every operator request is answered.
TEST_F(ControlTest, MalformedPacketsOnTheTcpEndpointCostOnlyTheirSendersRequests) {
  g_ = test::small_geometry(1);
  const std::string secret_file = ::testing::TempDir() + "/" + suffix_ + "_secret";
  const std::string secret = "correct-horse-battery-staple";
  std::ofstream(secret_file) << secret << "\n";
  ASSERT_EQ(::chmod(secret_file.c_str(), 0600), 0);
  const std::uint16_t port = test::free_tcp_port();
  const std::string tcp = fmt::format("tcp://127.0.0.1:{}", port);
  extra_args_ = {"--control-endpoint", tcp, "--control-secret-file", secret_file};
  ASSERT_NO_FATAL_FAILURE(start_all());
  std::atomic<bool> stop{false};
  std::atomic<int> packets{0};
  std::thread garbage([&] {
    zmq::context_t ctx{1};
    while (!stop) {
      const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
      sockaddr_in a{};
      a.sin_family = AF_INET;
      a.sin_port = htons(port);
      a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
      if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0) {
        const unsigned char bytes[5] = {0x01, 0x00, 0x02, 0x00, 0x78};
        (void)!::write(fd, bytes, sizeof bytes);
      }
      ::close(fd);
      {  // a ZeroMQ peer with no envelope delimiter, gone at once
        zmq::socket_t d{ctx, zmq::socket_type::dealer};
        d.set(zmq::sockopt::linger, 100);
        d.connect(tcp);
        d.send(zmq::buffer(std::string(R"({"command": "status"})")), zmq::send_flags::none);
      }
      ++packets;
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  });
  int answered = 0;
  control::Request status;
  status.command = "status";
  status.token = secret;
  for (int i = 0; i < 10; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(50));  // malformed packets in between
    auto r = control::call(tcp, status, 1000);
    if (r.ok() && json::parse(*r, nullptr, false).value("ok", false)) ++answered;
  }
  control::Request level;
  level.command = "log-level";
  level.level = "info";
  level.token = secret;
  auto lr = control::call(tcp, level, 1000);
  stop = true;
  garbage.join();
  std::printf("figure: %d of 10 status requests answered while %d malformed packets arrived\n", answered,
              packets.load());
  EXPECT_EQ(answered, 10);
  ASSERT_TRUE(lr.ok()) << lr.error().message;
  EXPECT_TRUE(json::parse(*lr, nullptr, false).value("ok", false)) << *lr;
  EXPECT_GT(packets.load(), 10);
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  std::remove(secret_file.c_str());
}

// Another local user holding ~1,100 TCP connections to the control port (no
// secret needed to connect) and to the KV events endpoint exhausted the daemon's descriptors
// (1,024 under systemd's default): storage tasks failed and an operator's `kvtd ctl` over the
// private ipc socket made the daemon abort. The daemons here start with that soft limit. Now each
// listener caps its connections, the daemon raises its soft limit to the hard one, and storage,
// the ipc socket and an operator's TCP request all keep working.
TEST_F(ControlTest, ADescriptorFloodOnTheTcpListenersStopsNothing) {
  rlimit mine{};
  ASSERT_EQ(::getrlimit(RLIMIT_NOFILE, &mine), 0);
  constexpr int kFlood = 1100, kEventsFlood = 200;
  if (mine.rlim_max != RLIM_INFINITY && mine.rlim_max < kFlood + kEventsFlood + 512)
    GTEST_SKIP() << "this process may hold only " << mine.rlim_max << " descriptors";
  g_ = test::small_geometry(1);
  const std::string secret_file = ::testing::TempDir() + "/" + suffix_ + "_secret";
  const std::string secret = "correct-horse-battery-staple";
  std::ofstream(secret_file) << secret << "\n";
  ASSERT_EQ(::chmod(secret_file.c_str(), 0600), 0);
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_store";
  const std::uint16_t port = test::free_tcp_port(), events_port = test::free_tcp_port();
  const std::string tcp = fmt::format("tcp://127.0.0.1:{}", port);
  extra_args_ = {"--control-endpoint", tcp, "--control-secret-file", secret_file, "--storage-backend", "file",
                 "--storage-path", store, "--model-id", "m", "--kv-events-endpoint",
                 fmt::format("tcp://*:{}", events_port)};
  {  // the daemons start with systemd's default soft limit
    rlimit low = mine;
    low.rlim_cur = 1024;
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &low), 0);
    start_all();
    ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &mine), 0);
    if (HasFatalFailure()) return;
  }
  rlimit high = mine;
  high.rlim_cur = high.rlim_max;
  ASSERT_EQ(::setrlimit(RLIMIT_NOFILE, &high), 0);
  // A ZeroMQ peer that finishes the handshake (ZMTP 3.0: greeting with the NULL mechanism, then
  // READY naming its socket type) and then holds the connection: libzmq keeps such a peer forever.
  auto connect_to = [](std::uint16_t p, const std::string& type) {
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_port = htons(p);
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    timeval patience{0, 200'000};  // a listener that stopped accepting must not hold the test
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &patience, sizeof patience);
    if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
      ::close(fd);
      return -1;
    }
    std::string hello(64, '\0');
    hello[0] = '\xff';
    hello[9] = '\x7f';
    hello[10] = 3;
    hello.replace(12, 4, "NULL");
    const std::string property = std::string("\x0bSocket-Type") + std::string("\0\0\0", 3) +
                                 static_cast<char>(type.size()) + type;
    const std::string ready = std::string("\x05READY") + property;
    hello += std::string("\x04") + static_cast<char>(ready.size()) + ready;
    (void)!::write(fd, hello.data(), hello.size());
    return fd;
  };
  std::vector<int> held;
  for (int i = 0; i < kFlood; ++i) held.push_back(connect_to(port, "DEALER"));
  for (int i = 0; i < kEventsFlood; ++i) held.push_back(connect_to(events_port, "SUB"));
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the daemon has accepted them
  // The daemon holds a bounded number of descriptors, not one per connection.
  std::size_t fds = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(
           fmt::format("/proc/{}/fd", daemons_[0].pid())))
    ++fds;
  std::printf("figure: the daemon holds %zu descriptors while %d connections are held to its listeners\n", fds,
              kFlood + kEventsFlood);
  EXPECT_LT(fds, 400u);
  // Storage tasks, the private ipc socket and an operator's TCP request all work.
  const std::vector<std::string> keys = {"flood0", "flood1"};
  const std::vector<std::int32_t> blocks = {1, 2};
  TaskRequest w;
  w.kind = TaskKind::kStorageWrite;
  w.keys = keys;
  w.blocks = blocks;
  auto wr = submit_and_wait(w);
  EXPECT_TRUE(wr.ok()) << (wr.failures.empty() ? "" : wr.failures[0].message);
  auto [code, out] = ctl({"--endpoint", socket_of(0), "--json", "status"});
  EXPECT_EQ(code, 0) << out;
  control::Request status;
  status.command = "status";
  status.token = secret;
  auto r = control::call(tcp, status, 2000);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_TRUE(json::parse(*r, nullptr, false).value("ok", false)) << *r;
  for (int fd : held)
    if (fd >= 0) ::close(fd);
  EXPECT_TRUE(daemons_[0].running());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  EXPECT_NE(test::read_file(log_path(0)).find("descriptors: soft limit raised from 1024"), std::string::npos);
  std::filesystem::remove_all(store);
  std::remove(secret_file.c_str());
}

// Storage gc held the control socket for its whole run (up to an hour): a
// `status` waited behind it. It now runs beside the control loop: a status sent while a long gc
// runs is answered first; the gc's reply comes when it ends. Its walk is made long with 30,000
// files of an old layout that kvtd did not write (each header is read, and each is left alone).
TEST_F(ControlTest, StatusIsAnsweredWhileAStorageGcRuns) {
  g_ = test::small_geometry(1);
  const std::string store = ::testing::TempDir() + "/" + suffix_ + "_gcstore";
  std::filesystem::remove_all(store);
  extra_args_ = {"--storage-backend", "file", "--storage-path", store, "--model-id", "m"};
  ASSERT_NO_FATAL_FAILURE(start_all());
  for (int d = 0; d < 100; ++d) {
    const std::string dir = fmt::format("{}/m/00000000deadbeef/{:02d}", store, d);
    std::filesystem::create_directories(dir);
    for (int i = 0; i < 300; ++i) std::ofstream(fmt::format("{}/k{}.w0-0.r0.kvo", dir, i)) << "not kvtd's";
  }
  std::atomic<bool> gc_done{false};
  std::atomic<bool> status_before_gc{false};
  std::string gc_reply;
  std::thread gc([&] {
    control::Request r;
    r.command = "storage-gc";
    r.gc.keep_weight_version = 0;
    auto out = control::call(socket_of(0), r, 120'000);
    gc_reply = out.ok() ? *out : out.error().message;
    gc_done = true;
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(50));  // the gc has started walking
  control::Request st;
  st.command = "status";
  auto status = control::call(socket_of(0), st, 5000);
  status_before_gc = !gc_done.load();
  gc.join();
  ASSERT_TRUE(status.ok()) << status.error().message;
  EXPECT_TRUE(json::parse(*status, nullptr, false).value("ok", false)) << *status;
  EXPECT_TRUE(status_before_gc.load()) << "status waited for the gc";
  const json g = json::parse(gc_reply, nullptr, false);
  ASSERT_TRUE(g.is_object() && g.value("ok", false)) << gc_reply;
  EXPECT_EQ(g["result"]["removed"].get<int>(), 0);
  EXPECT_EQ(g["result"]["foreign"].get<int>(), 30000);
  std::filesystem::remove_all(store);
}

TEST_F(ControlTest, StatusOfEveryRankAsJsonAndAsATable) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1, 2}, {3, 4}).ok());
  EXPECT_EQ(run(TaskKind::kSwapToHost, {99}, {0}).status, TaskStatus::kIdOutOfRange);
  auto [code, out] = ctl({"--session", suffix_, "--json", "status"});
  ASSERT_EQ(code, 0) << out;
  const json replies = json::parse(out, nullptr, false);
  ASSERT_TRUE(replies.is_array()) << out;
  ASSERT_EQ(replies.size(), 2u) << out;
  for (std::uint32_t r = 0; r < 2; ++r) {
    const auto& rep = replies[r];
    ASSERT_TRUE(rep["ok"].get<bool>()) << rep.dump();
    const auto& s = rep["result"];
    EXPECT_EQ(s["rank"].get<std::uint32_t>(), r);
    EXPECT_EQ(s["session"].get<std::string>(), suffix_);
    EXPECT_TRUE(s["attached"].get<bool>());
    EXPECT_GE(s["epoch"].get<std::uint32_t>(), 1u);
    EXPECT_EQ(s["bytes"]["to_host"].get<std::uint64_t>(), 2 * g_.bytes_per_block_all_layers());
    EXPECT_EQ(s["pid"].get<std::int64_t>(), daemons_[r].pid());
    // The facts /healthz and /readyz answer.
    EXPECT_TRUE(s["health"]["live"]["live"].get<bool>()) << s.dump();
    EXPECT_TRUE(s["health"]["ready"]["ready"].get<bool>()) << s.dump();
    bool saw_ok = false, saw_failed = false;
    for (const auto& t : s["tasks"]) {
      saw_ok = saw_ok || (t["kind"] == "SWAP_TO_HOST" && t["status"] == "ok" && t["count"] == 1);
      saw_failed = saw_failed || (t["status"] == "id_out_of_range" && t["count"] == 1);
    }
    EXPECT_TRUE(saw_ok && saw_failed) << s.dump();
    ASSERT_EQ(s["last_errors"].size(), 1u) << s.dump();
    EXPECT_NE(s["last_errors"][0].get<std::string>().find("id_out_of_range"), std::string::npos);
  }
  auto [tcode, table] = ctl({"--session", suffix_, "status"});
  EXPECT_EQ(tcode, 0) << table;
  EXPECT_NE(table.find("rank 0"), std::string::npos) << table;
  EXPECT_NE(table.find("rank 1"), std::string::npos) << table;
  EXPECT_NE(table.find("attached"), std::string::npos) << table;
  EXPECT_NE(table.find("last error: task"), std::string::npos) << table;
}

TEST_F(ControlTest, LogLevelChangesOneRankAndBadLevelsAreRefused) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  auto [code, out] = ctl({"--session", suffix_, "--rank", "1", "log-level", "warn"});
  EXPECT_EQ(code, 0) << out;
  EXPECT_NE(out.find("rank 1: log level warn"), std::string::npos) << out;
  EXPECT_TRUE(test::eventually([&] { return test::read_file(log_path(1)).find("-> warn (control socket)") != std::string::npos; },
                               std::chrono::seconds(5)));
  EXPECT_EQ(test::read_file(log_path(0)).find("(control socket)"), std::string::npos);
  auto [bad, why] = ctl({"--session", suffix_, "log-level", "loud"});
  EXPECT_EQ(bad, 2) << why;
  EXPECT_NE(why.find("'loud'"), std::string::npos) << why;
  auto [unknown, msg] = ctl({"--session", suffix_, "reboot"});
  EXPECT_EQ(unknown, 2) << msg;
}

TEST_F(ControlTest, HostileRequestsGetErrorRepliesAndTheSocketKeepsAnswering) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  zmq::context_t ctx{1};
  auto ask = [&](const std::string& payload) -> std::string {
    zmq::socket_t s{ctx, zmq::socket_type::req};
    s.set(zmq::sockopt::linger, 0);
    s.set(zmq::sockopt::rcvtimeo, 2000);
    s.connect(socket_of(0));
    s.send(zmq::buffer(payload), zmq::send_flags::none);
    zmq::message_t m;
    if (!s.recv(m, zmq::recv_flags::none)) return "(no reply)";
    return std::string(static_cast<const char*>(m.data()), m.size());
  };
  for (const std::string& bad : {std::string("not json at all"), std::string("[1, 2, 3]"), std::string("{}"),
                                 std::string(R"({"command": 7})"), std::string(R"({"command": "reboot"})"),
                                 std::string(R"({"command": "log-level", "level": "loud"})"), std::string("\xff\xfe")}) {
    const json r = json::parse(ask(bad), nullptr, false);
    ASSERT_TRUE(r.is_object()) << bad;
    EXPECT_FALSE(r["ok"].get<bool>()) << bad;
    EXPECT_FALSE(r["error"].get<std::string>().empty()) << bad;
  }
  // Over the 64 KiB limit: ZeroMQ drops the connection, no reply; the daemon is unharmed.
  EXPECT_EQ(ask(std::string(1 << 20, '{')), "(no reply)");
  const json ok = json::parse(ask(R"({"command": "status"})"), nullptr, false);
  ASSERT_TRUE(ok.is_object());
  EXPECT_TRUE(ok["ok"].get<bool>()) << ok.dump();
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
}

TEST_F(ControlTest, DrainFinishesAndExitsAndNoDaemonIsAClearError) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  auto [code, out] = ctl({"--session", suffix_, "--rank", "0", "drain"});
  EXPECT_EQ(code, 0) << out;
  EXPECT_EQ(daemons_[0].wait_exit(std::chrono::seconds(30)), 0);
  EXPECT_NE(test::read_file(log_path(0)).find("drain requested over the control socket"), std::string::npos);
  // Rank 0 is gone, rank 1 answers: --all reports the one that answers and exits 1 for the other.
  auto [gone, msg] = ctl({"--session", suffix_, "--rank", "0", "--timeout", "0.5", "status"});
  EXPECT_EQ(gone, 1) << msg;
  EXPECT_NE(msg.find("rank 0"), std::string::npos) << msg;
  auto [none, why] = ctl({"--session", "no_such_session_here", "status"});
  EXPECT_EQ(none, 1) << why;
  EXPECT_NE(why.find("no daemon of session 'no_such_session_here'"), std::string::npos) << why;
  auto [missing, usage] = ctl({"status"});
  EXPECT_EQ(missing, 2) << usage;
}

TEST_F(ControlTest, CtlClearReleasesTheMappingsFailsTasksAndRestoreServesAgain) {
  ASSERT_NO_FATAL_FAILURE(start_all());
  ASSERT_TRUE(run(TaskKind::kSwapToHost, {1}, {2}).ok());
  auto [code, out] = ctl({"--session", suffix_, "--drop-host-tier", "clear"});
  ASSERT_EQ(code, 0) << out;
  EXPECT_NE(out.find("rank 0: cache cleared (mappings closed, host tier dropped)"), std::string::npos) << out;
  EXPECT_NE(out.find("rank 1: cache cleared"), std::string::npos) << out;
  auto [scode, status] = ctl({"--session", suffix_, "--json", "status"});
  ASSERT_EQ(scode, 0) << status;
  for (const auto& rep : json::parse(status)) EXPECT_EQ(rep["result"]["cache"], "cleared") << rep.dump();
  auto [tcode, table] = ctl({"--session", suffix_, "status"});
  EXPECT_NE(table.find("CACHE CLEARED"), std::string::npos) << table;
  // The engine did not clear: its tasks reach the daemons, which fail them naming why.
  const auto failed = run(TaskKind::kSwapToHost, {3}, {4});
  EXPECT_EQ(failed.status, TaskStatus::kCacheCleared);
  ASSERT_FALSE(failed.failures.empty());
  EXPECT_NE(failed.failures[0].message.find("weight update"), std::string::npos) << failed.failures[0].message;
  auto [rcode, rout] = ctl({"--session", suffix_, "restore"});
  ASSERT_EQ(rcode, 0) << rout;
  EXPECT_NE(rout.find("rank 1: cache restored"), std::string::npos) << rout;
  ASSERT_TRUE(engine_->wait_ready(10'000'000'000).ok());
  EXPECT_EQ(run(TaskKind::kSwapToDevice, {2}, {5}).status, TaskStatus::kHostTierLost);  // dropped
  round_trip({6, 7}, {8, 9}, {10, 11});
  // An engine-driven clear is the engine's to restore: `kvtd ctl restore` says so.
  ASSERT_TRUE(engine_->clear_caches().ok());
  auto [refused, why] = ctl({"--session", suffix_, "--rank", "0", "restore"});
  EXPECT_EQ(refused, 1) << why;
  EXPECT_NE(why.find("the engine has cleared its cache"), std::string::npos) << why;
  ASSERT_TRUE(engine_->restore_caches().ok());
  round_trip({1}, {2}, {3});
}

}  // namespace
}  // namespace kvtd
