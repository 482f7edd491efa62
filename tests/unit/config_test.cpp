#include "kvtd/config/daemon_config.h"

#include <gtest/gtest.h>

#include <fstream>

namespace kvtd::config {
namespace {

Result<DaemonConfig, ConfigErrc> parse(std::vector<std::string> args) {
  args.insert(args.begin(), "kvtd");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return parse_daemon_flags(static_cast<int>(argv.size()), argv.data());
}

const std::vector<std::string> kBase{"--rank", "1", "--mp-num", "2", "--num-layers", "4", "--num-host-blocks", "64",
                                     "--key-cache-shape", "100,8,64,128", "--value-cache-shape", "100,8,64,128",
                                     "--session", "abc"};

TEST(DaemonFlags, ParsesKvtdNames) {
  auto c = parse(kBase);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rank, 1u);
  EXPECT_EQ(c->mp_num, 2u);
  EXPECT_EQ(c->num_host_blocks, 64u);
  EXPECT_EQ(c->key_cache_shape[3], 128);
  auto g = c->geometry();
  EXPECT_EQ(g.block_bytes(proto::TensorKind::kKey), 8u * 64 * 128 * 2);
  EXPECT_TRUE(g.has_value());
}

TEST(DaemonFlags, AcceptsFastDeployNames) {
  auto c = parse({"--rank", "0", "--mp_num", "1", "--device_id", "3", "--num_layers", "2", "--num_cpu_blocks", "8",
                  "--key_cache_shape", "10,1,16,64", "--cache_dtype", "block_wise_fp8", "--ipc_suffix", "9923",
                  "--engine_worker_queue_port", "9923", "--protocol", "ipc", "--create_cache_tensor"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->device_id, 3);
  EXPECT_EQ(c->cache_dtype, proto::CacheDtype::kBlockWiseFp8);
  EXPECT_EQ(c->session_suffix, "9923");
  EXPECT_FALSE(c->geometry().has_value());
  EXPECT_TRUE(c->geometry().has_scales());
}

void expect_rejected(std::vector<std::string> extra, const std::string& names) {
  auto args = kBase;
  args.insert(args.end(), extra.begin(), extra.end());
  auto c = parse(args);
  ASSERT_FALSE(c.ok()) << "accepted " << extra[0];
  EXPECT_NE(c.error().message.find(names), std::string::npos) << c.error().message;
}

TEST(DaemonFlags, BadValuesNameTheFlag) {
  expect_rejected({"--rank", "2"}, "--rank");
  expect_rejected({"--mp-num", "0"}, "--mp-num");
  expect_rejected({"--key-cache-shape", "100,8,64"}, "--key-cache-shape");
  expect_rejected({"--key-cache-shape", "100,8,x,128"}, "--key-cache-shape");
  expect_rejected({"--value-cache-shape", "99,8,64,128"}, "--value-cache-shape");
  expect_rejected({"--cache-dtype", "fp4"}, "--cache-dtype");
  expect_rejected({"--device-backend", "rocm"}, "--device-backend");
  expect_rejected({"--scatter-mode", "dma"}, "--scatter-mode");
  expect_rejected({"--log-level", "loud"}, "--log-level");
  expect_rejected({"--session", "a/b"}, "--session");
  expect_rejected({"--engine-timeout", "0"}, "--engine-timeout");
  expect_rejected({"--heartbeat-period", "5"}, "--heartbeat-period");
  expect_rejected({"--num-host-blocks", "-1"}, "--num-host-blocks");
  expect_rejected({"--no-such-flag"}, "no-such-flag");
}

TEST(DaemonFlags, MissingRequiredFlagIsNamed) {
  auto c = parse({"--rank", "0"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("--key-cache-shape"), std::string::npos) << c.error().message;
}

TEST(DaemonFlags, ReadsAConfigFile) {
  const std::string path = ::testing::TempDir() + "/kvtd_test.toml";
  std::ofstream(path) << "rank = 0\nmp-num = 1\nkey-cache-shape = \"10,1,16,64\"\nsession = \"fromfile\"\n";
  auto c = parse({"--config", path});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->session_suffix, "fromfile");
}

TEST(DaemonFlags, HelpIsNotAnError) {
  auto c = parse({"--help"});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ConfigErrc::kHelp);
  EXPECT_NE(c.error().message.find("--num_cpu_blocks"), std::string::npos);
}

}  // namespace
}  // namespace kvtd::config
