// FastDeploy's version.yaml as kvtd reads it: every case of
// tests/data/version_yaml_cases.json, whose answers tests/python/test_fastdeploy_version_yaml.py
// checks against FastDeploy's own reader (PyYAML), so both readers agree; and files that are not
// small regular files are refused at once instead of hanging start-up; the same for the config file.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include "kvtd/config/daemon_config.h"
#include "kvtd/config/version_yaml.h"
#include "kvtd/proto/names.h"

namespace kvtd::config {
namespace {

namespace fs = std::filesystem;

TEST(VersionYaml, EveryCaseReadsAsFastDeploysReaderReadsIt) {
  std::ifstream in(std::string(KVTD_SOURCE_DIR) + "/tests/data/version_yaml_cases.json");
  ASSERT_TRUE(in.good());
  const auto cases = nlohmann::json::parse(in)["cases"];
  ASSERT_GE(cases.size(), 10u);
  for (const auto& c : cases) {
    const std::string name = c["name"].get<std::string>();
    const auto version = version_from_yaml(c["text"].get<std::string>());
    if (c["prefix"].is_null()) {
      EXPECT_FALSE(version.ok()) << name << ": FastDeploy's reader fails here, kvtd read '"
                                 << (version.ok() ? *version : "") << "'";
      if (!version.ok()) {
        EXPECT_FALSE(version.error().message.empty()) << name;
      }
    } else {
      ASSERT_TRUE(version.ok()) << name << ": " << version.error().message;
      EXPECT_EQ(key_prefix_of_version(*version), c["prefix"].get<std::string>()) << name;
    }
  }
}

TEST(VersionYaml, WhatItCannotReadIsRefusedNamingTheLine) {
  for (const char* text : {"version: &a RL-STEP1-x\n", "version: !!str RL-1\n", "version: |\n  RL-STEP1-x\n",
                           "version:\n  RL-STEP1-x\n", "  version: RL-STEP1-x\n", "version: 'RL-STEP1\n",
                           "{version: RL-STEP1-x\n", "---\nversion: a\n---\nversion: b\n",
                           // PyYAML folds the next line into the version: refused, never cut short
                           "version: RL-STEP1-x\n  more\n"}) {
    const auto v = version_from_yaml(text);
    EXPECT_FALSE(v.ok()) << text << " read as '" << (v.ok() ? *v : "") << "'";
  }
}

// A FIFO or a device as version.yaml hung start-up (a read that never ends, or never stops);
// a huge file was read whole. Each is refused at once, naming the file.
TEST(VersionYaml, AFifoADeviceOrAHugeFileIsRefusedAtOnce) {
  const fs::path dir = fs::path(::testing::TempDir()) / fmt::format("version_yaml_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string file = (dir / "version.yaml").string();
  auto refused_quickly = [&](const std::string& says) {
    const auto t0 = std::chrono::steady_clock::now();
    const auto r = fastdeploy_key_prefix(dir.string());
    EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
    ASSERT_FALSE(r.ok());
    EXPECT_NE(r.error().message.find(file), std::string::npos) << r.error().message;
    EXPECT_NE(r.error().message.find(says), std::string::npos) << r.error().message;
  };
  ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
  refused_quickly("not a regular file");
  fs::remove(file);
  fs::create_symlink("/dev/zero", file);
  refused_quickly("not a regular file");
  fs::remove(file);
  std::ofstream(file) << "version: RL-STEP1-x\n" << std::string(100 * 1024, '#') << "\n";
  refused_quickly("at most");
  fs::remove(file);
  std::ofstream(file) << "\xEF\xBB\xBFversion: RL-STEP12-20240101-x  # by the trainer\n";
  const auto ok = fastdeploy_key_prefix(dir.string());
  ASSERT_TRUE(ok.ok()) << ok.error().message;
  EXPECT_EQ(*ok, "RL-STEP12");
  fs::remove(file);
  const auto none = fastdeploy_key_prefix(dir.string());  // no file: FastDeploy uses no prefix
  ASSERT_TRUE(none.ok());
  EXPECT_EQ(*none, "");
  fs::remove_all(dir);
}

// Trust round 4: a prefix FastDeploy reads and uses as written ("my model-1", "org/model-1",
// non-ASCII) made kvtd exit 2 ("must be 1-64 characters"), and so did a model directory FastDeploy
// serves ("with space", a 70-character name). Each is encoded into a name now, one per text.
TEST(VersionYaml, APrefixOrAModelDirectoryANameCannotHoldIsEncodedNotRefused) {
  const fs::path dir = fs::path(::testing::TempDir()) / fmt::format("version_prefix_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string file = (dir / "version.yaml").string();
  std::vector<std::string> names;
  for (const char* text : {"version: my model-1-x\n", "version: my/model-1-x\n", "version: \"\\xE9t\\xE9-2-x\"\n",
                           "version: RL-STEP1-x\n"}) {
    std::ofstream(file) << text;
    const auto prefix = fastdeploy_key_prefix(dir.string());
    ASSERT_TRUE(prefix.ok()) << text << ": " << prefix.error().message;
    EXPECT_TRUE(proto::valid_session_suffix(*prefix)) << *prefix;
    names.push_back(*prefix);
  }
  EXPECT_EQ(names[3], "RL-STEP1") << "a prefix that is a name stays as it is";
  EXPECT_EQ(names[0].rfind("my-model-1_h", 0), 0u) << names[0];
  EXPECT_NE(names[0], names[1]) << "'my model' and 'my/model' differ only where a name cannot hold them";
  const std::string long_dir = (fs::path(::testing::TempDir()) / std::string(70, 'm')).string();
  for (const std::string& model : {(dir / "with space").string(), long_dir}) {
    fs::create_directories(model);
    const char* argv[] = {"kvtd", "--rank", "0", "--key-cache-shape", "10,1,16,64", "--session", "s",
                          "--model_path", model.c_str()};
    auto c = parse_daemon_flags(9, argv);
    ASSERT_TRUE(c.ok()) << model << ": " << c.error().message;
    EXPECT_TRUE(proto::valid_model_id(c->model_id)) << c->model_id;
    fs::remove_all(model);
  }
  fs::remove_all(dir);
}

// A config file that is a FIFO hung start-up, and one with a table nested
// thousands deep took 3.9 GB. Both are refused at once, naming the file; a flat one is read.
TEST(ConfigFile, AFifoOrADeeplyNestedConfigIsRefusedAtOnce) {
  const fs::path dir = fs::path(::testing::TempDir()) / fmt::format("config_file_{}", ::getpid());
  fs::remove_all(dir);
  fs::create_directories(dir);
  const std::string file = (dir / "kvtd.toml").string();
  auto parse_with = [&]() {
    const char* argv[] = {"kvtd", "--config", file.c_str()};
    return parse_daemon_flags(3, argv);
  };
  ASSERT_EQ(::mkfifo(file.c_str(), 0600), 0);
  const auto t0 = std::chrono::steady_clock::now();
  auto fifo = parse_with();
  EXPECT_LT(std::chrono::steady_clock::now() - t0, std::chrono::seconds(5));
  ASSERT_FALSE(fifo.ok());
  EXPECT_NE(fifo.error().message.find(file + ": not a regular file"), std::string::npos) << fifo.error().message;
  fs::remove(file);
  std::string deep = "[a";
  for (int i = 0; i < 20000; ++i) deep += ".a";
  std::ofstream(file) << deep << "]\nx = 1\n";
  auto nested = parse_with();
  ASSERT_FALSE(nested.ok());
  EXPECT_NE(nested.error().message.find("line 1 nests deeper than 8"), std::string::npos) << nested.error().message;
  std::ofstream(file) << "x = [[[[[[[[[[1]]]]]]]]]]\n";
  auto brackets = parse_with();
  ASSERT_FALSE(brackets.ok());
  EXPECT_NE(brackets.error().message.find("nests deeper"), std::string::npos) << brackets.error().message;
  std::ofstream(file) << "# kvtd.toml\nrank = 0\nmp-num = 1\nsession = \"s.1\"  # dots in values are fine\n"
                         "key-cache-shape = \"10,1,16,64\"\n";
  auto flat = parse_with();
  ASSERT_TRUE(flat.ok()) << flat.error().message;
  EXPECT_EQ(flat->session_suffix, "s.1");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvtd::config
