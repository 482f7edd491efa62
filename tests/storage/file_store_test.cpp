#include "kvtd/storage/file_store.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <chrono>

#include <mutex>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include "file_store_fixture.h"
#include "kvtd/storage/object_format.h"

namespace kvtd::storage {
namespace {

TEST_F(FileStoreTest, BatchRoundTripAndLeadingExists) {
  auto s = open(options());
  std::vector<std::string> keys;
  std::vector<std::vector<std::byte>> data;
  std::vector<const std::byte*> srcs;
  for (std::uint32_t i = 0; i < 16; ++i) {
    keys.push_back(fmt::format("blk{}", i));
    data.push_back(object(i));
  }
  for (auto& d : data) srcs.push_back(d.data());
  auto put = write_from(*s, keys, srcs, kObject);
  ASSERT_TRUE(put.ok());
  for (auto r : *put) EXPECT_EQ(r, ObjectResult::kOk);
  std::vector<std::vector<std::byte>> back(16, std::vector<std::byte>(kObject));
  std::vector<std::byte*> dsts;
  for (auto& b : back) dsts.push_back(b.data());
  auto got = read_to(*s, keys, dsts, kObject);
  ASSERT_TRUE(got.ok());
  for (std::size_t i = 0; i < 16; ++i) {
    EXPECT_EQ((*got)[i], ObjectResult::kOk);
    EXPECT_EQ(back[i], data[i]) << i;
  }
  EXPECT_EQ(*s->exists(keys), 16u);
  const std::string gone[1] = {"blk5"};
  ASSERT_TRUE(s->remove(gone).ok());
  EXPECT_EQ(*s->exists(keys), 5u) << "leading count stops at the first hole";
  std::vector<std::byte> tmp;
  EXPECT_EQ(get_one(*s, "blk5", &tmp), ObjectResult::kMissing);
  const std::string bad[1] = {"../etc"};
  EXPECT_FALSE(s->exists(bad).ok());
}

// Found by the daemon's storage tests: after the store's directories were removed under it, every
// later put failed with ENOENT until the daemon restarted.
TEST_F(FileStoreTest, DirectoriesRemovedUnderTheStoreAreMadeAgainOnPut) {
  auto s = open(options());
  put_one(*s, "before", object(1));
  fs::remove_all(root_);
  put_one(*s, "after", object(2));
  std::vector<std::byte> back;
  EXPECT_EQ(get_one(*s, "after", &back), ObjectResult::kOk);
  EXPECT_EQ(back, object(2));
  EXPECT_EQ(get_one(*s, "before", &back), ObjectResult::kMissing);
}

// An object written from scattered parts is the object of their concatenation: same bytes on
// disk, same checksum, read back whole.
TEST_F(FileStoreTest, ObjectFromPartsEqualsObjectFromOneBuffer) {
  auto s = open(options());
  ASSERT_TRUE(s->capabilities().writes_pieces);
  const auto whole = object(7);
  put_one(*s, "one", whole);
  ConstPieces parts;
  for (std::size_t off = 0; off < kObject; off += kObject / 8) parts.emplace_back(whole.data() + off, kObject / 8);
  const std::string keys[2] = {"parts", "short"};
  WriteFrom from;
  from.pieces = [&](std::size_t i) -> std::optional<ConstPieces> {
    return i == 0 ? parts : ConstPieces(parts.begin(), parts.end() - 1);
  };
  auto r = s->write(keys, from);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ((*r)[0], ObjectResult::kOk) << (*r)[0].error;
  std::vector<std::byte> back;
  ASSERT_EQ(get_one(*s, "parts", &back), ObjectResult::kOk);
  EXPECT_EQ(back, whole);
  // Parts that do not add up to one object fail that key, saying so, and nothing is written.
  EXPECT_EQ((*r)[1], ObjectResult::kFailed);
  EXPECT_NE((*r)[1].error.find("pieces hold"), std::string::npos) << (*r)[1].error;
  EXPECT_EQ(get_one(*s, "short", &back), ObjectResult::kMissing);
}

TEST_F(FileStoreTest, CorruptAndTruncatedObjectsAreCountedMisses) {
  auto s = open(options());
  put_one(*s, "a", object(1));
  put_one(*s, "b", object(2));
  auto files = object_files();
  ASSERT_EQ(files.size(), 2u);
  for (const auto& f : files) {
    if (f.find("/a.kvo") != std::string::npos) {  // flip one payload byte
      std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(100);
      char c = 0;
      io.seekg(100);
      io.read(&c, 1);
      c = static_cast<char>(c ^ 0x40);
      io.seekp(100);
      io.write(&c, 1);
    } else {
      fs::resize_file(f, sizeof(ObjectHeader) + kObject / 2);
    }
  }
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "a", &out), ObjectResult::kCorrupt);
  EXPECT_EQ(get_one(*s, "b", &out), ObjectResult::kCorrupt);
  EXPECT_EQ(s->stats().corrupt, 2u);
  EXPECT_EQ(s->stats().hits, 0u);
}

// A FIFO planted where an object belongs hung the load past its deadline (open(2)
// of a FIFO waits for a writer). It is no object: a corrupt miss, answered at once; a device
// (endless bytes) likewise.
TEST_F(FileStoreTest, AFifoOrADeviceWhereAnObjectBelongsIsACorruptMissAtOnce) {
  auto s = open(options());
  put_one(*s, "f", object(4));
  put_one(*s, "d", object(5));
  for (const auto& f : object_files()) {
    fs::remove(f);
    if (f.find("/f.kvo") != std::string::npos) ASSERT_EQ(::mkfifo(f.c_str(), 0600), 0);
    else fs::create_symlink("/dev/zero", f);
  }
  std::vector<std::byte> out;
  const auto t0 = std::chrono::steady_clock::now();
  EXPECT_EQ(get_one(*s, "f", &out), ObjectResult::kCorrupt);
  EXPECT_EQ(get_one(*s, "d", &out), ObjectResult::kCorrupt);
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  EXPECT_EQ(s->stats().hits, 0u);
}

// Found by fuzz_object_header: a header with bits set in its reserved field was accepted.
TEST_F(FileStoreTest, ObjectWithReservedHeaderBitsIsCorrupt) {
  auto s = open(options());
  put_one(*s, "r", object(3));
  const auto files = object_files();
  ASSERT_EQ(files.size(), 1u);
  {
    std::fstream io(files[0], std::ios::in | std::ios::out | std::ios::binary);
    io.seekp(offsetof(ObjectHeader, reserved));
    const char bit = 4;
    io.write(&bit, 1);
  }
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "r", &out), ObjectResult::kCorrupt);
}

// get used to read straight into the caller's buffer and verify afterwards: a corrupt object
// clobbered bytes the caller still held. And an object with trailing bytes was accepted.
TEST_F(FileStoreTest, CorruptObjectLeavesTheCallersBufferUntouchedAndTrailingBytesAreCorrupt) {
  auto s = open(options());
  put_one(*s, "a", object(1));
  put_one(*s, "b", object(2));
  for (const auto& f : object_files()) {
    if (f.find("/a.kvo") != std::string::npos) {
      std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(static_cast<std::streamoff>(sizeof(ObjectHeader) + 7));
      io.put('\x5a');
    } else {
      std::ofstream(f, std::ios::app | std::ios::binary) << "extra";
    }
  }
  const std::vector<std::byte> mine(kObject, std::byte{0x77});
  for (const char* key : {"a", "b"}) {
    std::vector<std::byte> out = mine;
    const std::string keys[1] = {key};
    std::byte* dsts[1] = {out.data()};
    auto r = read_to(*s, keys, dsts, kObject);
    ASSERT_TRUE(r.ok());
    EXPECT_EQ((*r)[0], ObjectResult::kCorrupt) << key;
    EXPECT_EQ(out, mine) << "the caller's buffer changed on a failed get of " << key;
  }
}

// A load read each object into the store's own buffer, verified it there, and copied it again
// into the destination. A read that allows unverified bytes goes straight into the destination's
// pieces (here three, as a layer-first block's tensors are) and verifies there; a corrupt,
// truncated or foreign object is kCorrupt (its pieces are the caller's to ignore).
TEST_F(FileStoreTest, AReadInPlaceLandsInTheDestinationsPiecesAndVerifiesThere) {
  auto s = open(options());
  ASSERT_TRUE(s->capabilities().reads_in_place);
  const auto a = object(3);
  put_one(*s, "a", a);
  put_one(*s, "b", object(4));
  std::vector<std::byte> first(kObject / 4), second(kObject / 2), third(kObject - kObject / 4 - kObject / 2);
  const std::string keys[2] = {"a", "b"};
  std::vector<std::size_t> verified;
  std::mutex mu;
  ReadInto into;
  into.unverified_bytes_ok = true;
  into.pieces = [&](std::size_t) { return Pieces{first, second, third}; };
  into.on_verified = [&](std::size_t i) {
    std::lock_guard<std::mutex> g(mu);
    verified.push_back(i);
  };
  auto r = s->read(std::span(keys, 1), into);
  ASSERT_TRUE(r.ok()) << r.error().message;
  EXPECT_EQ((*r)[0], ObjectResult::kOk);
  EXPECT_EQ(verified, std::vector<std::size_t>{0});
  std::vector<std::byte> joined(first);
  joined.insert(joined.end(), second.begin(), second.end());
  joined.insert(joined.end(), third.begin(), third.end());
  EXPECT_EQ(joined, a) << "the pieces hold the object in order";
  // A flipped byte in the second piece's range is caught by the streaming checksum.
  for (const auto& f : object_files())
    if (f.find("/b.kvo") != std::string::npos) {
      std::fstream io(f, std::ios::in | std::ios::out | std::ios::binary);
      io.seekp(static_cast<std::streamoff>(sizeof(ObjectHeader) + kObject / 2));
      io.put('\x5a');
    }
  into.on_verified = {};
  auto bad = s->read(std::span(keys + 1, 1), into);
  ASSERT_TRUE(bad.ok());
  EXPECT_EQ((*bad)[0], ObjectResult::kCorrupt);
  // Pieces that add up to less than the object fail that key, naming the mismatch.
  std::vector<std::byte> short_piece(kObject - 1);
  into.pieces = [&](std::size_t) { return Pieces{short_piece}; };
  auto mismatch = s->read(std::span(keys, 1), into);
  ASSERT_TRUE(mismatch.ok());
  EXPECT_EQ((*mismatch)[0], ObjectResult::kFailed);
  EXPECT_NE((*mismatch)[0].error.find("pieces hold"), std::string::npos) << (*mismatch)[0].error;
}

// A put whose key is the least recently used object while another put evicts: the eviction must
// never delete the object the first put just renamed in (it is the newest, not the oldest).
TEST_F(FileStoreTest, EvictionNeverDeletesAnObjectAConcurrentPutJustWrote) {
  auto s = open(options(4 * (kObject + sizeof(ObjectHeader))));
  for (int round = 0; round < 200; ++round) {
    const std::string hot = fmt::format("hot{}", round % 3);
    std::thread a([&] { put_one(*s, hot, object(static_cast<std::uint32_t>(round))); });
    std::thread b([&] {
      for (int i = 0; i < 3; ++i) put_one(*s, fmt::format("cold{}_{}", round, i), object(9));
    });
    a.join();
    b.join();
    std::vector<std::byte> out;
    // The hot key was written last by thread a or is still among the 4 most recent objects
    // unless three newer cold ones displaced it; either way a present index entry must be readable.
    const auto r = get_one(*s, hot, &out);
    EXPECT_NE(r, ObjectResult::kCorrupt);
    if (r == ObjectResult::kOk) {
      EXPECT_EQ(out, object(static_cast<std::uint32_t>(round)));
    }
  }
  // Index and disk agree: every object the store counts exists.
  EXPECT_EQ(object_files().size() * (kObject + sizeof(ObjectHeader)), s->stats().bytes_stored);
}

TEST_F(FileStoreTest, AnotherNamespaceNeverReadsTheBytes) {
  auto llama = open(options(0, nullptr, "llama", 1));
  put_one(*llama, "k", object(9));
  auto other_layout = open(options(0, nullptr, "llama", 2));
  auto other_model = open(options(0, nullptr, "qwen", 1));
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*other_layout, "k", &out), ObjectResult::kMissing);
  EXPECT_EQ(get_one(*other_model, "k", &out), ObjectResult::kMissing);
  // Even a file copied into the other namespace is refused: its header names the first one.
  for (const auto& f : object_files()) {
    const auto target = fs::path(f.substr(0, f.find("/llama/")) + "/qwen/" + f.substr(f.find("/llama/") + 7));
    fs::create_directories(target.parent_path());
    fs::copy_file(f, target);
  }
  EXPECT_EQ(get_one(*other_model, "k", &out), ObjectResult::kCorrupt);
}

TEST_F(FileStoreTest, CapacityEvictsLeastRecentlyUsed) {
  const std::uint64_t per = sizeof(ObjectHeader) + kObject;
  auto s = open(options(3 * per));
  put_one(*s, "k0", object(0));
  put_one(*s, "k1", object(1));
  put_one(*s, "k2", object(2));
  std::vector<std::byte> out;
  ASSERT_EQ(get_one(*s, "k0", &out), ObjectResult::kOk);  // k0 is now more recent than k1
  put_one(*s, "k3", object(3));
  EXPECT_EQ(get_one(*s, "k1", &out), ObjectResult::kMissing);
  EXPECT_EQ(get_one(*s, "k0", &out), ObjectResult::kOk);
  EXPECT_EQ(get_one(*s, "k3", &out), ObjectResult::kOk);
  EXPECT_EQ(s->stats().evictions, 1u);
  EXPECT_LE(s->stats().bytes_stored, 3 * per);
  // A reopened store rebuilds its index from the directory and keeps the limit.
  s.reset();
  auto again = open(options(2 * per));
  EXPECT_EQ(object_files().size(), 2u);
  EXPECT_EQ(again->stats().evictions, 1u);
}

TEST_F(FileStoreTest, NoSpaceFailsThatPutAndKeepsTheOldObject) {
  FaultyFileSystem faulty;
  auto s = open(options(0, &faulty));
  const auto old = object(1);
  put_one(*s, "k", old);
  faulty.write_error = ENOSPC;
  const KeyResult replaced = put_one(*s, "k", object(2), ObjectResult::kFailed);
  put_one(*s, "new", object(3), ObjectResult::kFailed);
  faulty.write_error = 0;
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "k", &out), ObjectResult::kOk);
  EXPECT_EQ(out, old);
  EXPECT_EQ(get_one(*s, "new", &out), ObjectResult::kMissing);
  EXPECT_EQ(s->stats().put_failures, 2u);
  // The key's own cause comes back with its result.
  EXPECT_NE(replaced.error.find("No space left on device"), std::string::npos) << replaced.error;
  EXPECT_NE(replaced.error.find("/k.kvo"), std::string::npos) << replaced.error;
  for (const auto& f : object_files()) EXPECT_EQ(f.find(".tmp-"), std::string::npos) << "temporary left: " << f;
}

TEST_F(FileStoreTest, PermissionErrorOnRenameFailsCleanly) {
  FaultyFileSystem faulty;
  auto s = open(options(0, &faulty));
  faulty.rename_error = EACCES;
  put_one(*s, "k", object(1), ObjectResult::kFailed);
  faulty.rename_error = 0;
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "k", &out), ObjectResult::kMissing);
  EXPECT_TRUE(object_files().empty());
}

TEST_F(FileStoreTest, SyncPolicySyncsObjectsAndDirectories) {
  FaultyFileSystem counting;
  auto o = options(0, &counting);
  o.sync = SyncPolicy::kNone;
  put_one(*open(o), "a", object(1));
  EXPECT_EQ(counting.synced_files, 0);
  o.sync = SyncPolicy::kData;
  put_one(*open(o), "b", object(2));
  EXPECT_EQ(counting.synced_files, 1);
  EXPECT_EQ(counting.synced_dirs, 0);
  o.sync = SyncPolicy::kFull;
  auto s = open(o);
  put_one(*s, "c", object(3));
  EXPECT_EQ(counting.synced_files, 2);
  EXPECT_EQ(counting.synced_dirs, 1);
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "c", &out), ObjectResult::kOk);
}

TEST_F(FileStoreTest, ConcurrentPutsOfOneKeyLeaveOneWholeObject) {
  auto s = open(options());
  std::vector<std::vector<std::byte>> versions;
  for (std::uint32_t i = 0; i < 4; ++i) versions.push_back(object(100 + i));
  std::vector<std::thread> threads;
  for (std::uint32_t t = 0; t < 4; ++t)
    threads.emplace_back([&, t] {
      for (int i = 0; i < 50; ++i) put_one(*s, "hot", versions[t]);
    });
  for (auto& th : threads) th.join();
  std::vector<std::byte> out;
  ASSERT_EQ(get_one(*s, "hot", &out), ObjectResult::kOk);
  EXPECT_NE(std::find(versions.begin(), versions.end(), out), versions.end());
  EXPECT_EQ(object_files().size(), 1u);
}

TEST_F(FileStoreTest, TemporaryFilesLeftByACrashAreRemovedAtOpen) {
  { auto s = open(options()); put_one(*s, "k", object(1)); }
  const auto f = object_files().at(0);
  const auto tmp = fs::path(f).parent_path() / ".tmp-k-999-1-1";
  std::ofstream(tmp) << "torn";
  auto s = open(options());
  EXPECT_FALSE(fs::exists(tmp));
  std::vector<std::byte> out;
  EXPECT_EQ(get_one(*s, "k", &out), ObjectResult::kOk);
}

}  // namespace
}  // namespace kvtd::storage

namespace kvtd::storage {
namespace {

// --storage-path was used whatever its owner and mode; another local user who
// could write it planted an object (the format is public) and STORAGE_READ loaded it. Now the root
// must be this user's alone (0700-like); a missing one is made 0700, and so is every directory below.
// The store checked its root (0700, its own) but not its parents: with
// FILE_BACKEND_STORAGE_DIR=<dir>/store where <dir> belongs to another user, that user renames the
// root away and puts a directory of their own there, holding an object that verifies, and the
// engine loads it. A parent that another user owns, or may write without the sticky bit, is
// refused naming it; a sticky one (like /tmp) is fine.
TEST_F(FileStoreTest, AStoreRootUnderADirectoryAnotherUserControlsIsRefused) {
  const std::string parent = root_ + "_parent";
  fs::remove_all(parent);
  ASSERT_TRUE(fs::create_directory(parent));
  auto o = options();
  o.root = parent + "/store";
  ASSERT_EQ(::chmod(parent.c_str(), 0755), 0);
  EXPECT_TRUE(open_file_store(o).ok());  // ours, not writable by others
  ASSERT_EQ(::chmod(parent.c_str(), 0777), 0);
  auto writable = open_file_store(o);
  ASSERT_FALSE(writable.ok());
  EXPECT_NE(writable.error().message.find(parent + " (above store root"), std::string::npos) << writable.error().message;
  EXPECT_NE(writable.error().message.find("0777"), std::string::npos) << writable.error().message;
  ASSERT_EQ(::chmod(parent.c_str(), 01777), 0);
  EXPECT_TRUE(open_file_store(o).ok()) << "a sticky directory lets no other user rename the root";
  if (::geteuid() == 0) {  // only root can give the directory away
    ASSERT_EQ(::chmod(parent.c_str(), 0755), 0);
    ASSERT_EQ(::chown(parent.c_str(), 65534, 65534), 0);
    auto foreign = open_file_store(o);
    ASSERT_FALSE(foreign.ok());
    EXPECT_NE(foreign.error().message.find("belongs to uid 65534"), std::string::npos) << foreign.error().message;
    // Through a symbolic link owned by us into that directory: the resolved path is checked too.
    const std::string link = root_ + "_via";
    fs::remove(link);
    fs::create_directory_symlink(parent, link);
    o.root = link + "/store";
    auto linked = open_file_store(o);
    fs::remove(link);
    ASSERT_FALSE(linked.ok());
    EXPECT_NE(linked.error().message.find("belongs to uid 65534"), std::string::npos) << linked.error().message;
    ASSERT_EQ(::chown(parent.c_str(), 0, 0), 0);
  }
  fs::remove_all(parent);
}

TEST_F(FileStoreTest, AStoreRootOthersCanReachOrAnotherUserOwnsIsRefusedNamingPathAndMode) {
  auto made = open_file_store(options());
  ASSERT_TRUE(made.ok()) << made.error().message;
  made.value().reset();
  struct stat st {};
  ASSERT_EQ(::stat(root_.c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0700u) << "a missing root is made private";
  for (auto& e : fs::recursive_directory_iterator(root_))
    if (e.is_directory()) {
      ASSERT_EQ(::stat(e.path().c_str(), &st), 0);
      EXPECT_EQ(st.st_mode & 0777, 0700u) << e.path() << ": stored keys are prompt-prefix hashes";
    }
  for (mode_t mode : {0777, 0770, 0750, 0705}) {
    ASSERT_EQ(::chmod(root_.c_str(), mode), 0);
    auto s = open_file_store(options());
    ASSERT_FALSE(s.ok()) << std::oct << mode;
    EXPECT_NE(s.error().message.find(root_), std::string::npos) << s.error().message;
    char text[8];
    std::snprintf(text, sizeof text, "%04o", static_cast<unsigned>(mode));
    EXPECT_NE(s.error().message.find(text), std::string::npos) << s.error().message;
  }
  ASSERT_EQ(::chmod(root_.c_str(), 0700), 0);
  const std::string link = root_ + "_link";
  fs::remove(link);
  fs::create_directory_symlink(root_, link);
  auto o = options();
  o.root = link;
  auto via_link = open_file_store(o);
  fs::remove(link);
  ASSERT_FALSE(via_link.ok());
  EXPECT_NE(via_link.error().message.find("symbolic link"), std::string::npos) << via_link.error().message;
  if (::geteuid() == 0) {  // only root can give the directory away
    ASSERT_EQ(::chown(root_.c_str(), 65534, 65534), 0);
    auto foreign = open_file_store(options());
    ASSERT_FALSE(foreign.ok());
    EXPECT_NE(foreign.error().message.find("owned by uid 65534"), std::string::npos) << foreign.error().message;
    ASSERT_EQ(::chown(root_.c_str(), 0, 0), 0);
  }
  EXPECT_TRUE(open_file_store(options()).ok());
}

// Opening a store removed every ".tmp-*" under the namespace, so a rank of
// another group restarting made a live writer's rename fail. Only a dead writer's temporaries
// (its pid in the name no longer runs) or ones older than any write takes are removed.
TEST_F(FileStoreTest, OpeningAStoreRemovesOnlyTemporariesOfWritersThatAreGone) {
  auto first = open(options());
  ASSERT_NE(first, nullptr);
  first.reset();
  std::string ns;
  for (auto& e : fs::directory_iterator(root_ + "/llama")) ns = e.path().string();  // <root>/<model>/<fingerprint>
  ASSERT_FALSE(ns.empty());
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  const std::string live_tmp = fmt::format("{}/00/.tmp-key-a-{}-77-1", ns, ::getpid());
  const std::string dead_tmp = fmt::format("{}/00/.tmp-key-b-{}-77-2", ns, dead);
  const std::string old_tmp = fmt::format("{}/00/.tmp-key-c-{}-77-3", ns, ::getpid());
  for (const auto& p : {live_tmp, dead_tmp, old_tmp}) std::ofstream(p) << "partial";
  const timespec hour_ago[2] = {{::time(nullptr) - 3600, 0}, {::time(nullptr) - 3600, 0}};
  ASSERT_EQ(::utimensat(AT_FDCWD, old_tmp.c_str(), hour_ago, 0), 0);
  auto second = open(options());
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(fs::exists(live_tmp)) << "a live writer's temporary was removed under it";
  EXPECT_FALSE(fs::exists(dead_tmp));
  EXPECT_FALSE(fs::exists(old_tmp));
}

// Trust round 4: a second deployment on the same store root, in another pid namespace (another
// container), removed the first one's in-flight temporaries at open: their writers' pids name
// nobody in its namespace (6 of about 210 writes failed storage_error). A writer names its pid
// namespace beside its pid; another namespace's fresh temporary is kept, this one's dead writer's
// removed. (The name a writer of this build gives its temporaries carries it: file_store_support.cpp.)
TEST_F(FileStoreTest, ATemporaryOfAWriterInAnotherPidNamespaceIsNotJudgedByItsPid) {
  auto first = open(options());
  ASSERT_NE(first, nullptr);
  first.reset();
  std::string ns;
  for (auto& e : fs::directory_iterator(root_ + "/llama")) ns = e.path().string();
  ASSERT_FALSE(ns.empty());
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  struct stat self {};
  ASSERT_EQ(::stat("/proc/self/ns/pid", &self), 0);
  const std::string here = std::to_string(self.st_ino), elsewhere = std::to_string(self.st_ino + 1);
  const std::string foreign = fmt::format("{}/00/.tmp-key-f-{}p{}-77-1", ns, dead, elsewhere);
  const std::string ours = fmt::format("{}/00/.tmp-key-g-{}p{}-77-2", ns, dead, here);
  for (const auto& p : {foreign, ours}) std::ofstream(p) << "partial";
  auto second = open(options());
  ASSERT_NE(second, nullptr);
  EXPECT_TRUE(fs::exists(foreign)) << "another pid namespace's writer's temporary was removed under it";
  EXPECT_FALSE(fs::exists(ours)) << "a dead writer of this namespace leaves garbage";
}

}  // namespace
}  // namespace kvtd::storage

#include <xxhash.h>

namespace kvtd::storage {
namespace {

// The checksum runs on the widest vector unit the CPU has (libxxhash's run-time dispatch); stored
// objects must stay readable by every build, so it must equal the baseline XXH3 bit for bit, for
// whole payloads and for payloads given in parts.
TEST(ObjectFormat, TheChecksumIsPlainXxh3WhicheverVectorUnitComputesIt) {
  std::mt19937 rng(7);
  std::vector<std::byte> data(3 << 20);
  for (auto& b : data) b = static_cast<std::byte>(rng());
  const StoreOptions so{"m", 1, 0};
  for (std::size_t n : {std::size_t{0}, std::size_t{1}, std::size_t{17}, std::size_t{240}, std::size_t{241},
                        std::size_t{4096}, std::size_t{1} << 20, data.size() - 3}) {
    EXPECT_EQ(hash_bytes(data.data(), n), XXH3_64bits(data.data(), n)) << n;
    const std::span<const std::byte> parts[3] = {std::span(data).first(n / 3), std::span(data).subspan(n / 3, n / 3),
                                                 std::span(data).subspan(2 * (n / 3), n - 2 * (n / 3))};
    EXPECT_EQ(make_header(so, "k", parts).checksum, XXH3_64bits(data.data(), n)) << n;
    PayloadHasher streamed;  // as a load hashes it: in the stretches each read filled
    for (std::size_t at = 0; at < n;) {
      const std::size_t stretch = std::min<std::size_t>(n - at, 1 + (at * 7919) % (128 << 10));
      streamed.update(std::span(data).subspan(at, stretch));
      at += stretch;
    }
    EXPECT_EQ(streamed.digest(), XXH3_64bits(data.data(), n)) << n;
    EXPECT_EQ(streamed.bytes(), n);
  }
}

// presence(): each key on its own, holes included (a group session's trailing rules need it).
TEST_F(FileStoreTest, PresenceAnswersEachKeyThroughHoles) {
  auto store = open(options());
  for (const char* k : {"a", "c", "d", "f"}) put_one(*store, k, object(1));
  const std::vector<std::string> keys{"a", "b", "c", "d", "e", "f"};
  auto here = presence(*store, keys);
  ASSERT_TRUE(here.ok()) << here.error().message;
  EXPECT_EQ(*here, (std::vector<bool>{true, false, true, true, false, true}));
  auto none = presence(*store, std::vector<std::string>{});
  ASSERT_TRUE(none.ok());
  EXPECT_TRUE(none->empty());
}

}  // namespace
}  // namespace kvtd::storage
