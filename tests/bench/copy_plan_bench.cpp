// Planning cost per block (Google Benchmark). Target: well under 50 ns per block at 4,096 blocks.
#include <benchmark/benchmark.h>

#include <algorithm>
#include <numeric>
#include <random>

#include "kvtd/kernels/copy_plan.h"

namespace {

void plan(benchmark::State& state, bool runs) {
  const auto n = static_cast<std::size_t>(state.range(0));
  const std::int64_t blocks = 65536;
  std::vector<std::int32_t> src(blocks), dst(blocks);
  std::iota(src.begin(), src.end(), 0);
  std::iota(dst.begin(), dst.end(), 0);
  std::mt19937 rng(1);
  if (!runs) {
    std::shuffle(src.begin(), src.end(), rng);
    std::shuffle(dst.begin(), dst.end(), rng);
  }
  src.resize(n);
  dst.resize(n);
  const std::vector<std::uint64_t> bytes{131072, 131072};
  for (auto _ : state) {
    auto p = kvtd::kernels::plan_copy(src, dst, blocks, blocks, bytes);
    benchmark::DoNotOptimize(p);
  }
  state.counters["ns_per_block"] = benchmark::Counter(static_cast<double>(n) * static_cast<double>(state.iterations()),
                                                      benchmark::Counter::kIsRate | benchmark::Counter::kInvert);
}

void BM_PlanRandomIds(benchmark::State& s) { plan(s, false); }
void BM_PlanConsecutiveIds(benchmark::State& s) { plan(s, true); }
BENCHMARK(BM_PlanRandomIds)->Arg(64)->Arg(4096);
BENCHMARK(BM_PlanConsecutiveIds)->Arg(64)->Arg(4096);

}  // namespace

BENCHMARK_MAIN();
