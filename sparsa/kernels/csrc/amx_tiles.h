// AMX tile registers for the bf16 kernels (row_group_amx.h, bitmask_amx_bf16.cpp): the tile macros, the
// one tile configuration they use, and whether Linux lets this process use the tiles. With
// SPARSA_AMX_EMULATE the macros run software tiles instead, so the tests check each kernel's data movement
// on CPUs without AMX.
#pragma once
#include <sys/syscall.h>
#include <unistd.h>
#include <cpuid.h>
#include <cstdint>
#include <cstring>
#ifndef SPARSA_AMX_EMULATE
#include <immintrin.h>
#endif

// No target region here: the macros expand inside each kernel's own, and the software tiles must run on
// any x86-64 CPU.
namespace amx {

#ifdef SPARSA_AMX_EMULATE
// Software tiles (row_group_linear_amxemu.cpp): the same data movement and TDPBF16PS's arithmetic in
// plain C++, so the tests check the packing, tails and epilogue on CPUs without AMX.
struct alignas(64) EmuTile {
    uint8_t b[16][64];
};
inline thread_local EmuTile emu_tiles[8];
inline float emu_bf16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    const uint32_t u = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
}
inline void emu_load(int t, const void* base, long stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(emu_tiles[t].b[r], static_cast<const char*>(base) + r * stride, 64);
}
inline void emu_store(int t, void* base, long stride) {
    for (int r = 0; r < 16; ++r) std::memcpy(static_cast<char*>(base) + r * stride, emu_tiles[t].b[r], 64);
}
// C[m][n] += sum over pair rows p of A[m][2p] B[p][2n] + A[m][2p+1] B[p][2n+1] (fp32 sums)
inline void emu_dpbf16(int c, int a, int b) {
    for (int m = 0; m < 16; ++m)
        for (int n = 0; n < 16; ++n) {
            float acc;
            std::memcpy(&acc, emu_tiles[c].b[m] + 4 * n, 4);
            for (int p = 0; p < 16; ++p)
                acc += emu_bf16(emu_tiles[a].b[m] + 4 * p) * emu_bf16(emu_tiles[b].b[p] + 4 * n) +
                       emu_bf16(emu_tiles[a].b[m] + 4 * p + 2) * emu_bf16(emu_tiles[b].b[p] + 4 * n + 2);
            std::memcpy(emu_tiles[c].b[m] + 4 * n, &acc, 4);
        }
}
#define SPARSA_TILE_ZERO(t) std::memset(&amx::emu_tiles[t], 0, sizeof(amx::EmuTile))
#define SPARSA_TILE_LOAD(t, base, stride) amx::emu_load(t, base, stride)
#define SPARSA_TILE_STORE(t, base, stride) amx::emu_store(t, base, stride)
#define SPARSA_TILE_DP(c, a, b) amx::emu_dpbf16(c, a, b)
#define SPARSA_TILE_CONFIG(cfg) (void)(cfg)
#define SPARSA_TILE_RELEASE() (void)0
#else
// tileloadd reads memory the compiler does not see (GCC's macro has no memory clobber): order the
// stores that built a B tile before it.
#define SPARSA_TILE_LOAD(t, base, stride)   \
    do {                                     \
        asm volatile("" ::: "memory");       \
        _tile_loadd(t, base, stride);        \
    } while (0)
#define SPARSA_TILE_ZERO(t) _tile_zero(t)
#define SPARSA_TILE_STORE(t, base, stride) _tile_stored(t, base, stride)
#define SPARSA_TILE_DP(c, a, b) _tile_dpbf16ps(c, a, b)
#define SPARSA_TILE_CONFIG(cfg) _tile_loadconfig(cfg)
#define SPARSA_TILE_RELEASE() _tile_release()
#endif

// every tile 16 rows x 64 bytes (palette 1)
struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
    Config() {
        for (int i = 0; i < 8; ++i) colsb[i] = 64, rows[i] = 16;
    }
};

}  // namespace amx

// Whether this CPU has AMX-BF16 and Linux grants this process tile data: 0 yes; 1 no AMX-BF16 (CPUID 7.0 EDX
// bits 22 and 24) or no AVX-512; 2 Linux refused tile data (arch_prctl ARCH_REQ_XCOMP_PERM for XTILEDATA,
// asked once per process). Software tiles: 0 wherever AVX-512 runs.
static inline int sparsa_amx_permitted() {
    static const int status = [] {
        if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
              __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512bw")))
            return 1;  // the hardware alone: the status is cached, SPARSA_ISA is read per call
#ifndef SPARSA_AMX_EMULATE
#if defined(__x86_64__) && defined(__linux__)
        unsigned a = 0, b = 0, c = 0, d = 0;
        if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return 1;
        if (!((d >> 22) & 1u) || !((d >> 24) & 1u)) return 1;
        constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
        if (syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) != 0) return 2;
#else
        return 1;
#endif
#endif
        return 0;
    }();
    return status;
}
