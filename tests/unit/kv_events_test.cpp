// KV events: the publisher's refusals (the engine key an eviction reports is recovered by
// storage::StoredName, tests/unit/object_name_test.cpp). The wire format itself is checked by a real
// subscriber decoding with python3-msgpack (tests/python/test_kv_events.py).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>
#include <zmq.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "kvtd/events/kv_events.h"
#include "kvtd/metrics/registry.h"
#include "msgpack_writer.h"  // events/src: the encoder itself
#include "sanitizer_build.h"
#include "test_support.h"

namespace kvtd {
namespace {

TEST(KvEvents, PublisherRefusesWhatItCannotServe) {
  events::KvEventsOptions o;
  o.medium = "DISK";
  auto none = events::KvEventPublisher::open(o);
  ASSERT_FALSE(none.ok());
  EXPECT_NE(none.error().message.find("--kv-events-endpoint"), std::string::npos);
  o.endpoint = "tcp://*:notaport";
  auto bad = events::KvEventPublisher::open(o);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().code, events::EventsErrc::kSocket);
  EXPECT_NE(bad.error().message.find("tcp://*:notaport"), std::string::npos) << bad.error().message;
}

TEST(KvEvents, EventsBeyondTheQueueBoundAreDroppedAndCountedNotWaitedFor) {
  events::KvEventsOptions o;
  o.endpoint = "inproc://kv-events-queue-test";
  o.medium = "DISK";
  o.max_queued_events = 2;
  auto p = events::KvEventPublisher::open(o);
  ASSERT_TRUE(p.ok()) << p.error().message;
  (*p)->stored({"1", "2", "3"});  // more than the queue holds at all: dropped on the spot
  EXPECT_EQ((*p)->stats().events_dropped, 3u);
  (*p)->stored({"4"});
  (*p)->cleared();
  // What the daemon exports of it (start_up.cpp sets this provider on rank 0).
  metrics::MetricsRegistry registry;
  registry.set_kv_event_figures([&] {
    const auto st = (*p)->stats();
    return metrics::MetricsRegistry::KvEventFigures{st.events_sent, st.events_dropped};
  });
  const std::string text = registry.render();
  EXPECT_NE(text.find("kvtd_kv_events_dropped_total 3\n"), std::string::npos) << text;
  EXPECT_NE(text.find("# TYPE kvtd_kv_events_sent_total counter\n"), std::string::npos) << text;
}

std::uint64_t resident_bytes() {
  std::FILE* f = std::fopen("/proc/self/statm", "r");
  unsigned long long size = 0, resident = 0;
  if (f != nullptr) {
    if (std::fscanf(f, "%llu %llu", &size, &resident) != 2) resident = 0;
    std::fclose(f);
  }
  return resident * static_cast<std::uint64_t>(::sysconf(_SC_PAGESIZE));
}

// A subscriber that connects and never reads made the publisher's memory grow
// with every event it could not deliver: ZeroMQ's queue for it held 100,000 batches of up to
// 1,024 events, though the documentation promised a bounded queue. Bytes are bounded now: a
// batch holds at most 256 KiB and a subscriber's queue 32 batches. 400,000 events of 122-character
// keys, sent as fast as they are taken (so the publisher's own queue stays short), against a
// subscriber with the smallest receive queue ZeroMQ allows.
TEST(KvEvents, ASubscriberThatNeverReadsCostsBoundedMemory) {
#if KVTD_SANITIZED_BUILD
  GTEST_SKIP() << "resident memory is the sanitizer's here (ASan keeps freed memory in quarantine)";
#endif
  events::KvEventsOptions o;
  o.endpoint = "tcp://127.0.0.1:*";
  o.medium = "DISK";
  auto p = events::KvEventPublisher::open(o);
  ASSERT_TRUE(p.ok()) << p.error().message;
  zmq::context_t ctx{1};
  zmq::socket_t stalled{ctx, zmq::socket_type::sub};
  stalled.set(zmq::sockopt::rcvhwm, 1);
  stalled.set(zmq::sockopt::rcvbuf, 4096);
  stalled.set(zmq::sockopt::subscribe, "");
  stalled.connect((*p)->endpoint());
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the subscription reaches the publisher
  const std::uint64_t before = resident_bytes();
  constexpr int kRounds = 400, kPerRound = 1000;
  std::uint64_t handed = 0;
  for (int r = 0; r < kRounds; ++r) {
    std::vector<std::string> keys;
    for (int i = 0; i < kPerRound; ++i) {
      std::string k = fmt::format("prefix-{}-{}-", r, i);
      k.resize(122, 'x');
      keys.push_back(std::move(k));
    }
    (*p)->stored(std::move(keys));
    handed += kPerRound;
    for (int wait = 0; wait < 5000; ++wait) {
      const auto st = (*p)->stats();
      if (st.events_sent + st.events_dropped >= handed) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
  }
  const std::uint64_t grown = resident_bytes() - std::min(before, resident_bytes());
  const auto st = (*p)->stats();
  std::printf("figure: resident memory grew %.1f MiB over %llu events (%.1f MiB of keys) to a subscriber that "
              "never reads; %llu sent, %llu dropped\n",
              static_cast<double>(grown) / (1 << 20), static_cast<unsigned long long>(handed),
              static_cast<double>(handed * 122) / (1 << 20), static_cast<unsigned long long>(st.events_sent),
              static_cast<unsigned long long>(st.events_dropped));
  EXPECT_LT(grown, std::uint64_t{24} << 20);
  stalled.close();
}

// Removals past the queue were dropped silently (a gc of more than 100,000
// objects), so a router kept keys that were gone. A lost removal is now followed by an
// AllBlocksCleared after the events queued before it: the router forgets what it cannot trust.
TEST(KvEvents, ALostRemovalIsFollowedByAClearTheRouterSees) {
  const std::string endpoint = fmt::format("ipc://{}/kv_events_lost_{}", ::testing::TempDir(), ::getpid());
  events::KvEventsOptions o;
  o.endpoint = endpoint;
  o.medium = "DISK";
  o.max_queued_events = 4;
  auto p = events::KvEventPublisher::open(o);
  ASSERT_TRUE(p.ok()) << p.error().message;
  zmq::context_t ctx{1};
  zmq::socket_t sub{ctx, zmq::socket_type::sub};
  sub.set(zmq::sockopt::subscribe, "");
  sub.set(zmq::sockopt::rcvtimeo, 5000);
  sub.connect(endpoint);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  (*p)->stored({"1"});
  (*p)->removed({"a", "b", "c", "d", "e"});  // more than the queue holds: lost
  std::string seen;
  while (seen.find("AllBlocksCleared") == std::string::npos) {
    zmq::message_t topic, seq, payload;
    ASSERT_TRUE(sub.recv(topic) && sub.recv(seq) && sub.recv(payload)) << "no clear after the lost removal: " << seen;
    seen += std::string(static_cast<const char*>(payload.data()), payload.size());
  }
  EXPECT_LT(seen.find("BlockStored"), seen.find("AllBlocksCleared"));
  EXPECT_EQ(seen.find("BlockRemoved"), std::string::npos);
  const auto st = (*p)->stats();
  EXPECT_EQ(st.events_dropped, 5u);
  EXPECT_EQ(st.clears_for_lost_removals, 1u);
}

// The encoder's byte forms, from the msgpack spec (github.com/msgpack/msgpack, spec.md): the
// short forms the Python subscriber test meets, and the longer ones it does not.
TEST(KvEvents, MsgpackWriterWritesTheSpecsFormats) {
  auto bytes = [](auto&& write) {
    events::MsgpackWriter w;
    write(w);
    std::string hex;
    for (unsigned char c : w.bytes().substr(0, 4)) {
      char b[3];
      std::snprintf(b, sizeof b, "%02x", c);
      hex += b;
    }
    return fmt::format("{}/{}", hex, w.bytes().size());
  };
  EXPECT_EQ(bytes([](auto& w) { w.str(std::string(31, 'a')); }), "bf616161/32");        // fixstr
  EXPECT_EQ(bytes([](auto& w) { w.str(std::string(40, 'a')); }), "d9286161/42");        // str 8
  EXPECT_EQ(bytes([](auto& w) { w.str(std::string(300, 'a')); }), "da012c61/303");      // str 16
  EXPECT_EQ(bytes([](auto& w) { w.str(std::string(70000, 'a')); }), "db000111/70005");  // str 32
  EXPECT_EQ(bytes([](auto& w) { w.bin(std::string(3, 'x')); }), "c4037878/5");          // bin 8
  EXPECT_EQ(bytes([](auto& w) { w.bin(std::string(300, 'x')); }), "c5012c78/303");      // bin 16
  EXPECT_EQ(bytes([](auto& w) { w.bin(std::string(70000, 'x')); }), "c6000111/70005");  // bin 32
  EXPECT_EQ(bytes([](auto& w) { w.integer(127); }), "7f/1");                             // positive fixint
  EXPECT_EQ(bytes([](auto& w) { w.integer(-32); }), "e0/1");                             // negative fixint
  EXPECT_EQ(bytes([](auto& w) { w.integer(128); }), "ce000000/5");                       // uint 32
  EXPECT_EQ(bytes([](auto& w) { w.integer(1LL << 40); }), "cf000001/9");                 // uint 64
  EXPECT_EQ(bytes([](auto& w) { w.integer(-33); }), "d3ffffff/9");                       // int 64
  EXPECT_EQ(bytes([](auto& w) { w.float64(1.0); }), "cb3ff000/9");                       // float 64
  EXPECT_EQ(bytes([](auto& w) { w.nil(); }), "c0/1");
  EXPECT_EQ(bytes([](auto& w) { w.array(15); }), "9f/1");                                // fixarray
  EXPECT_EQ(bytes([](auto& w) { w.array(16); }), "dc0010/3");                            // array 16
  EXPECT_EQ(bytes([](auto& w) { w.map(70000); }), "df000111/5");                         // map 32
}

// A TCP connection to 127.0.0.1:`port` that sends `bytes` (none: it only connects); -1 on failure.
int raw_connection(std::uint16_t port, const std::string& bytes) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0) {
    ::close(fd);
    return -1;
  }
  if (!bytes.empty()) (void)!::send(fd, bytes.data(), bytes.size(), MSG_NOSIGNAL);
  return fd;
}

// ZMTP 3.0 as a SUB peer speaks it up to READY (greeting with the NULL mechanism, READY naming the
// socket type): libzmq then keeps the connection, though it never subscribes or reads.
std::string zmtp_sub_handshake() {
  std::string hello(64, '\0');
  hello[0] = '\xff';
  hello[9] = '\x7f';
  hello[10] = 3;
  hello.replace(12, 4, "NULL");
  const std::string property = std::string("\x0bSocket-Type") + std::string("\0\0\0", 3) + '\x03' + "SUB";
  const std::string ready = std::string("\x05READY") + property;
  return hello + std::string("\x04") + static_cast<char>(ready.size()) + ready;
}

// Trust round 4: the events listener kept its 16 connections and shut the newest down, so 16 idle
// SUB sockets of another user (or 40 raw connections greeting a byte every 0.2 s) kept a router out:
// 0 of 40 batches reached it. Now the oldest goes and an unfinished handshake is dropped after 2 s:
// behind 4 idle holders and 4 slow greeters, on a cap of 4, a router that connects gets events.
TEST(KvEvents, IdleOrUnauthenticatedHoldersNeverKeepARouterOut) {
  test::Watchdog dog(60);
  const std::uint16_t port = test::free_tcp_port();
  events::KvEventsOptions o;
  o.endpoint = fmt::format("tcp://*:{}", port);  // bound (tcp://host:port would connect out)
  o.medium = "DISK";
  o.max_subscribers = 4;
  auto p = events::KvEventPublisher::open(o);
  ASSERT_TRUE(p.ok()) << p.error().message;
  std::vector<int> held;
  for (int i = 0; i < 4; ++i) held.push_back(raw_connection(port, zmtp_sub_handshake()));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  for (int i = 0; i < 4; ++i) held.push_back(raw_connection(port, std::string(1, '\xff')));
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  zmq::context_t ctx;
  zmq::socket_t router(ctx, zmq::socket_type::sub);
  router.set(zmq::sockopt::subscribe, "");
  router.set(zmq::sockopt::rcvtimeo, 100);
  router.connect(fmt::format("tcp://127.0.0.1:{}", port));
  int received = 0;
  const auto end = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  for (int i = 0; received == 0 && std::chrono::steady_clock::now() < end; ++i) {
    (*p)->stored({fmt::format("k{}", i)});
    for (int fd : held) (void)!::send(fd, "\x00", 1, MSG_NOSIGNAL);  // the slow greeters' next byte (a shut one: EPIPE)
    zmq::message_t m;
    while (router.recv(m, zmq::recv_flags::none)) {
      ++received;
      if (!m.more()) break;
    }
  }
  EXPECT_GT(received, 0) << "the router got no batch past the holders";
  for (int fd : held)
    if (fd >= 0) ::close(fd);
}

}  // namespace
}  // namespace kvtd
