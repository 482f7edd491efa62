#include "kvtd/config/daemon_config.h"
#include "kvtd/proto/group_spec.h"

#include <gtest/gtest.h>

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>

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

TEST(DaemonFlags, HostPoolHugePagesAndTheirMount) {
  auto c = parse(kBase);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_FALSE(c->host_pool_hugepages);
  auto args = kBase;
  args.insert(args.end(), {"--host-pool-hugepages", "--hugetlbfs-dir", "/mnt/huge1g"});
  auto h = parse(args);
  ASSERT_TRUE(h.ok()) << h.error().message;
  EXPECT_TRUE(h->host_pool_hugepages);
  EXPECT_EQ(h->hugetlbfs_dir, "/mnt/huge1g");
}

TEST(DaemonFlags, ScatterModeDefaultsToTheCopyEnginesAndKnowsWhenItWasAsked) {
  auto c = parse(kBase);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->scatter_mode, daemon::ScatterMode::kBatch);
  EXPECT_FALSE(c->scatter_mode_given);
  auto args = kBase;
  args.insert(args.end(), {"--scatter-mode", "kernel"});
  auto k = parse(args);
  ASSERT_TRUE(k.ok()) << k.error().message;
  EXPECT_EQ(k->scatter_mode, daemon::ScatterMode::kKernelAllLayers);
  EXPECT_TRUE(k->scatter_mode_given);
}

TEST(DaemonFlags, AcceptsFastDeployNames) {
  auto c = parse({"--rank", "0", "--mp_num", "1", "--device_id", "3", "--num_layers", "2", "--num_cpu_blocks", "8",
                  "--key_cache_shape", "10,1,16,64", "--cache_dtype", "block_wise_fp8", "--ipc_suffix", "9923",
                  "--engine_worker_queue_port", "9923", "--protocol", "ipc", "--create_cache_tensor",
                  "--local_data_parallel_id", "2"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->device_id, 3);
  EXPECT_EQ(c->data_parallel_id, 2u);
  EXPECT_EQ(c->cache_dtype, proto::CacheDtype::kBlockWiseFp8);
  EXPECT_EQ(c->session_suffix, "9923");
  EXPECT_FALSE(c->geometry().has_value());
  EXPECT_TRUE(c->geometry().has_scales());
}

// FastDeploy's launch command, flag for flag as prefix_cache_manager.py launch_cache_manager
// (~314-337, upstream develop c1b7c083) builds it, plus --engine_pid (FastDeploy 2.0/2.1) and no
// --session: kvtd must start from it unchanged.
std::vector<std::string> fastdeploy_launch(const std::string& model_path) {
  return {"--device_id", "0", "--rank", "1", "--splitwise_role", "mixed", "--num_layers", "2", "--mp_num", "2",
          "--cache_dtype", "bfloat16", "--key_cache_shape", "64,2,16,8", "--value_cache_shape", "64,2,16,8",
          "--cache_queue_port", "8334", "--enable_splitwise", "0", "--pod_ip", "127.0.0.1",
          "--engine_worker_queue_port", "8333", "--num_cpu_blocks", "16", "--protocol", "ipc",
          "--local_data_parallel_id", "0", "--rdma_port", "0", "--speculative_config", "{}", "--default_dtype",
          "bfloat16", "--kvcache_storage_backend", "file", "--create_cache_tensor", "--write_policy",
          "write_through", "--max_model_len", "2048", "--model_path", model_path};
}

TEST(DaemonFlags, FastDeploysLaunchLineNamesTheSessionModelStoreAndKeyPrefix) {
  char dir[] = "/tmp/kvtd_fd_modelXXXXXX";
  ASSERT_NE(mkdtemp(dir), nullptr);
  const std::string model = std::string(dir) + "/ERNIE-4.5-0.3B";
  ASSERT_EQ(mkdir(model.c_str(), 0700), 0);
  unsetenv(kFastDeployStorageDirEnv);
  auto c = parse(fastdeploy_launch(model + "/"));
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->session_suffix, "fastdeploy.8333");
  EXPECT_EQ(c->fastdeploy.engine_worker_queue_port, "8333");
  EXPECT_EQ(c->model_id, "ERNIE-4.5-0.3B");
  EXPECT_EQ(c->storage.path, kFastDeployStorageDirDefault);
  EXPECT_EQ(c->storage.key_prefix, "");  // no version.yaml: FastDeploy uses no prefix either
  if (std::getenv("KVTD_DEVICE_BACKEND") == nullptr) {
    EXPECT_EQ(c->device_backend, DeviceBackendKind::kCuda);  // FastDeploy's cache is on the GPU
  }
  EXPECT_TRUE(c->fastdeploy.create_cache_tensor);
  for (const char* f : {"--max_model_len", "--pod_ip", "--rdma_port"})
    EXPECT_NE(std::find(c->ignored_flags.begin(), c->ignored_flags.end(), f), c->ignored_flags.end()) << f;

  // RL: the key prefix is the version's first two parts (cache_transfer_manager.py
  // get_key_prefix_from_version), and the store root comes from FastDeploy's variable.
  std::ofstream(model + "/version.yaml") << "# trainer output\nversion: 'RL-STEP12-20251120-0f3a'\n";
  setenv(kFastDeployStorageDirEnv, dir, 1);
  c = parse(fastdeploy_launch(model));
  unsetenv(kFastDeployStorageDirEnv);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->storage.key_prefix, "RL-STEP12");
  EXPECT_EQ(c->storage.path, dir);

  std::ofstream(model + "/version.yaml") << "step: 12\n";
  c = parse(fastdeploy_launch(model));
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("version.yaml: no top-level 'version' key"), std::string::npos) << c.error().message;
  std::remove((model + "/version.yaml").c_str());
  rmdir(model.c_str());
  rmdir(dir);
}

// FastDeploy 2.0's launch line (release/2.0 prefix_cache_manager.py launch_cache_manager): the
// cache described by --num_gpu_blocks/--kv_num_head/--block_size/--head_dim, the signals suffixed
// by --engine_pid, no --key_cache_shape.
TEST(DaemonFlags, FastDeploy20sLaunchLineDescribesTheCacheByItsOldFlags) {
  auto c = parse({"--device_id", "0", "--rank", "0", "--splitwise_role", "mixed", "--num_layers", "2", "--head_dim",
                  "128", "--kv_num_head", "4", "--mp_num", "2", "--cache_dtype", "bfloat16", "--cache_queue_port",
                  "8334", "--enable_splitwise", "0", "--pod_ip", "0.0.0.0", "--engine_worker_queue_port", "8333",
                  "--num_gpu_blocks", "100", "--num_cpu_blocks", "16", "--bytes_per_layer_per_block", "131072",
                  "--block_size", "64", "--engine_pid", "31337", "--protocol", "ipc", "--local_data_parallel_id",
                  "0", "--rdma_port", "0", "--speculative_config", "{}"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->session_suffix, "fastdeploy.31337");
  EXPECT_EQ(c->fastdeploy.engine_worker_queue_port, "31337");  // the signals' suffix
  const std::int64_t want[4] = {100, 4, 64, 128};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(c->key_cache_shape[i], want[i]);
    EXPECT_EQ(c->value_cache_shape[i], want[i]);
  }
  auto partial = parse({"--rank", "0", "--session", "s", "--num_gpu_blocks", "100", "--kv_num_head", "4"});
  ASSERT_FALSE(partial.ok());
  EXPECT_NE(partial.error().message.find("all four"), std::string::npos) << partial.error().message;
}

TEST(DaemonFlags, ATcpControlEndpointNeedsASecretFile) {
  auto c = parse({"--rank", "0", "--session", "s", "--key-cache-shape", "10,1,16,64", "--control-endpoint",
                  "tcp://127.0.0.1:7000"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("--control-secret-file"), std::string::npos) << c.error().message;
}

TEST(DaemonFlags, ASessionIsRequiredUnlessFastDeploysPortNamesIt) {
  auto c = parse({"--rank", "0", "--key-cache-shape", "10,1,16,64"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("--engine_worker_queue_port"), std::string::npos) << c.error().message;
  c = parse({"--rank", "0", "--key-cache-shape", "10,1,16,64", "--engine_worker_queue_port", "8333", "--session", "x"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->session_suffix, "x");  // an explicit session wins
  c = parse({"--rank", "0", "--key-cache-shape", "10,1,16,64", "--engine_worker_queue_port", "../x"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("--engine_worker_queue_port"), std::string::npos) << c.error().message;
}

TEST(DaemonFlags, ThreeDimensionalShapesHaveHeadDimOne) {
  auto c = parse({"--rank", "0", "--key-cache-shape", "10,4,16", "--value-cache-shape", "10,4,16", "--session", "s"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->key_cache_shape[3], 1);
  EXPECT_EQ(c->geometry().block_bytes(proto::TensorKind::kValue), 4u * 16 * 2);
}

TEST(DaemonFlags, DefaultDtypeSetsTheFp8ScaleElementSize) {
  const std::vector<std::string> fp8{"--rank", "0", "--key_cache_shape", "10,2,16,64", "--cache_dtype", "block_wise_fp8",
                                     "--value_cache_shape", "10,2,16,64", "--ipc_suffix", "s"};
  auto two = parse(fp8);
  ASSERT_TRUE(two.ok()) << two.error().message;
  EXPECT_EQ(two->geometry().block_bytes(proto::TensorKind::kValueScale), 2u * 16 * 2);
  auto args = fp8;
  args.insert(args.end(), {"--default_dtype", "float32"});
  auto four = parse(args);
  ASSERT_TRUE(four.ok()) << four.error().message;
  EXPECT_EQ(four->geometry().scale_bytes, 4u);
  EXPECT_EQ(four->geometry().block_bytes(proto::TensorKind::kKeyScale), 2u * 16 * 4);
  EXPECT_TRUE(four->ignored_flags.empty());  // --default_dtype is used now, not ignored
  args.back() = "uint8";
  auto bad = parse(args);
  ASSERT_FALSE(bad.ok());
  EXPECT_NE(bad.error().message.find("--default-dtype"), std::string::npos) << bad.error().message;
  // Without fp8 the default dtype does not matter, and the geometry carries no scale size.
  auto plain = parse({"--rank", "0", "--key-cache-shape", "10,2,16,64", "--session", "s", "--default_dtype", "uint8"});
  ASSERT_TRUE(plain.ok()) << plain.error().message;
  EXPECT_EQ(plain->geometry().scale_bytes, 0u);
}

TEST(DaemonFlags, ExtraLayersFromFlagsOrFastDeploySpeculativeConfig) {
  auto json = parse({"--rank", "0", "--num_layers", "4", "--key_cache_shape", "100,2,16,64", "--ipc_suffix", "s",
                     "--speculative_config", R"({"method": "mtp", "num_extra_cache_layer": 1, "num_gpu_block_expand_ratio": 0.5})"});
  ASSERT_TRUE(json.ok()) << json.error().message;
  auto g = json->geometry();
  EXPECT_EQ(g.num_layers, 5u);
  EXPECT_EQ(g.num_extra_layers, 1u);
  EXPECT_EQ(g.extra_device_blocks, 50);
  EXPECT_EQ(g.device_blocks(3), 100);
  EXPECT_EQ(g.device_blocks(4), 50);
  EXPECT_EQ(g.usable_device_blocks(), 50);
  auto flags = parse({"--rank", "0", "--num-layers", "4", "--key-cache-shape", "100,2,16,64", "--session", "s",
                      "--num-extra-layers", "2", "--extra-device-blocks", "150"});
  ASSERT_TRUE(flags.ok()) << flags.error().message;
  EXPECT_EQ(flags->geometry().num_layers, 6u);
  EXPECT_EQ(flags->geometry().usable_device_blocks(), 100);
  // No extra layers in the JSON: none.
  auto none = parse({"--rank", "0", "--key-cache-shape", "100,2,16,64", "--session", "s", "--speculative_config", "{}"});
  ASSERT_TRUE(none.ok()) << none.error().message;
  EXPECT_EQ(none->geometry().num_extra_layers, 0u);
}

void expect_rejected(std::vector<std::string> extra, const std::string& names) {
  auto args = kBase;
  args.insert(args.end(), extra.begin(), extra.end());
  auto c = parse(args);
  ASSERT_FALSE(c.ok()) << "accepted " << extra[0];
  EXPECT_NE(c.error().message.find(names), std::string::npos) << c.error().message;
}

TEST(DaemonFlags, HostPoolPinningThreadsAndFirstShareHaveDefaultsAndRanges) {
  auto c = parse(kBase);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->host_pool_pin_threads, 4u);
  auto args = kBase;
  args.insert(args.end(), {"--host-pool-pin-threads", "16"});
  auto h = parse(args);
  ASSERT_TRUE(h.ok()) << h.error().message;
  EXPECT_EQ(h->host_pool_pin_threads, 16u);
  expect_rejected({"--host-pool-pin-threads", "0"}, "--host-pool-pin-threads");
  expect_rejected({"--host-pool-pin-threads", "65"}, "--host-pool-pin-threads");
  EXPECT_EQ(c->host_pool_pin_first_mib, 1024u);
  expect_rejected({"--host-pool-pin-first-mib", "0"}, "--host-pool-pin-first-mib");
}

TEST(DaemonFlags, BadValuesNameTheFlag) {
  expect_rejected({"--rank", "2"}, "--rank");
  expect_rejected({"--mp-num", "0"}, "--mp-num");
  expect_rejected({"--key-cache-shape", "100,8"}, "--key-cache-shape");
  expect_rejected({"--key-cache-shape", "100,8,64,128,2"}, "--key-cache-shape");
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
  expect_rejected({"--speculative_config", "{not json"}, "--speculative_config");
  expect_rejected({"--speculative_config", R"({"num_extra_cache_layer": "two"})"}, "num_extra_cache_layer");
  expect_rejected({"--speculative_config", R"({"num_extra_cache_layer": 1, "num_gpu_block_expand_ratio": 0})"},
                  "num_gpu_block_expand_ratio");
  expect_rejected({"--num-extra-layers", "600"}, "extra layers");
  expect_rejected({"--extra-device-blocks", "5"}, "--num-extra-layers");
  expect_rejected({"--local-data-parallel-id", "-1"}, "--local-data-parallel-id");
  expect_rejected({"--host-layout", "row_major"}, "--host-layout");
  expect_rejected({"--host-pool-hugepages", "--hugetlbfs-dir", "hugepages"}, "--hugetlbfs-dir");
  expect_rejected({"--numa-node", "near"}, "--numa-node");
  expect_rejected({"--metrics-address", "localhost"}, "--metrics-address");
  expect_rejected({"--metrics-address", "10.0.0.300"}, "--metrics-address");
  expect_rejected({"--kv-events-format", "json"}, "--kv-events-format");
  expect_rejected({"--kv-events-endpoint", "tcp://*:5557"}, "--storage-backend is none");
  expect_rejected({"--kv-events-endpoint", "udp://x:1", "--storage-backend", "file", "--storage-path", "/tmp/x",
                   "--model-id", "m"},
                  "--kv-events-endpoint");
  expect_rejected({"--kv-events-endpoint", "tcp://*:5557", "--kv-events-locality", "NEARBY", "--storage-backend",
                   "file", "--storage-path", "/tmp/x", "--model-id", "m"},
                  "--kv-events-locality");
}

// vLLM (main 017e9f44, kv_events.py:45-47, 76) names a storage tier's medium STORAGE and its
// locality LOCAL or REMOTE; KV-aware routers (Dynamo) drop media they do not know, which the
// DISK and REDIS kvtd named before were.
TEST(DaemonFlags, KvEventsNameVllmsStorageMediumAndTheStoresLocality) {
  auto file = parse({"--rank", "0", "--session", "s", "--key-cache-shape", "10,1,16,64", "--kv-events-endpoint",
                     "tcp://*:5557", "--storage-backend", "file", "--storage-path", "/tmp/x", "--model-id", "m"});
  ASSERT_TRUE(file.ok()) << file.error().message;
  EXPECT_EQ(file->kv_events.medium, "STORAGE");
  EXPECT_EQ(file->kv_events.locality, "LOCAL");
  auto redis = parse({"--rank", "0", "--session", "s", "--key-cache-shape", "10,1,16,64", "--kv-events-endpoint",
                      "tcp://*:5557", "--storage-backend", "redis", "--redis-endpoints", "127.0.0.1:6379",
                      "--model-id", "m", "--kv-events-locality", "none"});
  ASSERT_TRUE(redis.ok()) << redis.error().message;
  EXPECT_EQ(redis->kv_events.locality, "none");
  auto remote = parse({"--rank", "0", "--session", "s", "--key-cache-shape", "10,1,16,64", "--kv-events-endpoint",
                       "tcp://*:5557", "--storage-backend", "redis", "--redis-endpoints", "127.0.0.1:6379",
                       "--model-id", "m"});
  ASSERT_TRUE(remote.ok()) << remote.error().message;
  EXPECT_EQ(remote->kv_events.locality, "REMOTE");
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

// Size products used to wrap ("0 bytes per block", "host pool 0.0 MiB").
TEST(DaemonFlags, ShapesWhoseSizeProductsOverflowAreRefused) {
  auto c = parse({"--rank", "0", "--session", "s", "--key-cache-shape", "16,4294967296,4294967296,8"});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ConfigErrc::kInvalidValue);
  EXPECT_NE(c.error().message.find("overflow"), std::string::npos) << c.error().message;
  // 1,073,741,824 host blocks of 16 GiB each.
  c = parse({"--rank", "0", "--session", "s", "--num-host-blocks", "1073741824", "--key-cache-shape",
             "16,1024,1024,8192"});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("overflow"), std::string::npos) << c.error().message;
}

// Out-of-range durations and ids are refused naming the range.
TEST(DaemonFlags, OutOfRangeDurationsAndDeviceIdsNameTheRange) {
  expect_rejected({"--engine-timeout", "inf"}, "[0.001, 3600]");
  expect_rejected({"--engine-timeout", "1e30"}, "[0.001, 3600]");
  expect_rejected({"--engine-timeout", "nan"}, "--engine-timeout");
  expect_rejected({"--heartbeat-period", "1e-9"}, "[0.001, 1]");
  expect_rejected({"--attach-timeout", "1e-300"}, "--attach-timeout");
  expect_rejected({"--attach-timeout", "-1"}, "--attach-timeout");
  expect_rejected({"--device-id", "2000"}, "[0, 1023]");
  auto c = parse(kBase);
  ASSERT_TRUE(c.ok());
  EXPECT_EQ(c->engine_timeout_ns(), 5'000'000'000);
}

TEST(DaemonFlags, StorageFlagsAreParsedAndBadOnesNamed) {
  expect_rejected({"--write_policy", "sometimes"}, "--write-policy");
  expect_rejected({"--kvcache_storage_backend", "mooncake"}, "not built into this kvtd (built: none, file, redis)");
  expect_rejected({"--storage-backend", "file"}, "--storage-path");
  expect_rejected({"--storage-backend", "redis"}, "--redis-endpoints");
  expect_rejected({"--storage-backend", "redis", "--redis-endpoints", "localhost"}, "'localhost' is not host:port");
  expect_rejected({"--storage-backend", "redis", "--redis-endpoints", "a:1,b:99999"}, "'b:99999'");
  expect_rejected({"--storage-io-threads", "0"}, "--storage-io-threads");
  expect_rejected({"--storage-staging-mib", "0"}, "--storage-staging-mib");
  expect_rejected({"--storage-io-threads", "65"}, "--storage-io-threads");
  expect_rejected({"--storage-io", "sometimes"}, "--storage-io: 'sometimes' is not buffered or direct");
  expect_rejected({"--storage-backend", "redis", "--redis-endpoints", "h:1", "--model-id", "m", "--storage-io", "direct"},
                  "--storage-io direct: only the file store");
  expect_rejected({"--storage-backup-queue-mib", "0"}, "--storage-backup-queue-mib");
  expect_rejected({"--storage-backup-max-age-ms", "0"}, "--storage-backup-max-age-ms");
  expect_rejected({"--storage-fsync", "always"}, "--storage-fsync");
  // A store without a model id shared one namespace with every deployment.
  expect_rejected({"--storage-backend", "file", "--storage-path", "/tmp/s"}, "--model-id: required with a storage backend");
  auto args = kBase;
  for (const char* a : {"--write_policy", "write_through_selective", "--kvcache_storage_backend", "redis",
                        "--redis-endpoints", "10.0.0.1:6379,h2:7000", "--pod_ip", "1.2.3.4", "--weight-version", "7",
                        "--storage-staging-mib", "16", "--write-threshold", "3", "--model-id", "m"})
    args.push_back(a);
  auto c = parse(args);
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->storage.backend, kvtd::config::StorageBackendKind::kRedis);
  EXPECT_EQ(c->storage.write_policy, kvtd::config::WritePolicy::kWriteThroughSelective);
  ASSERT_EQ(c->storage.redis_endpoints.size(), 2u);
  EXPECT_EQ(c->storage.redis_endpoints[1], "h2:7000");
  EXPECT_EQ(c->storage.weight_version, 7u);
  EXPECT_EQ(c->storage.staging_mib, 16u);
  EXPECT_EQ(c->storage.write_threshold, 3u);
  EXPECT_EQ(c->storage.io_threads, 0u) << "not given: sized from the machine at start";
  EXPECT_EQ(c->storage.backup_queue_mib, 256u);
  EXPECT_EQ(c->storage.backup_max_age_ms, 2000u);
  std::string all;
  for (const auto& f : c->ignored_flags) all += f + " ";
  EXPECT_NE(all.find("--pod_ip"), std::string::npos) << all;
  EXPECT_EQ(all.find("--write_policy"), std::string::npos) << all;
}

// A typo in a config file used to be ignored (the daemon ran with 0 host blocks).
TEST(DaemonFlags, ConfigFileTypoOrGarbageIsAnErrorNamingIt) {
  const std::string path = ::testing::TempDir() + "/kvtd_typo.toml";
  std::ofstream(path) << "rank = 0\nkey-cache-shape = \"10,1,16,64\"\nsession = \"f\"\nnum-host-block = 4\n";
  auto c = parse({"--config", path});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("num-host-block"), std::string::npos) << c.error().message;
  const std::string garbage = ::testing::TempDir() + "/kvtd_garbage.toml";
  std::ofstream(garbage) << "rank = 0\nkey-cache-shape = \"10,1,16,64\"\nsession = \"f\"\n%%% not a setting %%%\n";
  c = parse({"--config", garbage});
  ASSERT_FALSE(c.ok());
  EXPECT_NE(c.error().message.find("not a setting"), std::string::npos) << c.error().message;
}

// Found by fuzz_config: a leftover positional argument sent CLI11 2.1.2 into an endless loop
// inside the FastDeploy option group's nested parse; startup hung instead of failing.
TEST(DaemonFlags, LeftoverPositionalArgumentDoesNotHangTheParser) {
  alarm(10);  // a hang fails the test instead of blocking CI
  auto c = parse({"--rank", "0", "--key-cache-shape", "10,1,16,64", "", "", "--sess16,64", "--session", "s"});
  alarm(0);
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ConfigErrc::kParse);
}

TEST(DaemonFlags, HelpIsNotAnError) {
  auto c = parse({"--help"});
  ASSERT_FALSE(c.ok());
  EXPECT_EQ(c.error().code, ConfigErrc::kHelp);
  EXPECT_NE(c.error().message.find("--num_cpu_blocks"), std::string::npos);
}

}  // namespace
// The shipped example must stay valid as flags change (storage flags were added by.
TEST(DaemonFlags, ExampleConfigFileParses) {
  const std::string path = std::string(KVTD_SOURCE_DIR) + "/systemd/kvtd.toml.example";
  auto c = parse({"--config", path, "--rank", "0"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->model_id, "my-model");
  EXPECT_EQ(c->mp_num, 2u);
  const std::string group = std::string(KVTD_SOURCE_DIR) + "/systemd/group.toml.example";
  auto g = parse({"--config", group, "--rank", "3", "--device-id", "auto"});
  ASSERT_TRUE(g.ok()) << g.error().message;
  EXPECT_EQ(g->device_id, 7);  // device-base 4 + rank 3
}

}  // namespace kvtd::config

namespace kvtd::config {
namespace {

// Several engines per host. The unit runs `kvtd --instance %i --config-dir DIR`;
// "<group>-<rank>" reads DIR/<group>.toml, "<rank>" DIR/kvtd.toml as before groups existed.
class InstanceFlags : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = ::testing::TempDir() + "/kvtd_instances";
    ::mkdir(dir_.c_str(), 0700);
    std::ofstream(dir_ + "/kvtd.toml") << "mp-num = 2\nkey-cache-shape = \"10,1,16,64\"\nsession = \"single\"\n";
    std::ofstream(dir_ + "/llama-70b.toml")
        << "mp-num = 4\nkey-cache-shape = \"10,1,16,64\"\nsession = \"llama\"\ndevice-base = 4\n";
  }
  std::string dir_;
};

TEST_F(InstanceFlags, ARankAloneReadsTheSingleGroupsConfig) {
  auto c = parse({"--instance", "1", "--config-dir", dir_, "--device-id", "auto"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rank, 1u);
  EXPECT_EQ(c->group, "");
  EXPECT_EQ(c->session_suffix, "single");
  EXPECT_EQ(c->device_id, 1);  // auto = device-base (0) + rank
}

TEST_F(InstanceFlags, AGroupInstanceReadsItsGroupsConfigAndPicksItsDevice) {
  auto c = parse({"--instance", "llama-70b-3", "--config-dir", dir_, "--device-id", "auto"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  EXPECT_EQ(c->rank, 3u);
  EXPECT_EQ(c->group, "llama-70b");  // the rank is what follows the last '-'
  EXPECT_EQ(c->session_suffix, "llama");
  EXPECT_EQ(c->mp_num, 4u);
  EXPECT_EQ(c->device_id, 7);  // device-base 4 + rank 3
  auto fixed = parse({"--instance", "llama-70b-3", "--config-dir", dir_, "--device-id", "2"});
  ASSERT_TRUE(fixed.ok()) << fixed.error().message;
  EXPECT_EQ(fixed->device_id, 2);  // an instance's env file may still name its device
}

TEST_F(InstanceFlags, BadInstancesAndConflictsAreNamed) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases{
      {{"--instance", "llama-", "--config-dir", dir_}, "--instance"},
      {{"--instance", "llama", "--config-dir", dir_}, "--instance"},
      {{"--instance", "-3", "--config-dir", dir_}, "--instance"},
      {{"--instance", "a/b-3", "--config-dir", dir_}, "--instance"},
      {{"--instance", "nosuchgroup-0", "--config-dir", dir_}, "nosuchgroup.toml"},
      {{"--config-dir", dir_}, "--config-dir needs --instance"},
      {{"--instance", "1", "--config-dir", dir_, "--rank", "1"}, "--rank and --instance"},
      {{"--instance", "1", "--config-dir", dir_, "--config", dir_ + "/kvtd.toml"}, "--config and --config-dir"},
      {{"--instance", "llama-70b-4", "--config-dir", dir_}, "--rank"},  // mp-num 4
      {{"--instance", "1", "--config-dir", dir_, "--device-id", "first"}, "--device-id"},
      {{"--instance", "1", "--config-dir", dir_, "--device-base", "-1"}, "--device-base"},
      {{"--mp-num", "2", "--key-cache-shape", "10,1,16,64", "--session", "s"}, "--rank or --instance"},
  };
  for (const auto& [args, names] : cases) {
    auto c = parse(args);
    ASSERT_FALSE(c.ok()) << "accepted " << args[1];
    EXPECT_NE(c.error().message.find(names), std::string::npos) << args[1] << ": " << c.error().message;
  }
}

}  // namespace
}  // namespace kvtd::config

namespace kvtd::config {
namespace {

const std::string kSliding =
    "kind=sliding_window,layers=0-2:2,tensors=4x16x64@2+4x16x64@2,device_blocks=32,host_blocks=40,block_tokens=16,"
    "window=128";
const std::string kFull = "kind=full_attention,layers=1,tensors=4x16x64@2+4x16x64@2,device_blocks=64,host_blocks=48,"
                          "block_tokens=16";

TEST(DaemonFlags, CacheGroupsDescribeTheWholeCache) {
  auto c = parse({"--rank", "0", "--mp-num", "2", "--cache-group", kSliding, "--cache-group", kFull, "--session", "s"});
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_EQ(c->cache_groups.num_groups, 2u);
  EXPECT_EQ(c->cache_groups.num_ranks, 2u);
  EXPECT_EQ(c->cache_groups.page_tokens, 16u);
  EXPECT_EQ(c->cache_groups.groups[0].window_tokens, 128u);
  EXPECT_EQ(c->cache_groups.groups[1].host_blocks, 48u);
  const auto g = c->geometry();  // the envelope: ranks and layers
  EXPECT_EQ(g.num_layers, 3u);
  EXPECT_EQ(g.num_ranks, 2u);
  EXPECT_EQ(g.num_host_blocks, 0u);
}

TEST(DaemonFlags, CacheGroupsComeFromAConfigFile) {
  const std::string path = ::testing::TempDir() + "/kvtd_groups.toml";
  std::ofstream(path) << "rank = 1\nmp-num = 2\nsession = \"hybrid\"\ncache-group = [\"" << kSliding << "\", \""
                      << kFull << "\"]\n";
  auto c = parse({"--config", path});
  ASSERT_TRUE(c.ok()) << c.error().message;
  ASSERT_EQ(c->cache_groups.num_groups, 2u);
  EXPECT_EQ(proto::format_group_spec(c->cache_groups.groups[0]), kSliding);
  EXPECT_EQ(proto::format_group_spec(c->cache_groups.groups[1]), kFull);
}

TEST(DaemonFlags, CacheGroupsRefuseWhatTheyCannotServeByName) {
  const std::vector<std::pair<std::vector<std::string>, std::string>> cases = {
      {{"--cache-group", kSliding, "--key-cache-shape", "4,1,16,8"}, "leave out --key-cache-shape"},
      {{"--cache-group", kSliding, "--num-extra-layers", "1"}, "extra (MTP) layers are a group of their own"},
      {{"--cache-group", kSliding, "--cache-group", kFull, "--num-host-blocks", "64"}, "leave out --num-host-blocks"},
      {{"--cache-group", kSliding, "--cache-group", kFull, "--num_layers", "3"}, "leave out --num-layers"},
      {{"--cache-group", kSliding}, "layer 1 is in no attention group"},
      {{"--cache-group", "kind=full_attention"}, "cache group 0: missing layers"},
      {{"--cache-group", kSliding, "--cache-group", kFull, "--storage-backend", "file", "--storage-path", "/tmp/x",
        "--model-id", "m", "--storage-object-heads", "1"},
       "--storage-object-heads/--storage-kv-heads: not with --cache-group"},
  };
  for (const auto& [more, want] : cases) {
    std::vector<std::string> args{"--rank", "0", "--session", "s"};
    args.insert(args.end(), more.begin(), more.end());
    auto c = parse(args);
    ASSERT_FALSE(c.ok()) << want;
    EXPECT_NE(c.error().message.find(want), std::string::npos) << c.error().message;
  }
}

}  // namespace
}  // namespace kvtd::config
