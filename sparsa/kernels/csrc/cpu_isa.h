// Run-time instruction-set choice shared by the kernels that carry AVX-512 tiles.
#pragma once
#include <cstdlib>
#include <cstring>

// The path SPARSA_ISA asks for: 1 avx2 (or portable), 2 avx512, 3 amx or unset. SPARSA_NO_AVX512 (not
// "0") also means avx2. Read per call (cheap) so tests can cover every path in one process; Python
// rejects unknown values before any kernel runs.
static inline int sparsa_isa_cap() {
    const char* off = std::getenv("SPARSA_NO_AVX512");
    if (off && off[0] && !(off[0] == '0' && off[1] == 0)) return 1;
    const char* v = std::getenv("SPARSA_ISA");
    if (!v || !v[0]) return 3;
    if (!std::strcmp(v, "avx2") || !std::strcmp(v, "portable")) return 1;
    if (!std::strcmp(v, "avx512")) return 2;
    return 3;
}

// True when this CPU runs AVX-512 F/VL/DQ/BW and SPARSA_ISA / SPARSA_NO_AVX512 allow it.
static inline bool sparsa_cpu_avx512_enabled() {
#if defined(__GNUC__) && defined(__x86_64__)
    static const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                            __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw");
    return cpu && sparsa_isa_cap() >= 2;
#else
    return false;
#endif
}

// True when the AVX-512 path is enabled and the CPU also has AVX512-BF16 (VDPBF16PS).
static inline bool sparsa_cpu_dpbf16_enabled() {
#if defined(__GNUC__) && defined(__x86_64__)
    static const bool bf16 = __builtin_cpu_supports("avx512bf16");
    return bf16 && sparsa_cpu_avx512_enabled();
#else
    return false;
#endif
}
