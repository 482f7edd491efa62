// kvtd-pd-bench: moves KV blocks from a "prefill" process to a "decode" process through kvtd's
// transport (transport/link.h: UCX active messages into granted blocks, each block checksummed at
// the source and checked at the destination), for scripts/pd_bench.sh, which runs it between two
// network namespaces beside ucx_perftest on the same link and message size.
//
//   kvtd-pd-bench decode --port P [--bytes N] [--block-kib K] [--rounds R]
//   kvtd-pd-bench prefill --connect HOST:PORT [--window W] [--layers L]
//
// The decode side listens on a TCP port for the bootstrap (worker addresses, the grant of each
// round, the "all verified" answer); the blocks themselves go over UCX. Every round the decode
// side grants fresh blocks (the whole --bytes, in --block-kib blocks), the prefill side sends them
// with at most --window in flight, the decode side answers once every block arrived and matched
// its checksum. With --layers the prefill side sends the blocks as that many layers, one after
// another, and the decode side times each layer from its first block's send (the two share one
// CLOCK_MONOTONIC: one machine) to its last block verified: the per-layer push latency.
// Prints FIGURE lines: GB/s (median of rounds), CPU seconds per GB on each side, latency p50/p99.
#include <CLI/CLI.hpp>
#include <algorithm>
#include <arpa/inet.h>
#include <cstdio>
#include <cstring>
#include <ctime>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>
#include <vector>

#include "kvtd/transport/link.h"

namespace {

using kvtd::transport::Link;
using kvtd::transport::LinkEvent;

std::int64_t now_ns() {
  timespec ts{};
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<std::int64_t>(ts.tv_sec) * 1'000'000'000 + ts.tv_nsec;
}

double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec) / 1e6;
}

[[noreturn]] void die(const std::string& why) {
  std::fprintf(stderr, "kvtd-pd-bench: %s\n", why.c_str());
  std::exit(1);
}

// The bootstrap channel: length-prefixed messages over one TCP connection.
struct Channel {
  int fd = -1;
  void send_bytes(const void* p, std::size_t n) const {
    const auto* c = static_cast<const char*>(p);
    while (n > 0) {
      const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
      if (w <= 0) die("bootstrap send failed");
      c += w;
      n -= static_cast<std::size_t>(w);
    }
  }
  void recv_bytes(void* p, std::size_t n) const {
    auto* c = static_cast<char*>(p);
    while (n > 0) {
      const ssize_t r = ::recv(fd, c, n, 0);
      if (r <= 0) die("bootstrap peer closed");
      c += r;
      n -= static_cast<std::size_t>(r);
    }
  }
  template <typename T>
  void put(const T& v) const { send_bytes(&v, sizeof v); }
  template <typename T>
  T get() const {
    T v;
    recv_bytes(&v, sizeof v);
    return v;
  }
  void put_blob(std::span<const std::byte> b) const {
    put<std::uint32_t>(static_cast<std::uint32_t>(b.size()));
    send_bytes(b.data(), b.size());
  }
  std::vector<std::byte> get_blob() const {
    std::vector<std::byte> b(get<std::uint32_t>());
    recv_bytes(b.data(), b.size());
    return b;
  }
};

Channel listen_once(int port) {
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(static_cast<std::uint16_t>(port));
  a.sin_addr.s_addr = htonl(INADDR_ANY);
  if (::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) != 0 || ::listen(s, 1) != 0) die("cannot listen");
  const int c = ::accept(s, nullptr, nullptr);
  ::close(s);
  if (c < 0) die("accept failed");
  setsockopt(c, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  return Channel{c};
}

Channel connect_to(const std::string& target) {
  const auto colon = target.rfind(':');
  if (colon == std::string::npos) die("--connect takes HOST:PORT");
  addrinfo hints{}, *res = nullptr;
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  if (getaddrinfo(target.substr(0, colon).c_str(), target.substr(colon + 1).c_str(), &hints, &res) != 0)
    die("cannot resolve " + target);
  const int s = ::socket(AF_INET, SOCK_STREAM, 0);
  for (int i = 0; i < 200; ++i) {  // the decode side may not listen yet
    if (::connect(s, res->ai_addr, res->ai_addrlen) == 0) {
      freeaddrinfo(res);
      int one = 1;
      setsockopt(s, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      return Channel{s};
    }
    usleep(50'000);
  }
  die("cannot connect to " + target);
}

std::unique_ptr<Link> open_link(std::uint64_t zcopy_kib) {
  kvtd::transport::LinkOptions o;
  o.rndv_bytes = zcopy_kib * 1024;
  auto link = Link::open(o);
  if (!link.ok()) die(link.error().message);
  return std::move(link).value();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<std::size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

int decode(int port, std::uint64_t bytes, std::uint64_t block, int rounds, int layers, std::uint64_t zcopy_kib) {
  auto link = open_link(zcopy_kib);
  std::fprintf(stderr, "decode: %s\n", link->memory_path().c_str());
  const Channel ch = listen_once(port);
  ch.put_blob(link->address());  // the prefill side connects its endpoint to this worker
  const std::uint64_t count = bytes / block;
  std::vector<std::byte> pool(count * block);
  ch.put(count);
  ch.put(block);
  ch.put(static_cast<std::uint32_t>(rounds));
  std::vector<LinkEvent> ev;
  for (int r = 0; r < rounds; ++r) {
    const std::uint64_t grant = 0x5eed0000ULL + static_cast<std::uint64_t>(r) + 1;
    std::vector<std::span<std::byte>> blocks;
    for (std::uint64_t i = 0; i < count; ++i) blocks.emplace_back(pool.data() + i * block, block);
    if (auto s = link->grant(grant, std::move(blocks), now_ns() + 600'000'000'000); !s.ok()) die(s.error().message);
    ch.put(grant);
    const double cpu0 = cpu_seconds();
    std::vector<std::int64_t> layer_done(static_cast<std::size_t>(std::max(layers, 1)), 0);
    const std::uint64_t per_layer = layers > 0 ? count / static_cast<std::uint64_t>(layers) : count;
    std::vector<std::uint64_t> layer_left(layer_done.size(), per_layer);
    std::uint64_t failed = 0;
    while (link->received(grant) + failed < count) {
      ev.clear();
      link->progress(ev);
      for (const auto& e : ev) {
        if (e.kind == LinkEvent::Kind::kReceived && layers > 0) {
          const auto l = std::min<std::size_t>(e.index / per_layer, layer_left.size() - 1);
          if (--layer_left[l] == 0) layer_done[l] = now_ns();
        } else if (e.kind != LinkEvent::Kind::kReceived) {
          ++failed;
          std::fprintf(stderr, "decode: %s\n", e.message.c_str());
        }
      }
    }
    ch.put(link->received(grant));
    ch.put(cpu_seconds() - cpu0);
    for (auto t : layer_done) ch.put(t);
    if (auto s = link->revoke(grant); !s.ok()) die(s.error().message);
  }
  return 0;
}

int prefill(const std::string& target, int window, int layers, std::uint64_t zcopy_kib, std::int64_t interval_ns) {
  auto link = open_link(zcopy_kib);
  std::fprintf(stderr, "prefill: %s\n", link->memory_path().c_str());
  const Channel ch = connect_to(target);
  auto peer = link->connect(ch.get_blob());
  if (!peer.ok()) die(peer.error().message);
  const auto count = ch.get<std::uint64_t>();
  const auto block = ch.get<std::uint64_t>();
  const auto rounds = ch.get<std::uint32_t>();
  std::vector<std::byte> src(count * block);
  for (std::uint64_t i = 0; i < src.size(); i += 4096) src[i] = static_cast<std::byte>(i >> 12);  // blocks differ
  std::vector<double> gbps, cpu_prefill, cpu_decode, latency_us;
  std::vector<LinkEvent> ev;
  const std::uint64_t per_layer = layers > 0 ? count / static_cast<std::uint64_t>(layers) : count;
  if (window == 0) window = static_cast<int>(std::max<std::uint64_t>(16, (8ULL << 20) / block));
  for (std::uint32_t r = 0; r < rounds; ++r) {
    const auto grant = ch.get<std::uint64_t>();
    std::vector<std::int64_t> layer_start(static_cast<std::size_t>(std::max(layers, 1)), 0);
    const double cpu0 = cpu_seconds();
    const std::int64_t t0 = now_ns();
    std::uint64_t next = 0, done = 0;
    while (done < count) {
      while (next < count && link->sends_in_flight() < static_cast<std::size_t>(window)) {
        if (layers > 0 && next % per_layer == 0 && next / per_layer < layer_start.size()) {
          // The layer's KV exists once the model computed it: every interval from the start.
          const auto l = next / per_layer;
          if (now_ns() < t0 + static_cast<std::int64_t>(l) * interval_ns) break;
          layer_start[l] = now_ns();
        }
        auto s = link->send_block(*peer, grant, static_cast<std::uint32_t>(next),
                                  std::span<const std::byte>(src.data() + next * block, block));
        if (!s.ok()) die(s.error().message);
        ++next;
      }
      ev.clear();
      link->progress(ev);
      for (const auto& e : ev) {
        if (e.kind == LinkEvent::Kind::kSent) ++done;
        else die("prefill: " + e.message);
      }
    }
    const auto verified = ch.get<std::uint64_t>();
    const std::int64_t t1 = now_ns();
    cpu_decode.push_back(ch.get<double>());
    cpu_prefill.push_back(cpu_seconds() - cpu0);
    for (std::size_t l = 0; l < layer_start.size(); ++l) {
      const auto end = ch.get<std::int64_t>();
      if (layers > 0) latency_us.push_back(static_cast<double>(end - layer_start[l]) / 1e3);
    }
    if (verified != count) die("decode verified " + std::to_string(verified) + " of " + std::to_string(count));
    gbps.push_back(static_cast<double>(count * block) / static_cast<double>(t1 - t0));
  }
  const double gb = static_cast<double>(count * block) / 1e9;
  std::printf("FIGURE pd transfer: %.3f GB/s median of %u rounds, %llu blocks of %llu KiB (%.2f GiB), window %d, "
              "every block checksummed and verified\n",
              percentile(gbps, 0.5), rounds, static_cast<unsigned long long>(count),
              static_cast<unsigned long long>(block >> 10), static_cast<double>(count * block) / (1 << 30), window);
  std::printf("FIGURE pd cpu: prefill %.3f s/GB, decode %.3f s/GB (median)\n", percentile(cpu_prefill, 0.5) / gb,
              percentile(cpu_decode, 0.5) / gb);
  if (layers > 0)
    std::printf("FIGURE pd per-layer push latency: p50 %.1f us, p99 %.1f us (%d layers x %llu blocks of %llu KiB, "
                "%u rounds)\n",
                percentile(latency_us, 0.5), percentile(latency_us, 0.99), layers,
                static_cast<unsigned long long>(per_layer), static_cast<unsigned long long>(block >> 10), rounds);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"kvtd-pd-bench: KV blocks from a prefill process to a decode process over kvtd's UCX transport"};
  app.require_subcommand(1);
  int port = 18515, rounds = 3, window = 0, layers = 0;
  std::int64_t interval_us = 0;
  std::uint64_t bytes = 1ULL << 30, block_kib = 256, zcopy_kib = 64;
  std::string target;
  auto* dec = app.add_subcommand("decode", "grant blocks, receive and verify them");
  dec->add_option("--port", port, "bootstrap TCP port")->capture_default_str();
  dec->add_option("--bytes", bytes, "bytes per round")->capture_default_str();
  dec->add_option("--block-kib", block_kib, "block size in KiB")->capture_default_str();
  dec->add_option("--rounds", rounds)->capture_default_str()->check(CLI::PositiveNumber);
  dec->add_option("--layers", layers, "time per layer (the prefill side's --layers)")->capture_default_str();
  auto* pre = app.add_subcommand("prefill", "send blocks into the decode side's grants");
  pre->add_option("--connect", target, "the decode side's HOST:PORT")->required();
  pre->add_option("--window", window, "sends in flight (default: 8 MiB of blocks, at least 16)")
      ->check(CLI::PositiveNumber);
  pre->add_option("--layers", layers, "send as this many layers, timed")->capture_default_str();
  pre->add_option("--layer-interval-us", interval_us, "a layer's KV exists this long after the previous one's "
                  "(the model's compute per layer)")->capture_default_str();
  app.add_option("--zcopy-kib", zcopy_kib, "blocks of at least this many KiB go zero-copy (UCX rendezvous), "
                 "smaller ones by copy")->capture_default_str();
  CLI11_PARSE(app, argc, argv);
  if (dec->parsed()) {
    if (block_kib == 0 || bytes < block_kib * 1024) die("--bytes must hold at least one --block-kib block");
    return decode(port, bytes, block_kib * 1024, rounds, layers, zcopy_kib);
  }
  return prefill(target, window, layers, zcopy_kib, interval_us * 1000);
}
