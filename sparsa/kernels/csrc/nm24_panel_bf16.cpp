// Y[T, R] = X[T, K] W^T (+ bias) for a bf16 W with 2:4 sparsity (two kept columns in every group of four)
// and many bf16 tokens, on CPUs with AVX512-BF16: sparse compute that reuses each load of X across a block
// of rows, which the bitmask panel kernel (any pattern) cannot, so it is bound by its X loads.
//
// A row keeps one of six column pairs (a, b) of a group. The six pairs form three pairings of the group,
// {01, 23}, {02, 13}, {03, 12}, and X is packed once per call into, for every group and every 16 tokens,
// the six vectors of bf16 pairs (x[t][a], x[t][b]) that VDPBF16PS takes: 384 bytes a group, in L1 while a
// block of rows passes over it. A row's group then costs one VDPBF16PS per 16 tokens, its two packed
// values broadcast against the slot its pair selects (a byte offset in the weight's repacked block): half
// the dot products of the dense GEMM, and no shuffles in the inner loop.
//
// Panels are 32 tokens (two 16-token halves share each broadcast), or one panel of 16 for a call of at
// most 16 tokens (batched decoding). Each thread takes super blocks of rows, repacks their values and
// slots (read from the bit rows) group-major so that one pointer walks a block of BLOCK_ROWS32 (or
// BLOCK_ROWS16) rows, whose sums stay in registers, and runs every panel over them chunk by chunk: a chunk
// of a panel stays in L1 while every block of the super block passes over it.
//
// Only kept columns are multiplied, so a NaN or Inf of X at a dropped column would not reach the output as
// it does in F.linear: the entry point checks X first and returns 1 (the caller then runs another
// strategy, whose result spreads it).
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
#include "bf16_finite.h"
#include "cpu_isa.h"
#include "panel_store.h"
#include "thread_scratch.h"
#include "transpose8.h"

namespace {

constexpr int SLOTS = 6;
constexpr int SLOT_BYTES = 64;  // 16 tokens x (x[t][a], x[t][b])
// slot s holds the pair (SLOT_A[s], SLOT_B[s]) of a group's columns: what sparsa/kernels/nm24.py encodes
constexpr int SLOT_A[SLOTS] = {0, 2, 0, 1, 0, 1};
constexpr int SLOT_B[SLOTS] = {1, 3, 2, 3, 3, 2};
// a group's four mask bits (bit c: column c kept) -> its slot; a nibble not keeping exactly two columns
// (never passed: the caller checks the pattern) maps to slot 0, so it cannot index past a group
alignas(16) constexpr uint8_t NIBBLE_SLOT[16] = {0, 0, 0, 0, 0, 2, 5, 0, 0, 4, 3, 0, 1, 0, 0, 0};
constexpr int BLOCK_ROWS32 = 8;  // x 2 token halves: 16 sums in registers
constexpr int BLOCK_ROWS16 = 16;
constexpr int CHUNK32 = 24;  // groups: 18 KiB of a 32-token panel
constexpr int CHUNK16 = 48;  // 18 KiB of a 16-token panel
constexpr int SUPER_ROWS = 192;  // rows repacked together (at most): 5 bytes a group each
constexpr int64_t PANEL_BLOCK_BYTES = 8 << 20;  // a thread's panels at a time (at least one)

}  // namespace

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_NM24_BF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")
namespace {

// The six slot vectors of groups [g0, g1) for tokens t0..t0+nt-1 (nt <= 16; the other lanes zero), each
// group's at out + g * gstride (bytes). Word 4t + c of the two loaded vectors is x[t0 + t][4g + c].
void pack_groups(const uint16_t* x, int64_t K, int64_t t0, int nt, int64_t g0, int64_t g1, char* out,
                 int64_t gstride) {
    alignas(64) uint64_t tok[16];
    __m512i idx[SLOTS];
    for (int s = 0; s < SLOTS; ++s) {
        alignas(64) uint16_t w[32];
        for (int j = 0; j < 32; ++j) w[j] = (uint16_t)(4 * (j / 2) + ((j & 1) ? SLOT_B[s] : SLOT_A[s]));
        idx[s] = _mm512_load_si512(w);
    }
    for (int t = nt; t < 16; ++t) tok[t] = 0;
    for (int64_t g = g0; g < g1; ++g) {
        for (int t = 0; t < nt; ++t) std::memcpy(&tok[t], x + (t0 + t) * K + 4 * g, 8);
        const __m512i lo = _mm512_load_si512(tok), hi = _mm512_load_si512(tok + 8);
        char* o = out + g * gstride;
        for (int s = 0; s < SLOTS; ++s)
            _mm512_store_si512(o + s * SLOT_BYTES, _mm512_permutex2var_epi16(lo, idx[s], hi));
    }
}

// Rows [0, nr) of vals (row stride G) and their bit rows (stride kb bytes; rows nr..RB-1 zero weights)
// group-major, so that one pointer walks a block: wb[g * RB + i] the value pair of row i in group g,
// sb[g * RB + i] its slot, the pair that group's four mask bits keep (NIBBLE_SLOT). 8x8 transposes of 8 rows
// x 8 groups (values: 32-bit, slots: bytes); a scalar repack cost a short call as much as its products.
template <int RB>
void repack(const uint32_t* vals, const uint8_t* bits, int64_t kb, int64_t G, int64_t nr, uint32_t* wb, uint8_t* sb) {
    static_assert(RB % 8 == 0, "rows are transposed 8 at a time");
    const int64_t G8 = G & ~int64_t(7);
    const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(NIBBLE_SLOT));
    const __m128i low4 = _mm_set1_epi8(0x0f);
    for (int o = 0; o < RB; o += 8) {
        static const uint32_t zv[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        const bool real[8] = {o + 0 < nr, o + 1 < nr, o + 2 < nr, o + 3 < nr,
                              o + 4 < nr, o + 5 < nr, o + 6 < nr, o + 7 < nr};
        for (int64_t g = 0; g < G8; g += 8) {
            __m256 r[8];
            __m128i b[8];
            for (int k = 0; k < 8; ++k) {
                const uint32_t* v = real[k] ? vals + (o + k) * G + g : zv;
                r[k] = _mm256_castsi256_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)));
                if (!real[k]) {
                    b[k] = _mm_setzero_si128();  // slot 0 against zero weights
                    continue;
                }
                uint32_t m;  // groups g..g+7: 4 bytes, the low nibble of each the earlier group
                std::memcpy(&m, bits + (o + k) * kb + g / 2, 4);
                const __m128i w = _mm_cvtsi32_si128((int)m);
                const __m128i nib = _mm_unpacklo_epi8(_mm_and_si128(w, low4), _mm_and_si128(_mm_srli_epi16(w, 4), low4));
                b[k] = _mm_shuffle_epi8(lut, nib);
            }
            transpose8(r);  // r[j]: group g + j, rows o..o+7
            for (int j = 0; j < 8; ++j)
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(wb + (g + j) * RB + o), _mm256_castps_si256(r[j]));
            const __m128i t0 = _mm_unpacklo_epi8(b[0], b[1]), t1 = _mm_unpacklo_epi8(b[2], b[3]);
            const __m128i t2 = _mm_unpacklo_epi8(b[4], b[5]), t3 = _mm_unpacklo_epi8(b[6], b[7]);
            const __m128i u0 = _mm_unpacklo_epi16(t0, t1), u1 = _mm_unpackhi_epi16(t0, t1);  // groups 0-3, 4-7; rows 0-3
            const __m128i u2 = _mm_unpacklo_epi16(t2, t3), u3 = _mm_unpackhi_epi16(t2, t3);  // rows 4-7
            const __m128i c[4] = {_mm_unpacklo_epi32(u0, u2), _mm_unpackhi_epi32(u0, u2), _mm_unpacklo_epi32(u1, u3),
                                  _mm_unpackhi_epi32(u1, u3)};  // c[j]: groups 2j, 2j + 1, 8 rows each
            for (int j = 0; j < 4; ++j) {
                _mm_storel_epi64(reinterpret_cast<__m128i*>(sb + (g + 2 * j) * RB + o), c[j]);
                _mm_storel_epi64(reinterpret_cast<__m128i*>(sb + (g + 2 * j + 1) * RB + o), _mm_unpackhi_epi64(c[j], c[j]));
            }
        }
        for (int64_t g = G8; g < G; ++g)
            for (int k = 0; k < 8; ++k) {
                const uint8_t byte = real[k] ? bits[(o + k) * kb + g / 2] : 0;
                wb[g * RB + o + k] = real[k] ? vals[(o + k) * G + g] : 0;
                sb[g * RB + o + k] = real[k] ? NIBBLE_SLOT[(byte >> (4 * (g & 1))) & 15] : 0;
            }
    }
}

// Groups [g0, g1) of one panel (H halves of 16 tokens) for a repacked block of RB rows, into sums[i][16 H],
// which start from zero when first.
template <int RB, int H>
void rows_chunk(const char* __restrict xp, const uint32_t* __restrict wb, const uint8_t* __restrict sb, int64_t g0,
                int64_t g1, bool first, float* __restrict sums) {
    constexpr int64_t GBYTES = (int64_t)H * SLOTS * SLOT_BYTES;
    __m512 acc[RB][H];
#pragma GCC unroll 32
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) acc[i][h] = first ? _mm512_setzero_ps() : _mm512_load_ps(sums + (i * H + h) * 16);
    wb += g0 * RB;
    sb += g0 * RB;
    for (int64_t g = g0; g < g1; ++g, wb += RB, sb += RB) {
        const char* xg = xp + g * GBYTES;
#pragma GCC unroll 32
        for (int i = 0; i < RB; ++i) {
            const __m512bh w = (__m512bh)_mm512_set1_epi32((int)wb[i]);
            const char* xs = xg + ((int64_t)sb[i] << 6);
#pragma GCC unroll 4
            for (int h = 0; h < H; ++h)
                acc[i][h] = _mm512_dpbf16_ps(acc[i][h], (__m512bh)_mm512_load_si512(xs + h * SLOTS * SLOT_BYTES), w);
        }
    }
#pragma GCC unroll 32
    for (int i = 0; i < RB; ++i)
#pragma GCC unroll 4
        for (int h = 0; h < H; ++h) _mm512_store_ps(sums + (i * H + h) * 16, acc[i][h]);
}

// One panel's H halves of 16 tokens from token t0 (lanes past T zero).
template <int H>
void pack_panel(const uint16_t* x, int64_t T, int64_t K, int64_t t0, char* out) {
    constexpr int64_t GBYTES = (int64_t)H * SLOTS * SLOT_BYTES;
    for (int h = 0; h < H; ++h) {
        const int nt = (int)std::max<int64_t>(0, std::min<int64_t>(16, T - t0 - 16 * h));
        pack_groups(x, K, t0 + 16 * h, nt, 0, K / 4, out + h * SLOTS * SLOT_BYTES, GBYTES);
    }
}

// RB: rows whose sums stay in registers; GC: groups per chunk of a panel, kept in L1 while every block of a
// super block passes over it. A work item is a super block of at most SUPER_ROWS rows (repacked once per
// block of tokens) and a share of the panels. Each thread packs the panels its items read into its own
// buffer, a block of tokens at a time: panels one core packed and another read ran up to 1.4x slower, by
// run.
template <int RB, int H, int GC>
void run(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, const uint32_t* vals, int64_t R,
         const float* bias, uint16_t* y, int nthreads) {
    constexpr int TBW = 16 * H;
    constexpr int64_t GBYTES = (int64_t)H * SLOTS * SLOT_BYTES;
    const int64_t G = K / 4, kb = (K + 7) / 8, npan = (T + TBW - 1) / TBW, pbytes = std::max<int64_t>(64, G * GBYTES);
    const int64_t nrb = (R + RB - 1) / RB, per_sb = (SUPER_ROWS / RB);
    // Threads split the tokens where each repacking the whole weight costs less than each packing every
    // panel (few rows, many tokens), else the rows (and the tokens too when rows are few).
    const bool by_tokens = npan >= nthreads && R * 5 < npan * GBYTES;
    const int64_t want = by_tokens ? 1 : nthreads;
    int64_t nsb = std::max<int64_t>(want, (nrb + per_sb - 1) / per_sb);
    nsb = std::min(nrb, (nsb + want - 1) / want * want);
    const int64_t SB = (nrb + nsb - 1) / nsb * RB;
    nsb = (R + SB - 1) / SB;
    const int64_t npg = by_tokens ? nthreads
                        : nsb >= nthreads ? 1
                                          : std::min<int64_t>(npan, (nthreads + nsb - 1) / nsb);
    const int64_t pan_per = (npan + npg - 1) / npg;
    const int64_t pblk = std::max<int64_t>(1, std::min<int64_t>(npan, PANEL_BLOCK_BYTES / pbytes));
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>(nthreads, nsb * npg));
#pragma omp parallel num_threads(nth)
    {
        char* panels = sparsa_thread_scratch<char, 0>((size_t)(pblk * pbytes));
        uint32_t* wb = sparsa_thread_scratch<uint32_t, 1>((size_t)(SB * G));
        uint8_t* sb = sparsa_thread_scratch<uint8_t, 2>((size_t)(SB * G));
        float* sums = sparsa_thread_scratch<float, 3>((size_t)(SB * TBW));
        std::vector<char> packed((size_t)pblk);
        for (int64_t q0 = 0; q0 < npan; q0 += pblk) {  // every thread walks the same blocks of tokens
            const int64_t q1 = std::min(npan, q0 + pblk);
            std::fill(packed.begin(), packed.end(), 0);
#pragma omp for schedule(static) nowait
            for (int64_t item = 0; item < nsb * npg; ++item) {
                const int64_t share = item / nsb, b = item % nsb;  // a thread's items: one share of panels
                const int64_t p0 = std::max(q0, share * pan_per), p1 = std::min(q1, (share + 1) * pan_per);
                const int64_t r0 = b * SB, rows = std::min<int64_t>(SB, R - r0);
                if (p0 >= p1) continue;
                for (int64_t p = p0; p < p1; ++p)
                    if (!packed[p - q0]) pack_panel<H>(x, T, K, p * TBW, panels + (p - q0) * pbytes), packed[p - q0] = 1;
                for (int64_t rb = 0; rb < rows; rb += RB)
                    repack<RB>(vals + (r0 + rb) * G, bits + (r0 + rb) * kb, kb, G, std::min<int64_t>(RB, rows - rb),
                               wb + rb * G, sb + rb * G);
                for (int64_t p = p0; p < p1; ++p) {
                    const char* xp = panels + (p - q0) * pbytes;
                    for (int64_t g0 = 0; g0 < G || g0 == 0; g0 += GC) {
                        const int64_t g1 = std::min<int64_t>(G, g0 + GC);
                        for (int64_t rb = 0; rb < rows; rb += RB)
                            rows_chunk<RB, H>(xp, wb + rb * G, sb + rb * G, g0, g1, g0 == 0, sums + rb * TBW);
                    }
                    const int nt = (int)std::min<int64_t>(TBW, T - p * TBW);
                    sparsa_panel::store_block(sums, TBW, nt, r0, rows, R, bias, y + p * TBW * R, false);
                }
            }
        }
    }
}

}  // namespace
#pragma GCC pop_options
#endif

namespace {

bool nm24_available() {
#ifdef SPARSA_HAVE_NM24_BF16
    return sparsa_cpu_dpbf16_enabled();
#else
    return false;
#endif
}

}  // namespace

extern "C" {

// 1 when sparsa_nm24_panel_bf16 runs on this CPU (AVX512-BF16, SPARSA_ISA >= avx512)
int sparsa_nm24_has_panel_bf16() { return nm24_available() ? 1 : 0; }

// x: bf16 [T, K], K a multiple of 4; bits: uint8 [R, ceil(K / 8)], the Bitmask layout's bit rows (bit j % 8
// of byte j / 8: column j kept), keeping exactly two of every four columns (the caller checks); values: bf16
// [R, K / 4, 2], the kept pairs' values in column order; bias: fp32 [R] or null; y: bf16 [T, R], fp32
// accumulation rounded once (nearest even). Returns 0 when done; 1 when X holds a NaN or Inf (y untouched);
// -1 when this CPU or build has no such kernel; -2 when K is not a multiple of 4.
int sparsa_nm24_panel_bf16(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, const uint16_t* values,
                           int64_t R, const float* bias, uint16_t* y, int nthreads) {
    if (!nm24_available()) return -1;
    if (K % 4) return -2;
#ifdef SPARSA_HAVE_NM24_BF16
    if (!sparsa_bf16_finite(x, T * K)) return 1;
    if (T <= 0 || R <= 0) return 0;
    const uint32_t* vals = reinterpret_cast<const uint32_t*>(values);
    if (T <= 16) run<BLOCK_ROWS16, 1, CHUNK16>(x, T, K, bits, vals, R, bias, y, nthreads);
    else run<BLOCK_ROWS32, 2, CHUNK32>(x, T, K, bits, vals, R, bias, y, nthreads);
    return 0;
#else
    return -1;
#endif
}

}  // extern "C"
