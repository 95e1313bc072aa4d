// Shared code of the standalone microbenchmarks in this folder (they build without torch): an error check that prints
// and exits, the %globaltimer clock, the library's mbarrier and TMA helpers, and a tensor-map encoder that exits on
// failure.
#pragma once

#include <cuda.h>  // CUtensorMap
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>

#include "base_moe/tma.cuh"

#define CHECK(x)                                                                                    \
  do {                                                                                              \
    cudaError_t e = (x);                                                                            \
    if (e != cudaSuccess) {                                                                         \
      std::printf("%s:%d %s: %s\n", __FILE__, __LINE__, #x, cudaGetErrorString(e));                 \
      std::exit(1);                                                                                 \
    }                                                                                               \
  } while (0)

__device__ __forceinline__ unsigned long long globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}

// The mbarrier and TMA helpers are the library's (csrc/include/base_moe/tma.cuh).
using base_moe::tma::fence_mbarrier_init;
using base_moe::tma::load_2d;
using base_moe::tma::load_3d;
using base_moe::tma::load_5d;
using base_moe::tma::mbar_arrive;
using base_moe::tma::mbar_arrive_expect_tx;
using base_moe::tma::mbar_init;
using base_moe::tma::mbar_wait;

// A bf16 tensor map over `rank` dimensions (dims innermost first, byte strides of dimensions 1..), boxes of `box`
// elements in `swizzle`, through the driver's cuTensorMapEncodeTiled (looked up through the runtime, so no -lcuda);
// exits on failure.
inline CUtensorMap encode_bf16_map(const void* base, cuuint32_t rank, const cuuint64_t* dims, const cuuint64_t* strides,
                                   const cuuint32_t* box, CUtensorMapSwizzle swizzle) {
  using Encode = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                              const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                              CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q;
  CHECK(cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &fn, 12000, cudaEnableDefault, &q));
  const cuuint32_t elem[5] = {1, 1, 1, 1, 1};
  CUtensorMap map;
  const CUresult r = reinterpret_cast<Encode>(fn)(&map, CU_TENSOR_MAP_DATA_TYPE_BFLOAT16, rank, const_cast<void*>(base),
                                                  dims, strides, box, elem, CU_TENSOR_MAP_INTERLEAVE_NONE, swizzle,
                                                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
  if (r != CUDA_SUCCESS) {
    std::printf("cuTensorMapEncodeTiled failed: %d\n", static_cast<int>(r));
    std::exit(1);
  }
  return map;
}
