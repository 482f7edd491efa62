// kvtd-storage-bench: put/get throughput of a storage backend for 1 MiB objects in batches of
// 32, next to a plain reference measured in the same run (file: sequential write and read of
// the same bytes in the same directory; redis: run redis-benchmark yourself, see bench.sh).
#include <fcntl.h>
#include <signal.h>
#include <unistd.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fmt/format.h>
#include <random>
#include <vector>

#include "kvtd/storage/file_store.h"
#include "kvtd/storage/redis_store.h"

namespace {

using Clock = std::chrono::steady_clock;
double since(Clock::time_point t) { return std::chrono::duration<double>(Clock::now() - t).count(); }

// Sequential write then read of `bytes` in object-sized chunks, cycling through the same
// buffers the store uses: the disk/page-cache ceiling for the same bytes.
void plain_file_io(const std::string& dir, std::uint64_t bytes, std::vector<std::vector<std::byte>>& bufs,
                   double* write_gbs, double* read_gbs) {
  const std::string path = dir + "/plain.bin";
  const std::size_t chunk = bufs[0].size();
  ::sync();  // start from clean page cache state, like the store's phases
  auto t0 = Clock::now();
  int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0600);
  std::size_t i = 0;
  for (std::uint64_t done = 0; done < bytes; done += chunk, i = (i + 1) % bufs.size())
    if (::write(fd, bufs[i].data(), chunk) < 0) break;
  ::close(fd);
  *write_gbs = static_cast<double>(bytes) / since(t0) / 1e9;
  t0 = Clock::now();
  fd = ::open(path.c_str(), O_RDONLY);
  i = 0;
  for (std::uint64_t done = 0; done < bytes; done += chunk, i = (i + 1) % bufs.size())
    if (::read(fd, bufs[i].data(), chunk) <= 0) break;
  ::close(fd);
  *read_gbs = static_cast<double>(bytes) / since(t0) / 1e9;
  std::filesystem::remove(path);
}

}  // namespace

// The store the flags name, fresh (a file store's directory is emptied first); null after printing why.
std::unique_ptr<kvtd::storage::ObjectStore> open_store(const std::string& backend, const std::string& dir,
                                                      const std::string& endpoint, unsigned io_threads,
                                                      std::uint64_t object) {
  kvtd::storage::StoreOptions so{"bench", 0x42, object};
  std::unique_ptr<kvtd::storage::ObjectStore> store;
  if (backend == "file") {
    std::filesystem::remove_all(dir);
    kvtd::storage::FileStoreOptions fo;
    fo.store = so;
    fo.root = dir;
    fo.io_threads = io_threads;
    auto s = kvtd::storage::open_file_store(fo);
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.error().message.c_str()), nullptr;
    store = std::move(s).value();
  } else {
    kvtd::storage::RedisStoreOptions ro;
    ro.store = so;
    ro.endpoints = {endpoint};
    ro.timeout_ms = 10000;
    auto s = kvtd::storage::open_redis_store(ro);
    if (!s.ok()) return std::fprintf(stderr, "%s\n", s.error().message.c_str()), nullptr;
    store = std::move(s).value();
  }
  return store;
}

int main(int argc, char** argv) {
  CLI::App app{"kvtd-storage-bench - storage backend throughput, 1 MiB objects in batches of 32"};
  std::string backend = "file", dir = "/tmp/kvtd-storage-bench", endpoint = "127.0.0.1:6379";
  int batches = 16, batch = 32;
  unsigned io_threads = 2;
  int rounds = 5;
  std::uint64_t object = 1 << 20;
  app.add_option("--backend", backend, "file | redis")->check(CLI::IsMember({"file", "redis"}));
  app.add_option("--dir", dir, "file: directory");
  app.add_option("--endpoint", endpoint, "redis: host:port");
  app.add_option("--batches", batches, "Batches per direction");
  app.add_option("--batch", batch, "Objects per batch");
  app.add_option("--object-bytes", object, "Bytes per object");
  app.add_option("--io-threads", io_threads, "file: threads per batch");
  app.add_option("--rounds", rounds, "Measured rounds (median reported)");
  CLI11_PARSE(app, argc, argv);
  signal(SIGPIPE, SIG_IGN);  // hiredis writes to sockets with write(2)

  auto store = open_store(backend, dir, endpoint, io_threads, object);
  if (!store) return 1;
  std::vector<std::vector<std::byte>> buf(static_cast<std::size_t>(batch), std::vector<std::byte>(object));
  std::mt19937 rng(1);
  for (auto& b : buf)
    for (auto& x : b) x = static_cast<std::byte>(rng());
  std::vector<const std::byte*> srcs;
  std::vector<std::byte*> dsts;
  for (auto& b : buf) {
    srcs.push_back(b.data());
    dsts.push_back(b.data());
  }
  // Rounds alternate the store and the plain reference so both see the same machine state;
  // medians are reported. Each round uses fresh keys and is removed afterwards (untimed).
  const double total = static_cast<double>(object) * batch * batches;
  std::vector<double> put_gbs, get_gbs, write_gbs, read_gbs;
  for (int round = 0; round < rounds; ++round) {
    std::vector<std::vector<std::string>> keys(static_cast<std::size_t>(batches));
    for (int i = 0; i < batches; ++i)
      for (int j = 0; j < batch; ++j)
        keys[static_cast<std::size_t>(i)].push_back(fmt::format("r{}b{}_{}", round, i, j));
    ::sync();  // every timed phase starts with no dirty pages left by the previous one
    auto t0 = Clock::now();
    for (auto& k : keys) {
      auto r = kvtd::storage::write_from(*store, k, srcs, object);
      if (!r.ok() || (*r)[0] != kvtd::storage::ObjectResult::kOk) return std::fprintf(stderr, "put failed\n"), 1;
    }
    put_gbs.push_back(total / since(t0) / 1e9);
    t0 = Clock::now();
    for (auto& k : keys) {
      auto r = kvtd::storage::read_to(*store, k, dsts, object);
      if (!r.ok() || (*r)[0] != kvtd::storage::ObjectResult::kOk) return std::fprintf(stderr, "get failed\n"), 1;
    }
    get_gbs.push_back(total / since(t0) / 1e9);
    for (auto& k : keys) (void)store->remove(k);
    if (backend == "file") {
      double w = 0, r = 0;
      plain_file_io(dir, static_cast<std::uint64_t>(total), buf, &w, &r);
      write_gbs.push_back(w);
      read_gbs.push_back(r);
    }
  }
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  std::printf("%s store: put %.2f GB/s, get %.2f GB/s (median of %d rounds; %d batches x %d objects x %llu bytes)\n",
              backend.c_str(), median(put_gbs), median(get_gbs), rounds, batches, batch,
              static_cast<unsigned long long>(object));
  if (backend == "file") {
    std::printf("plain sequential file I/O, same bytes, same directory: write %.2f GB/s, read %.2f GB/s; "
                "ratio put %.2f, get %.2f\n",
                median(write_gbs), median(read_gbs), median(put_gbs) / median(write_gbs),
                median(get_gbs) / median(read_gbs));
    std::filesystem::remove_all(dir);
  }
  return 0;
}
