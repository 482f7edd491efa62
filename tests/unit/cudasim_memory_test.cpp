// The stand-in's memory is no more reachable than a GPU's: host code cannot touch device memory,
// and where the device says CanUseHostPointerForRegisteredMem = 0 a kernel reaches pinned host
// memory only by the address cudaHostGetDevicePointer gives. (CUDA runtime API reference,
// cudaHostGetDevicePointer: "...the device pointer ... may differ from the host pointer" unless
// cudaDevAttrCanUseHostPointerForRegisteredMem is non-zero.) Each case runs in a death-test
// child: a fault kills it, a sticky error breaks only its context.
#include <gtest/gtest.h>
#include <signal.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>

#include "cuda_runtime.h"  // the stand-in's: kernels, launches, __ldcs/__stcs
#include "cuda_runtime_api.h"
#include "cudasim_copy16.h"

namespace {

using cudasim_test::run_copy16;

// A host load of device memory faults on a GPU; the stand-in used to let host code read it, so
// a kvtd path that peeked at engine or staging memory in device memory would pass here.
TEST(CudaSimMemory, HostCodeCannotTouchDeviceMemory) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  EXPECT_EXIT(
      {
        void* p = nullptr;
        if (cudaMalloc(&p, 4096) != cudaSuccess || cudaMemset(p, 7, 4096) != cudaSuccess) _exit(2);
        unsigned char back = 0;
        if (cudaMemcpy(&back, p, 1, cudaMemcpyDeviceToHost) != cudaSuccess || back != 7) _exit(3);
        const volatile unsigned char* host_view = static_cast<const unsigned char*>(p);
        _exit(host_view[0] == 7 ? 0 : 4);  // faults before it can exit
      },
      ::testing::KilledBySignal(SIGSEGV), "");
}

// Copies and kernels still reach it, each for as long as it runs.
TEST(CudaSimMemory, DeviceWorkReachesDeviceMemory) {
  void *a = nullptr, *b = nullptr;
  ASSERT_EQ(cudaMalloc(&a, 64), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&b, 64), cudaSuccess);
  alignas(16) unsigned char in[16], out[16] = {};
  for (int i = 0; i < 16; ++i) in[i] = static_cast<unsigned char>(i + 1);
  ASSERT_EQ(cudaMemcpy(a, in, 16, cudaMemcpyHostToDevice), cudaSuccess);
  ASSERT_EQ(run_copy16(a, b), cudaSuccess);
  ASSERT_EQ(cudaMemcpy(out, b, 16, cudaMemcpyDeviceToHost), cudaSuccess);
  EXPECT_EQ(0, std::memcmp(in, out, 16));
  cudaFree(a);
  cudaFree(b);
}

TEST(CudaSimMemory, WithoutHostPointersAKernelReachesPinnedMemoryOnlyByItsMappedAddress) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  auto body = [] {
        setenv("KVTD_CUDASIM_NO_HOST_POINTERS", "1", 1);
        void *dev = nullptr, *host = nullptr, *mapped = nullptr;
        if (cudaMalloc(&dev, 64) != cudaSuccess || cudaMemset(dev, 9, 64) != cudaSuccess) _exit(2);
        if (cudaHostAlloc(&host, 64, cudaHostAllocMapped) != cudaSuccess) _exit(3);
        if (cudaHostGetDevicePointer(&mapped, host, 0) != cudaSuccess || mapped == host) _exit(4);
        if (run_copy16(dev, mapped) != cudaSuccess || static_cast<unsigned char*>(host)[15] != 9) _exit(5);
        // The raw host address is no device address on such a device: the kernel faults.
        _exit(run_copy16(dev, host) == cudaErrorIllegalAddress ? 0 : 6);
  };
  EXPECT_EXIT(body(), ::testing::ExitedWithCode(0), "");
}

TEST(CudaSimMemory, WithHostPointersTheMappedAddressIsTheHostAddress) {
  void *host = nullptr, *mapped = nullptr;
  ASSERT_EQ(cudaHostAlloc(&host, 64, cudaHostAllocMapped), cudaSuccess);
  ASSERT_EQ(cudaHostGetDevicePointer(&mapped, host, 0), cudaSuccess);
  EXPECT_EQ(mapped, host);
  cudaFreeHost(host);
}

}  // namespace
