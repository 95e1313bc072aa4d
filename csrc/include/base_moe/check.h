// BASE_MOE_CHECK(cond, parts...): like TORCH_CHECK, but the message is assembled by appending its parts to a
// std::string, never through iostreams. Stream code instantiated in this library calls into whichever libstdc++
// the process loaded; where that differs from the headers the library was compiled with, formatting a number
// crashed the process instead of raising (seen on the H200 image: gcc 13 headers, torch 2.11, Python 3.12).
// The throw itself happens in libc10 (c10::detail::torchCheckFail), so Python sees the usual RuntimeError.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <cstdio>
#include <string>
#include <type_traits>

namespace base_moe::detail {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }
inline void append(std::string& s, double v) {
  char buffer[32];
  std::snprintf(buffer, sizeof(buffer), "%g", v);
  s += buffer;
}
template <typename T, std::enable_if_t<std::is_integral_v<T> && !std::is_same_v<T, bool>, int> = 0>
void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, c10::IntArrayRef v) {
  s += '[';
  for (size_t i = 0; i < v.size(); ++i) {
    if (i > 0) s += ", ";
    s += std::to_string(v[i]);
  }
  s += ']';
}

template <typename... Parts>
std::string message(const Parts&... parts) {
  std::string s;
  (append(s, parts), ...);
  return s;
}

}  // namespace base_moe::detail

#define BASE_MOE_CHECK(cond, ...)                                                                           \
  do {                                                                                                       \
    if (C10_UNLIKELY(!(cond))) {                                                                             \
      ::c10::detail::torchCheckFail(__func__, __FILE__, static_cast<uint32_t>(__LINE__),                    \
                                    ::base_moe::detail::message(__VA_ARGS__));                              \
    }                                                                                                        \
  } while (0)
