// Y = X W^T + b with W in the Bitmask layout (per-row bitmask + packed values), for decoding:
// a few tokens, weights streamed from memory once. Each group of 8 columns expands its packed values
// into a vector with one in-lane byte shuffle (pattern from a 256-entry table keyed by the mask byte,
// zeroing the dropped lanes) and multiplies with the dense X columns, so the work per byte read stays
// small enough to run near memory bandwidth. On CPUs with AVX-512F a 16-column path expands each pair
// of mask bytes with one masked expand (vexpandps), about a quarter of the AVX2 path's instructions per
// column. A second entry point expands rows to dense, for the prefill path (expand a block of rows into
// cache, then a BLAS GEMM on it).
#include <immintrin.h>
#include <omp.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16.h"
#include "cpu_isa.h"

namespace {

// kNibbles[m]: a byte shuffle that expands one group's fp32 values, loaded as 8 floats starting 4 before
// the high nibble's first value (vp + popcount(m & 15) - 4). Both nibbles' values then sit in their own
// 128-bit half: the low nibble's at the top of the low half, the high nibble's at the bottom of the high
// half. So the expansion is one in-lane shuffle that also zeroes the dropped lanes (index 0x80): cheaper
// than a cross-lane permute plus a blend, which bounded the AVX2 loop at high sparsity.
struct NibbleTables {
    alignas(64) uint8_t shuf[256][32];
    NibbleTables() {
        for (int m = 0; m < 256; ++m) {
            const int low = __builtin_popcount(m & 15);
            for (int half = 0; half < 2; ++half) {
                int k = half ? 0 : 4 - low;  // position, within the half, of the nibble's first value
                for (int i = 0; i < 4; ++i) {
                    uint8_t* lane = shuf[m] + 16 * half + 4 * i;
                    const bool kept = m >> (4 * half + i) & 1;
                    for (int b = 0; b < 4; ++b) lane[b] = kept ? (uint8_t)(4 * k + b) : 0x80;
                    k += kept;
                }
            }
        }
    }
};
const NibbleTables kNibbles;

// kShuf[m]: a byte shuffle of the group's 8 packed bf16 values (16 bytes, in both 128-bit halves) into
// 8 fp32 lanes: a kept lane takes its value's two bytes as the high half of the float, every other
// byte is zeroed (index 0x80). bf16 expands with one in-lane shuffle instead of widen, shift, permute
// and blend, which bounded the bf16 loop by shuffle throughput rather than by memory.
struct Bf16Tables {
    alignas(64) uint8_t shuf[256][32];
    Bf16Tables() {
        for (int m = 0; m < 256; ++m) {
            int k = 0;
            for (int i = 0; i < 8; ++i) {
                uint8_t* lane = shuf[m] + 4 * i;  // lanes 0-3: low 128 bits, 4-7: high (same bytes there)
                lane[0] = lane[1] = 0x80;
                if (m >> i & 1) {
                    lane[2] = (uint8_t)(2 * k);
                    lane[3] = (uint8_t)(2 * k + 1);
                    ++k;
                } else {
                    lane[2] = lane[3] = 0x80;
                }
            }
        }
    }
};
const Bf16Tables kBf16Tables;

// the group's 8 weights from the 8 floats at q = vp + popcount(m & 15) - 4, zero where the mask bit is clear
inline __m256 expand8_from(const float* q, unsigned m) {
    const __m256i v = _mm256_castps_si256(_mm256_loadu_ps(q));
    const __m256i sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(kNibbles.shuf[m]));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(v, sh));
}

// the group's 8 weights, zero where the mask bit is clear (reads vp[-4, 8): row_values pads both ends)
inline __m256 expand8(const float* vp, unsigned m) { return expand8_from(vp + __builtin_popcount(m & 15u) - 4, m); }

inline __m256 expand8(const uint16_t* vp, unsigned m) {
    const __m256i src = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(vp)));
    const __m256i sh = _mm256_load_si256(reinterpret_cast<const __m256i*>(kBf16Tables.shuf[m]));
    return _mm256_castsi256_ps(_mm256_shuffle_epi8(src, sh));
}

// how far ahead of the packed values the stream kernel prefetches (the hardware prefetcher alone
// leaves the single stream well short of the bandwidth a dense GEMV reaches)
constexpr int kPrefetchBytes = 4096;
// how far ahead the AVX-512 loops also fetch into L1 (from L2, where the far prefetch put it)
constexpr int kNearPrefetchBytes = 512;

inline float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

// the weights of the four groups of one 32-bit mask word m whose values start at vp. Each group's load
// address is one popcount of a prefix of m, so the pointer advances once per word (a per-group pointer
// chain would bound the loop by its latency).
inline void expand_word(const float* vp, uint32_t m, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
    w0 = expand8_from(vp + __builtin_popcount(m & 0xfu) - 4, m & 0xffu);
    w1 = expand8_from(vp + __builtin_popcount(m & 0xfffu) - 4, (m >> 8) & 0xffu);
    w2 = expand8_from(vp + __builtin_popcount(m & 0xfffffu) - 4, (m >> 16) & 0xffu);
    w3 = expand8_from(vp + __builtin_popcount(m & 0xfffffffu) - 4, m >> 24);
}

inline void expand_word(const uint16_t* vp, uint32_t m, __m256& w0, __m256& w1, __m256& w2, __m256& w3) {
    const int p1 = __builtin_popcount(m & 0xffu), p2 = __builtin_popcount(m & 0xffffu);
    const int p3 = __builtin_popcount(m & 0xffffffu);
    w0 = expand8(vp, m & 0xffu);
    w1 = expand8(vp + p1, (m >> 8) & 0xffu);
    w2 = expand8(vp + p2, (m >> 16) & 0xffu);
    w3 = expand8(vp + p3, m >> 24);
}

// out[t] = sum over the row's kept columns c of w[c] * x[t][c], for NT tokens of the padded X panel
// (row stride kp, zero past K). Four groups (32 columns, one mask word) per step; NA accumulators per
// token hide the FMA latency.
template <int NT, class V>
inline void row_dot(const uint8_t* bits, int64_t kb, const V* vp, const float* x, int64_t kp, float* out) {
    constexpr int NA = NT <= 2 ? 4 : 2;
    __m256 acc[NT][NA];
    for (int t = 0; t < NT; ++t)
        for (int a = 0; a < NA; ++a) acc[t][a] = _mm256_setzero_ps();
    int64_t g = 0;
    for (; g + 4 <= kb; g += 4) {
        uint32_t m;
        std::memcpy(&m, bits + g, 4);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kPrefetchBytes, _MM_HINT_T0);
        __m256 w0, w1, w2, w3;
        expand_word(vp, m, w0, w1, w2, w3);
        vp += __builtin_popcount(m);
        const float* xc = x + 8 * g;
        for (int t = 0; t < NT; ++t) {
            const float* xt = xc + t * kp;
            acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(xt), acc[t][0]);
            acc[t][1 % NA] = _mm256_fmadd_ps(w1, _mm256_loadu_ps(xt + 8), acc[t][1 % NA]);
            acc[t][2 % NA] = _mm256_fmadd_ps(w2, _mm256_loadu_ps(xt + 16), acc[t][2 % NA]);
            acc[t][3 % NA] = _mm256_fmadd_ps(w3, _mm256_loadu_ps(xt + 24), acc[t][3 % NA]);
        }
    }
    for (; g < kb; ++g) {
        const unsigned m0 = bits[g];
        const __m256 w0 = expand8(vp, m0);
        vp += __builtin_popcount(m0);
        for (int t = 0; t < NT; ++t) acc[t][0] = _mm256_fmadd_ps(w0, _mm256_loadu_ps(x + 8 * g + t * kp), acc[t][0]);
    }
    for (int t = 0; t < NT; ++t) {
        __m256 s = acc[t][0];
        for (int a = 1; a < NA; ++a) s = _mm256_add_ps(s, acc[t][a]);
        out[t] = hsum(s);
    }
}

template <class V>
inline void row_dot_n(int nt, const uint8_t* bits, int64_t kb, const V* vp, const float* x, int64_t kp, float* out) {
    switch (nt) {
        case 1: row_dot<1>(bits, kb, vp, x, kp, out); break;
        case 2: row_dot<2>(bits, kb, vp, x, kp, out); break;
        case 3: row_dot<3>(bits, kb, vp, x, kp, out); break;
        default: row_dot<4>(bits, kb, vp, x, kp, out); break;
    }
}

// The 16-column path: each step takes two mask bytes (16 columns) and expands their packed values into
// one 16-lane vector. Ops supplies the 16-lane primitives: AVX-512 where the CPU has it (Ops512), or
// two AVX2 halves (OpsPair), which runs the same loop on any AVX2 CPU so its logic is tested everywhere.
struct OpsPair {
    struct Vec {
        __m256 lo, hi;
    };
    static Vec zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
    static Vec load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
    static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
    static Vec add(Vec a, Vec b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
    static float hsum(Vec v) { return ::hsum(_mm256_add_ps(v.lo, v.hi)); }
    template <class V>
    static Vec expand16(const V* vp, unsigned m) {
        return {expand8(vp, m & 0xffu), expand8(vp + __builtin_popcount(m & 0xffu), m >> 8)};
    }
};

namespace pair16 {
#include "bitmask_row16.h"
}  // namespace pair16

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_HAVE_AVX512_PATH 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx2,fma")
struct Ops512 {
    using Vec = __m512;
    static Vec zero() { return _mm512_setzero_ps(); }
    static Vec load(const float* p) { return _mm512_loadu_ps(p); }
    static Vec fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
    static Vec add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
    static float hsum(Vec v) { return _mm512_reduce_add_ps(v); }
    // reads exactly popcount(m) packed values (the expand load suppresses the rest)
    static Vec expand16(const float* vp, unsigned m) { return _mm512_maskz_expandloadu_ps((__mmask16)m, vp); }
    static Vec expand16(const uint16_t* vp, unsigned m) {
        const __mmask16 first = (__mmask16)((1u << __builtin_popcount(m)) - 1u);
        const __m256i h = _mm256_maskz_loadu_epi16(first, vp);
        const __m512 packed = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
        return _mm512_maskz_expand_ps((__mmask16)m, packed);
    }
};
namespace avx512 {
#include "bitmask_row16.h"
}  // namespace avx512
#pragma GCC pop_options

// The bf16 dot-product loop (CPUs with AVX512-BF16 and VBMI2): 32 columns a step. One masked word
// expand (vpexpandw) places the step's packed bf16 values in their columns, and one VDPBF16PS per token
// multiplies them with 32 bf16 X columns, summing column pairs into 16 fp32 lanes. X stays in bf16, so
// per column it reads half the bytes and runs about a quarter of the instructions of the 16-column loop.
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx512vbmi2,avx2,fma")
namespace dpbf16 {

inline __m512 dot(__m512 acc, __m512i w, const uint16_t* x) {
    return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// out[t] for NT tokens; x is the bf16 X panel (NT rows, stride kp >= 8 * kb rounded up to 32, zero past K)
template <int NT>
void row_dot(const uint8_t* bits, int64_t kb, const uint16_t* vp, const uint16_t* x, int64_t kp, float* out) {
    constexpr int NA = NT <= 2 ? 2 : 1;
    __m512 acc[NT][NA];
    for (int t = 0; t < NT; ++t)
        for (int a = 0; a < NA; ++a) acc[t][a] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= kb; g += 8) {  // 64 columns: two expands
        uint64_t m;
        std::memcpy(&m, bits + g, 8);
        const __mmask32 m0 = (__mmask32)(uint32_t)m, m1 = (__mmask32)(uint32_t)(m >> 32);
        // into L2 a page ahead (every line: two a step where fewer than half the weights are dropped), then
        // into L1 (as in bitmask_row16.h)
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kPrefetchBytes + 64, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kNearPrefetchBytes, _MM_HINT_T0);
        const __m512i w0 = _mm512_maskz_expandloadu_epi16(m0, vp);
        const __m512i w1 = _mm512_maskz_expandloadu_epi16(m1, vp + __builtin_popcount((uint32_t)m));
        vp += __builtin_popcountll(m);
        const uint16_t* xc = x + 8 * g;
        for (int t = 0; t < NT; ++t) {
            acc[t][0] = dot(acc[t][0], w0, xc + t * kp);
            acc[t][1 % NA] = dot(acc[t][1 % NA], w1, xc + t * kp + 32);
        }
    }
    for (; g < kb; g += 4) {  // the last columns, 32 at a time (mask bytes past kb read as zero)
        uint32_t m = 0;
        std::memcpy(&m, bits + g, (size_t)std::min<int64_t>(4, kb - g));
        const __m512i w = _mm512_maskz_expandloadu_epi16((__mmask32)m, vp);
        vp += __builtin_popcount(m);
        for (int t = 0; t < NT; ++t) acc[t][0] = dot(acc[t][0], w, x + 8 * g + t * kp);
    }
    for (int t = 0; t < NT; ++t)
        out[t] = _mm512_reduce_add_ps(NA == 2 ? _mm512_add_ps(acc[t][0], acc[t][1 % NA]) : acc[t][0]);
}

// out0[t], out1[t] for two rows at once: each X load feeds both rows' dot products, half the X loads per
// row of row_dot (whose loop is bound by them from a few tokens up)
template <int NT>
void row_pair_dot(const uint8_t* bits0, const uint8_t* bits1, int64_t kb, const uint16_t* vp0, const uint16_t* vp1,
                  const uint16_t* x, int64_t kp, float* out0, float* out1) {
    __m512 a0[NT], a1[NT];
    for (int t = 0; t < NT; ++t) a0[t] = a1[t] = _mm512_setzero_ps();
    int64_t g = 0;
    for (; g + 8 <= kb; g += 8) {  // 64 columns: two expands per row
        uint64_t m, n;
        std::memcpy(&m, bits0 + g, 8);
        std::memcpy(&n, bits1 + g, 8);
        _mm_prefetch(reinterpret_cast<const char*>(vp0) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp1) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp0) + kNearPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vp1) + kNearPrefetchBytes, _MM_HINT_T0);
        const __mmask32 m0 = (__mmask32)(uint32_t)m, m1 = (__mmask32)(uint32_t)(m >> 32);
        const __mmask32 n0 = (__mmask32)(uint32_t)n, n1 = (__mmask32)(uint32_t)(n >> 32);
        const __m512i w0 = _mm512_maskz_expandloadu_epi16(m0, vp0);
        const __m512i w1 = _mm512_maskz_expandloadu_epi16(m1, vp0 + __builtin_popcount((uint32_t)m));
        const __m512i v0 = _mm512_maskz_expandloadu_epi16(n0, vp1);
        const __m512i v1 = _mm512_maskz_expandloadu_epi16(n1, vp1 + __builtin_popcount((uint32_t)n));
        vp0 += __builtin_popcountll(m);
        vp1 += __builtin_popcountll(n);
        const uint16_t* xc = x + 8 * g;
        for (int t = 0; t < NT; ++t) {
            const __m512bh xl = (__m512bh)_mm512_loadu_si512(xc + t * kp);
            const __m512bh xh = (__m512bh)_mm512_loadu_si512(xc + t * kp + 32);
            a0[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a0[t], (__m512bh)w0, xl), (__m512bh)w1, xh);
            a1[t] = _mm512_dpbf16_ps(_mm512_dpbf16_ps(a1[t], (__m512bh)v0, xl), (__m512bh)v1, xh);
        }
    }
    for (; g < kb; g += 4) {  // the last columns, 32 at a time (mask bytes past kb read as zero)
        uint32_t m = 0, n = 0;
        std::memcpy(&m, bits0 + g, (size_t)std::min<int64_t>(4, kb - g));
        std::memcpy(&n, bits1 + g, (size_t)std::min<int64_t>(4, kb - g));
        const __m512i w = _mm512_maskz_expandloadu_epi16((__mmask32)m, vp0);
        const __m512i v = _mm512_maskz_expandloadu_epi16((__mmask32)n, vp1);
        vp0 += __builtin_popcount(m);
        vp1 += __builtin_popcount(n);
        for (int t = 0; t < NT; ++t) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + 8 * g + t * kp);
            a0[t] = _mm512_dpbf16_ps(a0[t], (__m512bh)w, xv);
            a1[t] = _mm512_dpbf16_ps(a1[t], (__m512bh)v, xv);
        }
    }
    for (int t = 0; t < NT; ++t) {
        out0[t] = _mm512_reduce_add_ps(a0[t]);
        out1[t] = _mm512_reduce_add_ps(a1[t]);
    }
}

void row_pair_dot_n(int nt, const uint8_t* bits0, const uint8_t* bits1, int64_t kb, const uint16_t* vp0,
                    const uint16_t* vp1, const uint16_t* x, int64_t kp, float* out0, float* out1) {
    switch (nt) {
        case 1: row_pair_dot<1>(bits0, bits1, kb, vp0, vp1, x, kp, out0, out1); break;
        case 2: row_pair_dot<2>(bits0, bits1, kb, vp0, vp1, x, kp, out0, out1); break;
        case 3: row_pair_dot<3>(bits0, bits1, kb, vp0, vp1, x, kp, out0, out1); break;
        default: row_pair_dot<4>(bits0, bits1, kb, vp0, vp1, x, kp, out0, out1); break;
    }
}

// rows [r0, r1) of a bf16 W as dense bf16 rows of out ((r1 - r0) x K): one word expand per 32 columns
void expand_rows(const uint8_t* bits, int64_t kb, const int64_t* row_ptr, const uint16_t* values, int64_t K,
                 int64_t r0, int64_t r1, uint16_t* out, int nthreads) {
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t r = r0; r < r1; ++r) {
        const uint16_t* vp = values + row_ptr[r];  // the expand loads read exactly popcount values
        const uint8_t* b = bits + r * kb;
        uint16_t* o = out + (r - r0) * K;
        int64_t c = 0;
        for (; c + 32 <= K; c += 32) {
            uint32_t m;
            std::memcpy(&m, b + c / 8, 4);
            _mm512_storeu_si512(o + c, _mm512_maskz_expandloadu_epi16((__mmask32)m, vp));
            vp += __builtin_popcount(m);
        }
        if (c < K) {  // the last K - c columns: their mask bytes, a masked store
            uint32_t m = 0;
            std::memcpy(&m, b + c / 8, (size_t)(kb - c / 8));
            const __mmask32 keep = (__mmask32)((K - c) >= 32 ? 0xffffffffu : ((1u << (K - c)) - 1u));
            _mm512_mask_storeu_epi16(o + c, keep, _mm512_maskz_expandloadu_epi16((__mmask32)(m & keep), vp));
        }
    }
}

void row_dot_n(int nt, const uint8_t* bits, int64_t kb, const uint16_t* vp, const uint16_t* x, int64_t kp,
               float* out) {
    switch (nt) {
        case 1: row_dot<1>(bits, kb, vp, x, kp, out); break;
        case 2: row_dot<2>(bits, kb, vp, x, kp, out); break;
        case 3: row_dot<3>(bits, kb, vp, x, kp, out); break;
        default: row_dot<4>(bits, kb, vp, x, kp, out); break;
    }
}

}  // namespace dpbf16
#pragma GCC pop_options
#endif

// which row loop the stream kernel runs
enum Path { kAuto = 0, kAvx2 = 1, kAvx512 = 2, kPair16 = 3, kDpbf16 = 4 };

bool has_avx512() {
#ifdef SPARSA_HAVE_AVX512_PATH
    return sparsa_cpu_avx512_enabled();
#else
    return false;
#endif
}

// the bf16 dot-product loop needs AVX512-BF16 and VBMI2 besides the AVX-512 base (SPARSA_ISA >= avx512)
bool has_dpbf16() {
#ifdef SPARSA_HAVE_AVX512_PATH
    static const bool vbmi2 = __builtin_cpu_supports("avx512vbmi2");
    return vbmi2 && sparsa_cpu_dpbf16_enabled();
#else
    return false;
#endif
}

// row r's packed values, safe to read 8 past any group and (fp32, whose expansion loads from up to 4
// before a group's first value) 4 before the row: a padded copy in tail where the row starts within 4
// values of the array's start or ends within 8 of its end
template <class V>
inline const V* row_values(const V* values, const int64_t* row_ptr, int64_t r, int64_t nnz, std::vector<V>& tail) {
    constexpr int64_t front = sizeof(V) == 4 ? 4 : 0;
    const V* vp = values + row_ptr[r];
    if (row_ptr[r] >= front && row_ptr[r + 1] + 8 <= nnz) return vp;
    const int64_t n = row_ptr[r + 1] - row_ptr[r];
    tail.assign(front + n + 8, V(0));
    std::copy(vp, vp + n, tail.begin() + front);
    return tail.data() + front;
}

// y[t][r] for all T tokens and R rows; xp is the fp32 X panel (T x kp, zero-padded past K);
// store(t, r, value) writes one output (bias and rounding are the caller's).
template <class V, class Store>
void bitmask_rows(const float* xp, int64_t T, int64_t kp, const uint8_t* bits, int64_t kb, const int64_t* row_ptr,
                  const V* values, int64_t R, int nthreads, int path, Store store) {
    const int64_t nnz = row_ptr[R];
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<V> tail;
        float out[4];
#pragma omp for schedule(static)
        for (int64_t r = 0; r < R; ++r) {
            const V* vp = row_values(values, row_ptr, r, nnz, tail);
            for (int64_t t0 = 0; t0 < T; t0 += 4) {
                const int nt = (int)std::min<int64_t>(4, T - t0);
                const uint8_t* br = bits + r * kb;
                const float* xt = xp + t0 * kp;
                if (path == kAvx2) {
                    row_dot_n(nt, br, kb, vp, xt, kp, out);
                } else if (path == kPair16) {
                    pair16::row_dot16_n<OpsPair>(nt, br, kb, vp, xt, kp, out);
                } else {
#ifdef SPARSA_HAVE_AVX512_PATH
                    avx512::row_dot16_n<Ops512>(nt, br, kb, vp, xt, kp, out);
#endif
                }
                for (int i = 0; i < nt; ++i) store(t0 + i, r, out[i]);
            }
        }
    }
}

// the panel of X (T x K, fp32 or bf16) as O (float, or uint16_t for bf16 kept as is), rows padded with
// zeros to kp columns
template <class O = float, class X>
std::vector<O> padded_panel(const X* x, int64_t T, int64_t K, int64_t kp) {
    std::vector<O> p((size_t)(T * kp), O(0));
    for (int64_t t = 0; t < T; ++t) {
        if constexpr (sizeof(X) == sizeof(O)) {
            std::memcpy(p.data() + t * kp, x + t * K, K * sizeof(X));
        } else {
            static_assert(sizeof(X) == 2 && sizeof(O) == 4, "a bf16 panel widens to float only");
            sparsa_bf16_row_to_f32(x + t * K, p.data() + t * kp, K);
        }
    }
    return p;
}

// rows [r0, r1) of W as dense rows of out ((r1 - r0) x K, floats or bf16)
template <class V, class O>
void expand_rows(const uint8_t* bits, int64_t kb, const int64_t* row_ptr, const V* values, int64_t R, int64_t K,
                 int64_t r0, int64_t r1, O* out, int nthreads) {
    const int64_t nnz = row_ptr[R];
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<V> tail;
        alignas(32) float buf[8];
#pragma omp for schedule(static)
        for (int64_t r = r0; r < r1; ++r) {
            const V* vp = row_values(values, row_ptr, r, nnz, tail);
            const uint8_t* b = bits + r * kb;
            O* o = out + (r - r0) * K;
            int64_t g = 0;
            for (; 8 * g + 8 <= K; ++g) {
                const unsigned m = b[g];
                const __m256 w = expand8(vp, m);
                vp += __builtin_popcount(m);
                if constexpr (sizeof(O) == 4) {
                    _mm256_storeu_ps(reinterpret_cast<float*>(o) + 8 * g, w);
                } else {
                    _mm_storeu_si128(reinterpret_cast<__m128i*>(o + 8 * g), sparsa_cvt8_f32_bf16(w));
                }
            }
            if (8 * g < K) {
                _mm256_store_ps(buf, expand8(vp, b[g]));
                for (int64_t c = 8 * g; c < K; ++c) {
                    if constexpr (sizeof(O) == 4) {
                        o[c] = buf[c - 8 * g];
                    } else {
                        o[c] = sparsa_f32_to_bf16(buf[c - 8 * g]);
                    }
                }
            }
        }
    }
}

// the row loop a call runs: kAuto picks the bf16 dot-product loop for bf16 operands where the CPU has it,
// else AVX-512 where enabled (SPARSA_ISA allows it), else AVX2; -2 when a loop is asked of a CPU (or
// build) without it, -3 for an unknown path, -4 for the bf16 loop asked of fp32 operands
int resolve(int path, bool bf16) {
    if (path == kAuto) return bf16 && has_dpbf16() ? kDpbf16 : has_avx512() ? kAvx512 : kAvx2;
    if (path == kAvx512) return has_avx512() ? kAvx512 : -2;
    if (path == kDpbf16) return !bf16 ? -4 : has_dpbf16() ? kDpbf16 : -2;
    return (path == kAvx2 || path == kPair16) ? path : -3;
}

#ifdef SPARSA_HAVE_AVX512_PATH
// the bf16 loop: y[t][r] through store(t, r, value), X kept in bf16 (a zero-padded panel of kp columns)
template <class Store>
void bitmask_rows_dpbf16(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, int64_t kb,
                         const int64_t* row_ptr, const uint16_t* values, int64_t R, int nthreads, Store store) {
    const int64_t kp = 32 * ((8 * kb + 31) / 32) + 32;
    const std::vector<uint16_t> xp = padded_panel<uint16_t>(x, T, K, kp);
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t rp = 0; rp < (R + 1) / 2; ++rp) {
        const int64_t r = 2 * rp;
        // the expand loads read exactly the row's popcount values: no padded copy needed
        const uint16_t* vp = values + row_ptr[r];
        float out[4], out1[4];
        // two rows a pass from 4 tokens up, where the X loads bound the loop; below, one row's two
        // sums per token ran faster
        const bool pair = r + 1 < R && T >= 4;
        for (int64_t t0 = 0; t0 < T; t0 += 4) {
            const int nt = (int)std::min<int64_t>(4, T - t0);
            const uint16_t* xt = xp.data() + t0 * kp;
            if (pair) {
                dpbf16::row_pair_dot_n(nt, bits + r * kb, bits + (r + 1) * kb, kb, vp, values + row_ptr[r + 1], xt,
                                       kp, out, out1);
            } else {
                dpbf16::row_dot_n(nt, bits + r * kb, kb, vp, xt, kp, out);
                if (r + 1 < R) dpbf16::row_dot_n(nt, bits + (r + 1) * kb, kb, values + row_ptr[r + 1], xt, kp, out1);
            }
            for (int i = 0; i < nt; ++i) store(t0 + i, r, out[i]);
            if (r + 1 < R)
                for (int i = 0; i < nt; ++i) store(t0 + i, r + 1, out1[i]);
        }
    }
}
#endif

}  // namespace

extern "C" {

// 1 when the stream kernel's AVX-512 path runs on this CPU (and SPARSA_ISA allows it)
int sparsa_bitmask_has_avx512() { return has_avx512() ? 1 : 0; }

// 1 when the bf16 dot-product loop (AVX512-BF16 + VBMI2) runs on this CPU (and SPARSA_ISA allows it)
int sparsa_bitmask_has_dpbf16() { return has_dpbf16() ? 1 : 0; }

// y (T x R, fp32) = x (T x K, fp32) W^T + bias (R floats or null). path: 0 auto, 1 AVX2 (8 columns a
// step), 2 AVX-512 (16), 3 the 16-column loop on AVX2 halves; returns -2 / -3 for a path not available
int sparsa_bitmask_linear_f32(const float* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                              const float* values, int64_t R, const float* bias, float* y, int nthreads, int path) {
    if ((path = resolve(path, false)) < 0) return path;
    const int64_t kb = (K + 7) / 8, kp = 8 * kb + 8;
    const std::vector<float> xp = padded_panel(x, T, K, kp);
    bitmask_rows(xp.data(), T, kp, bits, kb, row_ptr, values, R, nthreads, path,
                 [&](int64_t t, int64_t r, float v) { y[t * R + r] = bias ? v + bias[r] : v; });
    return 0;
}

// y (T x R, bf16) = x (T x K, bf16) W^T + bias, W's values bf16; products accumulate in fp32 and each
// output is rounded once. bias: R bf16 (bias_bf16 = 1) or floats (0), or null.
int sparsa_bitmask_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const uint8_t* bits, const int64_t* row_ptr,
                               const uint16_t* values, int64_t R, const void* bias, int bias_bf16, uint16_t* y,
                               int nthreads, int path) {
    if ((path = resolve(path, true)) < 0) return path;
    const int64_t kb = (K + 7) / 8;
    const uint16_t* bh = static_cast<const uint16_t*>(bias);
    const float* bf = static_cast<const float*>(bias);
    auto store = [&](int64_t t, int64_t r, float v) {
        if (bias) v += bias_bf16 ? sparsa_bf16_to_f32(bh[r]) : bf[r];
        y[t * R + r] = sparsa_f32_to_bf16(v);
    };
#ifdef SPARSA_HAVE_AVX512_PATH
    if (path == kDpbf16) {
        bitmask_rows_dpbf16(x, T, K, bits, kb, row_ptr, values, R, nthreads, store);
        return 0;
    }
#endif
    const int64_t kp = 8 * kb + 8;
    const std::vector<float> xp = padded_panel(x, T, K, kp);
    bitmask_rows(xp.data(), T, kp, bits, kb, row_ptr, values, R, nthreads, path, store);
    return 0;
}

// rows [r0, r1) of W to dense rows of out ((r1 - r0) x K); values_bf16 / out_bf16 select uint16 storage
int sparsa_bitmask_expand(const uint8_t* bits, const int64_t* row_ptr, const void* values, int values_bf16, int64_t R,
                          int64_t K, int64_t r0, int64_t r1, void* out, int out_bf16, int nthreads) {
    const int64_t kb = (K + 7) / 8;
#ifdef SPARSA_HAVE_AVX512_PATH
    if (values_bf16 && out_bf16 && has_dpbf16()) {
        dpbf16::expand_rows(bits, kb, row_ptr, static_cast<const uint16_t*>(values), K, r0, r1,
                            static_cast<uint16_t*>(out), nthreads);
        return 0;
    }
#endif
    if (values_bf16 && out_bf16) {
        expand_rows(bits, kb, row_ptr, static_cast<const uint16_t*>(values), R, K, r0, r1, static_cast<uint16_t*>(out),
                    nthreads);
    } else if (values_bf16) {
        expand_rows(bits, kb, row_ptr, static_cast<const uint16_t*>(values), R, K, r0, r1, static_cast<float*>(out),
                    nthreads);
    } else if (out_bf16) {
        expand_rows(bits, kb, row_ptr, static_cast<const float*>(values), R, K, r0, r1, static_cast<uint16_t*>(out),
                    nthreads);
    } else {
        expand_rows(bits, kb, row_ptr, static_cast<const float*>(values), R, K, r0, r1, static_cast<float*>(out),
                    nthreads);
    }
    return 0;
}

}  // extern "C"
