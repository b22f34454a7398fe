// spes-ext: how every C entry point reports failure. A C++ exception becomes a malloc'd
// message returned to Rust (NULL on success), which frees it with spes_ext_free_error.

#pragma once

#include <cstdlib>
#include <cstring>
#include <exception>

namespace spes_ext {

inline char* copy_message(const char* what) {
  size_t n = std::strlen(what) + 1;
  char* out = static_cast<char*>(std::malloc(n));
  if (out != nullptr) std::memcpy(out, what, n);
  return out;
}

// Runs body; returns NULL, or the message of the exception it threw.
template <typename F>
char* guarded(F&& body) {
  try {
    body();
    return nullptr;
  } catch (const std::exception& e) {
    return copy_message(e.what());
  } catch (...) {
    return copy_message("unknown C++ exception");
  }
}

}  // namespace spes_ext
