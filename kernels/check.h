// Argument checks that raise a Python RuntimeError without formatting numbers through iostreams.
//
// Why: with g++ 13.3 and torch 2.11, a TORCH_CHECK whose message streams an integer crashes the process
// (SIGSEGV inside std::ostream::_M_insert<long>, instantiated in the extension itself), so a failing
// check would kill Python instead of raising. QK_CHECK builds the message as a std::string with
// std::to_string and hands TORCH_CHECK that one string, which c10 passes through without touching a stream.
#pragma once

#include <c10/core/Device.h>
#include <c10/core/ScalarType.h>
#include <c10/util/ArrayRef.h>
#include <c10/util/Exception.h>

#include <string>
#include <type_traits>

namespace qk {

inline void append(std::string& s, const char* v) { s += v; }
inline void append(std::string& s, const std::string& v) { s += v; }
inline void append(std::string& s, bool v) { s += v ? "true" : "false"; }
template <typename T, std::enable_if_t<std::is_arithmetic_v<T> && !std::is_same_v<T, bool>, int> = 0>
inline void append(std::string& s, T v) {
  s += std::to_string(v);
}
inline void append(std::string& s, c10::IntArrayRef v) {
  s += "[";
  for (size_t i = 0; i < v.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(v[i]);
  }
  s += "]";
}
inline void append(std::string& s, c10::ScalarType v) { s += c10::toString(v); }
inline void append(std::string& s, const c10::Device& v) { s += v.str(); }

template <typename... Args>
std::string message(const Args&... args) {
  std::string s;
  (append(s, args), ...);
  return s;
}

}  // namespace qk

#define QK_CHECK(cond, ...) TORCH_CHECK(cond, ::qk::message(__VA_ARGS__))
