// Hopper warpgroup MMA (wgmma) helpers of the decode expert kernel (csrc/experts.cu): shared-memory matrix
// descriptors for K-major tiles in the 128-byte swizzle, and D[64 x N] += A[64 x 16] * B[16 x N] with both operands
// in shared memory, fp32 accumulation. sm_90a only.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace base_moe {
namespace experts_detail {

// Byte offset of 16-byte chunk `ch` (0..7) of row `r` in a K-major tile of 128-byte rows, 128-byte swizzle (the
// layout wgmma reads with layout type 1): within each 8-row, 1024-byte block, chunk ch of row r sits at ch ^ (r % 8).
// The tile must start on a 1024-byte boundary.
__device__ __forceinline__ uint32_t swz128(int r, int ch) { return r * 128 + ((ch ^ (r & 7)) << 4); }

// Descriptor of a K-major operand at shared address `addr` (rows of 128 bytes, 8-row groups 1024 bytes apart,
// 128-byte swizzle). Advancing K by 16 elements inside the 128-byte row is addr + 32.
__device__ __forceinline__ uint64_t wgmma_desc(uint32_t addr) {
  uint64_t desc = (addr & 0x3FFFF) >> 4;        // start address, bits 0-13
  desc |= static_cast<uint64_t>(1) << 16;        // leading byte offset (unused for swizzled K-major), bits 16-29
  desc |= static_cast<uint64_t>(1024 >> 4) << 32;  // stride byte offset: 8 rows x 128 bytes, bits 32-45
  desc |= static_cast<uint64_t>(1) << 62;        // layout type 1: 128-byte swizzle, bits 62-63
  return desc;
}

// The descriptor of the operand `bytes` (a multiple of 16) after the one `desc` describes, in the same tile: only the
// start-address field moves, and it cannot carry into the next field (shared addresses stay below 256 KB, so the
// field's 14 bits hold every address / 16). Cheaper than wgmma_desc on the new address inside a k loop.
__device__ __forceinline__ uint64_t wgmma_desc_advance(uint64_t desc, uint32_t bytes) { return desc + (bytes >> 4); }

// wgmma exists only in sm_90a code. Other device targets (a build that adds 8.0, or plain 9.0) compile these helpers
// to a trap and kWgmmaCompiled is false there: the expert kernel then runs its wgmma tile configurations on mma.sync
// (the same tiles), so whatever configuration the host picks runs on every target.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define BASE_MOE_WGMMA(...) asm volatile(__VA_ARGS__)
#else
#define BASE_MOE_WGMMA(...) __trap()
#endif
#if defined(__CUDA_ARCH__) && !defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kWgmmaCompiled = false;
#else
constexpr bool kWgmmaCompiled = true;
#endif

__device__ __forceinline__ void wgmma_fence() { BASE_MOE_WGMMA("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_commit() { BASE_MOE_WGMMA("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ __forceinline__ void wgmma_wait_all() { BASE_MOE_WGMMA("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }
// Returns once at most one committed group of this warpgroup's wgmmas is still in flight (csrc/experts_ws.cu and the
// warp-specialised microbenchmarks keep one stage's wgmmas in flight).
__device__ __forceinline__ void wgmma_wait_one() { BASE_MOE_WGMMA("wgmma.wait_group.sync.aligned 1;\n" ::: "memory"); }

// Generic-proxy writes to shared memory (cp.async) made visible to the async proxy that wgmma reads through.
__device__ __forceinline__ void fence_proxy_async_shared() {
  BASE_MOE_WGMMA("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// The accumulator layout of m64nNk16 per thread (warp w of the warpgroup, lane l): per 8 columns j, registers 4j and
// 4j + 1 at row 16 w + l / 4, 4j + 2 and 4j + 3 at that row + 8, columns 8j + 2 (l % 4) + {0, 1}. Calls f(col, reg)
// for each of the thread's N / 4 columns: register reg holds row 16 w + l / 4, reg + 2 the row 8 below.
template <int N, typename F>
__device__ __forceinline__ void wgmma_for_each_column(int lane, F f) {
#pragma unroll
  for (int j = 0; j < N / 8; ++j) {
#pragma unroll
    for (int b = 0; b < 2; ++b) f(8 * j + 2 * (lane % 4) + b, 4 * j + b);
  }
}

// Keeps the compiler from moving accesses to the accumulator registers across the asynchronous wgmma (CUTLASS's
// warpgroup_fence_operand): before wgmma_fence and after wgmma_wait_all.
template <int N>
__device__ __forceinline__ void fence_registers(float* d) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// d (N / 2 floats per thread, the m16n8 accumulator layout per warp and per 8 columns) += A * B.
template <typename T, int N>
__device__ __forceinline__ void wgmma_m64k16(float* d, uint64_t desc_a, uint64_t desc_b);
// The instruction for one operand type (AB: "bf16" or "f16"); N columns take N / 2 accumulator registers. N = 64 and
// 128 serve csrc/experts.cu's W64 / W128; csrc/experts_ws.cu's items take 64, 80, 128 or 160.
#define BASE_MOE_WGMMA_N64(AB)                                                                              \
  BASE_MOE_WGMMA(                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n64k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]) \
      : "l"(desc_a), "l"(desc_b), "r"(1))
#define BASE_MOE_WGMMA_N80(AB)                                                                              \
  BASE_MOE_WGMMA(                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %42, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n80k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39}, %40, %41, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]) \
      : "l"(desc_a), "l"(desc_b), "r"(1))
#define BASE_MOE_WGMMA_N128(AB)                                                                             \
  BASE_MOE_WGMMA(                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %66, 0;\n"                                                          \
      "wgmma.mma_async.sync.aligned.m64n128k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]) \
      : "l"(desc_a), "l"(desc_b), "r"(1))

#define BASE_MOE_WGMMA_N160(AB)                                                                             \
  BASE_MOE_WGMMA(                                                                                           \
      "{\n.reg .pred p;\nsetp.ne.b32 p, %82, 0;\n"                                                         \
      "wgmma.mma_async.sync.aligned.m64n160k16.f32." AB "." AB " {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63, %64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79}, %80, %81, p, 1, 1, 0, 0;\n}\n" \
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63]), "+f"(d[64]), "+f"(d[65]), "+f"(d[66]), "+f"(d[67]), "+f"(d[68]), "+f"(d[69]), "+f"(d[70]), "+f"(d[71]), "+f"(d[72]), "+f"(d[73]), "+f"(d[74]), "+f"(d[75]), "+f"(d[76]), "+f"(d[77]), "+f"(d[78]), "+f"(d[79]) \
      : "l"(desc_a), "l"(desc_b), "r"(1))

// Both operand types' instances of one N.
#define BASE_MOE_WGMMA_INSTANCES(N)                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma_m64k16<__nv_bfloat16, N>(float* d, uint64_t desc_a, uint64_t desc_b) { \
    BASE_MOE_WGMMA_N##N("bf16");                                                                         \
  }                                                                                                      \
  template <>                                                                                            \
  __device__ __forceinline__ void wgmma_m64k16<__half, N>(float* d, uint64_t desc_a, uint64_t desc_b) {  \
    BASE_MOE_WGMMA_N##N("f16");                                                                          \
  }
BASE_MOE_WGMMA_INSTANCES(64)
BASE_MOE_WGMMA_INSTANCES(80)
BASE_MOE_WGMMA_INSTANCES(128)
BASE_MOE_WGMMA_INSTANCES(160)

#undef BASE_MOE_WGMMA_N64
#undef BASE_MOE_WGMMA_N80
#undef BASE_MOE_WGMMA_N128
#undef BASE_MOE_WGMMA_N160
#undef BASE_MOE_WGMMA_INSTANCES

}  // namespace experts_detail
}  // namespace base_moe
