// Per-thread buffers kept between calls: fresh pages on every call (a panel buffer is MiBs) cost a short
// product more than its arithmetic.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

// n elements of E in the calling thread's 64-byte aligned buffer ID (grown, never shrunk); distinct IDs
// (per kernel) are distinct buffers.
template <class E, int ID>
static inline E* sparsa_thread_scratch(size_t n) {
    thread_local std::vector<char> buf;
    const size_t bytes = n * sizeof(E) + 128;
    if (buf.size() < bytes) buf.resize(bytes);
    char* p = buf.data();
    return reinterpret_cast<E*>(p + ((64 - (reinterpret_cast<uintptr_t>(p) & 63)) & 63));
}
