// What the host code tells the kernel launchers about an operand (csrc/select_cuda.cpp, csrc/rms_norm_cuda.cpp): its
// floating dtype as an enum the .cu files switch on (base_moe::float_dtype in checks.h maps a tensor to it), and
// whether its pointer allows the kernels' 16-byte accesses. Plain C++: kernel headers include it.
#pragma once

#include <cstdint>

namespace base_moe {

enum class FloatDtype : int { kFloat = 0, kHalf = 1, kBFloat16 = 2 };

// Whether ptr is 16-byte aligned; null (an absent operand) counts as aligned.
inline bool aligned16(const void* ptr) {
  return ptr == nullptr || reinterpret_cast<uintptr_t>(ptr) % 16 == 0;
}

}  // namespace base_moe
