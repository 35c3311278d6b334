// Run-time instruction-set choice shared by the kernels that carry AVX-512 tiles.
#pragma once
#include <cstdlib>

// True when this CPU runs AVX-512 F/VL/DQ/BW and SPARSA_NO_AVX512 is unset or "0". The variable is read
// per call (cheap) so tests can cover both paths in one process.
static inline bool sparsa_cpu_avx512_enabled() {
#if defined(__GNUC__) && defined(__x86_64__)
    static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
    if (!cpu) return false;
    const char* off = std::getenv("SPARSA_NO_AVX512");
    return !(off && off[0] && !(off[0] == '0' && off[1] == 0));
#else
    return false;
#endif
}
