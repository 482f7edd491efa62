// The file system under the file store (kvtd/storage/file_system.h): a streamed read reports every
// byte it read, once, in file order, in stretches no longer than its chunk, whichever way the
// parts cut the file; a sealed write shows each payload stretch before writing it and writes the
// header as sealed after them. The interface's defaults (for file systems that only read and
// write whole) agree.
#include "kvtd/storage/file_system.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <iterator>
#include <fstream>
#include <random>
#include <string>
#include <vector>

#include "forwarding_file_system.h"

namespace kvtd::storage {
namespace {

namespace fs = std::filesystem;

// Reads and writes whole only: the streamed read and the sealed write are the interface's defaults.
class WholeReadsOnly final : public test::ForwardingFileSystem {
 public:
  int read_file_streamed(const std::string& p, std::span<const std::span<std::byte>> parts, std::size_t* n,
                         const Filled& on_filled) override {
    return FileSystem::read_file_streamed(p, parts, n, on_filled);
  }
  int write_file_sealed(const std::string& p, std::span<const std::span<const std::byte>> parts, bool sync,
                        const Writing& on_write, const std::function<void()>& seal) override {
    return FileSystem::write_file_sealed(p, parts, sync, on_write, seal);
  }
};

struct Stretch {
  std::size_t part;
  std::size_t offset;  // in its part
  std::size_t bytes;
};

class StreamedReadTest : public ::testing::Test {
 protected:
  std::string path_ = (fs::path(::testing::TempDir()) / fmt::format("kvtd_streamed_{}", ::getpid())).string();
  std::vector<std::byte> content_;

  void write_file(std::size_t bytes) {
    content_.resize(bytes);
    std::mt19937 rng(3);
    for (auto& b : content_) b = static_cast<std::byte>(rng());
    std::ofstream(path_, std::ios::binary).write(reinterpret_cast<const char*>(content_.data()),
                                                 static_cast<std::streamsize>(bytes));
  }
  void TearDown() override { fs::remove(path_); }

  // Reads into parts of `sizes` (zeroed first), checking each reported stretch against the part it
  // names and against the file, in order; returns the stretches.
  std::vector<Stretch> read(FileSystem& f, const std::vector<std::size_t>& sizes, std::size_t* read_bytes, int* err) {
    buffers_.assign(sizes.size(), {});
    std::vector<std::span<std::byte>> parts;
    for (std::size_t i = 0; i < sizes.size(); ++i) {
      buffers_[i].assign(sizes[i], std::byte{0});
      parts.emplace_back(buffers_[i]);
    }
    std::vector<Stretch> out;
    std::size_t file_offset = 0;
    *err = f.read_file_streamed(path_, parts, read_bytes, [&](std::size_t part, std::span<const std::byte> b) {
      ASSERT_LT(part, parts.size());
      ASSERT_GE(b.data(), parts[part].data());
      ASSERT_LE(b.data() + b.size(), parts[part].data() + parts[part].size());
      ASSERT_LE(file_offset + b.size(), content_.size());
      EXPECT_EQ(std::memcmp(b.data(), content_.data() + file_offset, b.size()), 0) << "at file offset " << file_offset;
      out.push_back({part, static_cast<std::size_t>(b.data() - parts[part].data()), b.size()});
      file_offset += b.size();
    });
    EXPECT_EQ(file_offset, *read_bytes) << "every byte read is reported, once";
    return out;
  }

  std::vector<std::vector<std::byte>> buffers_;
};

// Consecutive stretches of one part follow each other; the parts come in order; empty parts are
// never reported.
void expect_in_order(const std::vector<Stretch>& s, std::size_t max_stretch) {
  for (std::size_t i = 0; i < s.size(); ++i) {
    EXPECT_GT(s[i].bytes, 0u);
    EXPECT_LE(s[i].bytes, max_stretch);
    if (i == 0) continue;
    if (s[i].part == s[i - 1].part)
      EXPECT_EQ(s[i].offset, s[i - 1].offset + s[i - 1].bytes);
    else
      EXPECT_GT(s[i].part, s[i - 1].part);
  }
}

TEST_F(StreamedReadTest, EveryByteIsReportedOnceInFileOrderInBoundedStretches) {
  // 40-byte header, an empty part, parts larger and smaller than a 128 KiB chunk, a trailing byte.
  const std::vector<std::size_t> sizes{40, 0, 300 << 10, 17, 0, 129 << 10, 1};
  const std::size_t payload = 40 + (300 << 10) + 17 + (129 << 10);
  write_file(payload);  // the trailing byte finds end of file
  auto posix = make_posix_file_system();
  std::size_t n = 0;
  int err = -1;
  const auto streamed = read(*posix, sizes, &n, &err);
  EXPECT_EQ(err, 0);
  EXPECT_EQ(n, payload);
  expect_in_order(streamed, 128 << 10);
  EXPECT_GT(streamed.size(), 5u) << "the large parts come in several chunks";
  WholeReadsOnly whole;
  const auto by_default = read(whole, sizes, &n, &err);
  EXPECT_EQ(err, 0);
  EXPECT_EQ(n, payload);
  expect_in_order(by_default, SIZE_MAX);
  EXPECT_EQ(by_default.size(), 4u) << "one stretch per non-empty part filled (not the trailing byte)";
}

TEST_F(StreamedReadTest, ATruncatedFileReportsOnlyWhatWasRead) {
  write_file(100 << 10);
  const std::vector<std::size_t> sizes{40, 1 << 20, 1};
  auto posix = make_posix_file_system();
  WholeReadsOnly whole;
  for (FileSystem* f : {posix.get(), static_cast<FileSystem*>(&whole)}) {
    std::size_t n = 0;
    int err = -1;
    const auto s = read(*f, sizes, &n, &err);
    EXPECT_EQ(err, 0);
    EXPECT_EQ(n, 100u << 10);
    ASSERT_FALSE(s.empty());
    EXPECT_EQ(s.back().part, 1u) << "nothing reported for the part past the end";
  }
  std::size_t n = 0;
  int err = 0;
  fs::remove(path_);
  const auto none = read(*posix, sizes, &n, &err);
  EXPECT_EQ(err, ENOENT);
  EXPECT_TRUE(none.empty());
}

// Writes a 40-byte header and payload parts through write_file_sealed; the header is filled in by
// seal() from what on_write saw (its byte count and a sum), as the file store seals its checksum.
std::vector<std::byte> sealed_write(FileSystem& f, const std::string& path, const std::vector<std::vector<std::byte>>& payload,
                                    std::vector<std::size_t>* stretches) {
  std::byte header[40] = {};
  std::vector<std::span<const std::byte>> parts{std::span<const std::byte>(header)};
  for (const auto& p : payload) parts.emplace_back(p);
  std::uint64_t seen = 0, sum = 0;
  bool sealed = false;
  const int err = f.write_file_sealed(
      path, parts, false,
      [&](std::span<const std::byte> b) {
        EXPECT_FALSE(sealed) << "every stretch is shown before the seal";
        stretches->push_back(b.size());
        seen += b.size();
        for (auto x : b) sum = sum * 31 + static_cast<std::uint8_t>(x);
      },
      [&] {
        sealed = true;
        std::memcpy(header, &seen, 8);
        std::memcpy(header + 8, &sum, 8);
      });
  EXPECT_EQ(err, 0);
  EXPECT_TRUE(sealed);
  std::ifstream in(path, std::ios::binary);
  const std::vector<char> raw((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> file(raw.size());
  if (!raw.empty()) std::memcpy(file.data(), raw.data(), raw.size());
  return file;
}

TEST_F(StreamedReadTest, ASealedWriteShowsEveryPayloadStretchFirstAndWritesTheSealedHeader) {
  std::mt19937 rng(5);
  std::vector<std::vector<std::byte>> payload{std::vector<std::byte>(600 << 10), {}, std::vector<std::byte>(17),
                                              std::vector<std::byte>(256 << 10)};
  for (auto& p : payload)
    for (auto& b : p) b = static_cast<std::byte>(rng());
  auto posix = make_posix_file_system();
  WholeReadsOnly whole;
  std::vector<std::byte> files[2];
  std::vector<std::size_t> stretches[2];
  files[0] = sealed_write(*posix, path_, payload, &stretches[0]);
  files[1] = sealed_write(whole, path_ + ".default", payload, &stretches[1]);
  fs::remove(path_ + ".default");
  EXPECT_EQ(files[0], files[1]) << "the same object either way";
  const std::size_t payload_bytes = (600 << 10) + 17 + (256 << 10);
  ASSERT_EQ(files[0].size(), 40 + payload_bytes);
  std::uint64_t seen = 0;
  std::memcpy(&seen, files[0].data(), 8);
  EXPECT_EQ(seen, payload_bytes) << "the header as sealed";
  std::size_t at = 40;
  for (const auto& p : payload) {
    if (p.empty()) continue;  // no data() to compare (memcmp must not see a null pointer)
    EXPECT_EQ(std::memcmp(files[0].data() + at, p.data(), p.size()), 0);
    at += p.size();
  }
  for (std::size_t s : stretches[0]) EXPECT_LE(s, 256u << 10);
  EXPECT_EQ(stretches[0].size(), 3u + 1u + 1u) << "600 KiB in three writes, 17 bytes, 256 KiB";
  EXPECT_EQ(stretches[1].size(), 4u) << "the default shows each part whole, the empty one too";
}

}  // namespace
}  // namespace kvtd::storage
