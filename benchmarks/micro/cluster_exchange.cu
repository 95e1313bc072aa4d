// Microbenchmark (standalone, not part of the library): what one exchange between the CTAs of a 16-CTA cluster
// costs on the H200, to decide the selection kernel's design (notes/research_selection_s3.md, section 8).
//
//   nvcc -O3 -std=c++20 -arch=sm_90a -Icsrc/include benchmarks/micro/cluster_exchange.cu -o /tmp/cluster_exchange && /tmp/cluster_exchange
//
// Each kernel runs one cluster of C CTAs x 512 threads with ~200 KB of shared memory (the selection kernel's
// occupancy) and repeats one exchange ITERS times; CTA 0 times every repetition with clock64 between the moment it
// may start the exchange and the moment the data is usable. Printed: median and 90th percentile in ns (SM clock from
// cudaDevAttrClockRate, and %globaltimer as a cross-check).
//   barrier     : barrier.cluster.arrive.release + wait.acquire (today's exchange, no data)
//   store+bar   : every CTA writes BYTES into CTA 0 with plain st.shared::cluster, then the cluster barrier
//   st.async    : every CTA pushes BYTES into CTA 0 with st.async ... mbarrier::complete_tx; CTA 0 waits on its
//                 mbarrier (expect_tx = (C - 1) * BYTES); the others only arrive at a barrier that CTA 0 does not
//                 wait for before timing (the loop needs one to re-arm the buffer: it is outside the timed span)
//   gather      : CTA 0's warp 0 reads 4 floats per lane from each other CTA (ld.shared::cluster), after a barrier
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <vector>

#include "base_moe/experts_mma.cuh"
#include "base_moe/launch_config.cuh"
#include "check.cuh"

namespace cg = cooperative_groups;

constexpr int kThreads = 512;
constexpr int kIters = 200;
constexpr int kSmemBytes = 200 * 1024;

using base_moe::experts_detail::smem_addr;

__device__ __forceinline__ uint32_t map_rank(uint32_t addr, uint32_t rank) {
  uint32_t out;
  asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(out) : "r"(addr), "r"(rank));
  return out;
}

__device__ __forceinline__ void cluster_barrier() {
  asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  asm volatile(
      "{\n.reg .pred p;\nWAIT_%=:\n"
      "mbarrier.try_wait.parity.acquire.cluster.shared::cta.b64 p, [%0], %1;\n"
      "@!p bra WAIT_%=;\n}\n" ::"r"(smem_addr(bar)),
      "r"(parity)
      : "memory");
}

// 16 bytes to (remote address, remote mbarrier) of another CTA of the cluster, counted by that mbarrier's tx.
__device__ __forceinline__ void st_async16(uint32_t remote, uint32_t remote_bar, uint4 v) {
  asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.b32 [%0], {%1, %2, %3, %4}, [%5];" ::"r"(remote),
               "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w), "r"(remote_bar)
               : "memory");
}

enum Mode { kBarrier, kStoreBarrier, kStAsync, kGather };

// times[i] = CTA 0's clock64 span of repetition i; ns[i] = the same span in %globaltimer ns.
__global__ void __launch_bounds__(kThreads, 1) exchange_kernel(int mode, int bytes, long long* times,
                                                               unsigned long long* ns) {
  extern __shared__ __align__(128) uint8_t smem[];
  __shared__ __align__(8) uint64_t bar;
  cg::cluster_group cluster = cg::this_cluster();
  const uint32_t rank = cluster.block_rank(), C = cluster.num_blocks();
  const int tid = threadIdx.x;
  uint4* inbox = reinterpret_cast<uint4*>(smem);  // CTA 0: (C - 1) slots of `bytes`
  const int chunks = bytes / 16;                  // 16-byte pieces each sender writes
  if (tid == 0) {
    mbar_init(smem_addr(&bar), 1);
    fence_mbarrier_init();
  }
  __syncthreads();
  cluster_barrier();
  const uint32_t inbox0 = map_rank(smem_addr(inbox), 0), bar0 = map_rank(smem_addr(&bar), 0);
  for (int it = 0; it < kIters; ++it) {
    if (mode == kStAsync && rank == 0 && tid == 0)
      mbar_arrive_expect_tx(smem_addr(&bar), static_cast<uint32_t>((C - 1) * bytes));
    cluster_barrier();  // everyone starts together (not timed for the pushes' senders)
    const long long t0 = clock64();
    const uint64_t g0 = globaltimer();
    switch (mode) {
      case kBarrier:
        cluster_barrier();
        break;
      case kStoreBarrier:
        if (rank != 0) {
          for (int c = tid; c < chunks; c += kThreads) {
            const uint32_t dst = inbox0 + ((rank - 1) * chunks + c) * 16;
            asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(dst), "r"(it), "r"(c), "r"(rank),
                         "r"(tid)
                         : "memory");
          }
        }
        cluster_barrier();
        break;
      case kStAsync:
        if (rank != 0) {
          for (int c = tid; c < chunks; c += kThreads) {
            st_async16(inbox0 + ((rank - 1) * chunks + c) * 16, bar0, make_uint4(it, c, rank, tid));
          }
        } else {
          mbar_wait(&bar, it & 1);
          __syncthreads();
        }
        break;
      case kGather:
        cluster_barrier();
        if (rank == 0 && tid < 32) {
          float acc = 0.f;
          for (uint32_t r = 1; r < C; ++r) {
            const uint32_t src = map_rank(smem_addr(inbox) + tid * 16, r);
            float4 v;
            asm volatile("ld.shared::cluster.v4.f32 {%0, %1, %2, %3}, [%4];"
                         : "=f"(v.x), "=f"(v.y), "=f"(v.z), "=f"(v.w)
                         : "r"(src)
                         : "memory");
            acc += v.x + v.y + v.z + v.w;
          }
          if (acc == 12345.f) times[kIters] = 1;  // keep the loads
        }
        __syncthreads();
        break;
    }
    if (rank == 0 && tid == 0) {
      times[it] = clock64() - t0;
      ns[it] = globaltimer() - g0;
    }
  }
  cluster_barrier();  // no CTA exits while another may still write into it
}

void run(const char* name, int mode, int C, int bytes, double ghz) {
  long long* d_times;
  unsigned long long* d_ns;
  CHECK(cudaMalloc(&d_times, (kIters + 1) * sizeof(long long)));
  CHECK(cudaMalloc(&d_ns, kIters * sizeof(unsigned long long)));
  const base_moe::cuda::LaunchConfig config({dim3(C), dim3(kThreads), kSmemBytes, nullptr, C});
  for (int rep = 0; rep < 2; ++rep) {  // the first launch warms up
    CHECK(cudaLaunchKernelEx(config.get(), exchange_kernel, mode, bytes, d_times, d_ns));
    CHECK(cudaDeviceSynchronize());
  }
  std::vector<long long> t(kIters);
  std::vector<unsigned long long> g(kIters);
  CHECK(cudaMemcpy(t.data(), d_times, kIters * sizeof(long long), cudaMemcpyDeviceToHost));
  CHECK(cudaMemcpy(g.data(), d_ns, kIters * sizeof(unsigned long long), cudaMemcpyDeviceToHost));
  std::sort(t.begin(), t.end());
  std::sort(g.begin(), g.end());
  std::printf("%-10s C=%2d bytes/CTA=%6d  median %7.0f ns  p90 %7.0f ns  (globaltimer median %6llu ns)\n", name, C,
              bytes, t[kIters / 2] / ghz, t[kIters * 9 / 10] / ghz, g[kIters / 2]);
  CHECK(cudaFree(d_times));
  CHECK(cudaFree(d_ns));
}

int main() {
  int clock_khz = 0;
  CHECK(cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, 0));
  const double ghz = clock_khz / 1e6;
  CHECK(cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeNonPortableClusterSizeAllowed, 1));
  CHECK(cudaFuncSetAttribute(exchange_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmemBytes));
  std::printf("SM clock %.2f GHz (clock64 spans converted with it)\n", ghz);
  for (int C : {8, 16}) {
    run("barrier", kBarrier, C, 16, ghz);
    run("gather", kGather, C, 16, ghz);
    for (int bytes : {64, 1024, 4096}) {
      run("store+bar", kStoreBarrier, C, bytes, ghz);
      run("st.async", kStAsync, C, bytes, ghz);
    }
  }
  return 0;
}
