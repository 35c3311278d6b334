// Input gradient of conv2d(relu(x), W) computed only where relu(x) != 0, as dot products (AVX-512, run-time check).
//
//   dX[q, c] = [x[q, c] > 0] * sum_{kh, kw, o} dy[p(q, kh, kw), o] * W[o, c, kh, kw]
//
// Unlike the dY-driven kernel (adaptive_union.cpp: the flipped conv's forward over dY's nonzeros), the work
// here follows relu(x)'s mask, so it pays when dY is dense (behind a BatchNorm, or a random dY) and relu(x)
// sparse. Two kernels, picked by the caller from relu(x)'s union ratio:
// - union: groups of 4 input pixels (2x2 tiles on images of 16x16 and up, else in a row); the union of their
//   nonzero channels is walked 4 channels at a time, and for each (kernel offset, 16 output channels) step 4 dY
//   loads and 4 weight loads feed 16 FMAs into 4 x 4 accumulators (pixel x channel), reduced to 16 dot products
//   in one shuffle tree. Cheap per product, but it computes every union channel at every pixel of the group.
// - lists: blocks of 32 consecutive pixels have their mask bits transposed into per-channel lists of pixels, and
//   each channel's dot products run for exactly those pixels, 4 at a time (one weight-row load serves 4 FMAs; a
//   list's last 1 or 2 pixels run alone): nnz(relu(x)) dot products, where zeros scattered across neighbouring
//   pixels make the unions much larger than the nonzeros.
// The weight rows of a channel (wc [C][KH*KW][O], the list kernels' pack) are contiguous.
// Any stride, padding and dilation (a per-position table of the output pixel each kernel offset meets).
// bf16 operands (AVX512-BF16): dY and the weight rows in bf16, where adjacent output channels pair up for
// VDPBF16PS (fp32 accumulation); dX is rounded to bf16 once.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "bf16.h"
#include "cpu_isa.h"

namespace {

using sparsa_adaptive::Geo;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_IGX_AVX512 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma,bmi,popcnt")

constexpr int P = 4;   // pixels per group
constexpr int CC = 4;  // channels per step

// out lane 4 j + i = the horizontal sum of a[4 j + i] (16 vectors): the 16 sums in one tree (about 45 instructions
// instead of 16 separate reductions)
inline __m512 hsum16(const __m512* a) {
    // fold the 256-bit halves of pairs, then the 128-bit lanes of pairs of those, then a 4x4 in-lane
    // transpose-add; the inputs are paired so that lane l, element m of the result is the sum of vector 4 l + m
    __m512 h[8], q[4];
    for (int t = 0; t < 8; ++t) {  // t -> vectors (t % 4) + 4 * (t / 4) * 2 and the one 4 after it
        const int v = (t / 4) * 8 + t % 4;
        h[t] = _mm512_add_ps(_mm512_shuffle_f32x4(a[v], a[v + 4], 0x44), _mm512_shuffle_f32x4(a[v], a[v + 4], 0xEE));
    }
    for (int m = 0; m < 4; ++m)  // lanes: vectors m, m + 4, m + 8, m + 12
        q[m] = _mm512_add_ps(_mm512_shuffle_f32x4(h[m], h[m + 4], 0x88), _mm512_shuffle_f32x4(h[m], h[m + 4], 0xDD));
    const __m512 v0 = _mm512_add_ps(_mm512_unpacklo_ps(q[0], q[1]), _mm512_unpackhi_ps(q[0], q[1]));
    const __m512 v1 = _mm512_add_ps(_mm512_unpacklo_ps(q[2], q[3]), _mm512_unpackhi_ps(q[2], q[3]));
    return _mm512_add_ps(
        _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))),
        _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(v0), _mm512_castps_pd(v1))));
}

// dx[q_i, c_j] for the 4 pixels (row pointers dyr[k][i], zero rows where out of range) and 4 channels c[j]
// (weight rows wr[j] = wc + c_j * K2 * O, contiguous): the 16 dot products of length K2 * O into out[j][i].
// (Reading the forward pack's OB-wide pieces instead, C * OB floats apart, is slower than building wc by
// row copies first.)
inline void dots_group(const float* const (*dyr)[P], const float* const* wr, int64_t K2, int64_t O, float out[CC][P]) {
    __m512 acc[CC][P];
    for (int j = 0; j < CC; ++j)
        for (int i = 0; i < P; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
        const float* d0 = dyr[k][0];
        const float* d1 = dyr[k][1];
        const float* d2 = dyr[k][2];
        const float* d3 = dyr[k][3];
        const int64_t wo = k * O;
        for (int64_t o = 0; o < O; o += 16) {
            const __m512 a0 = _mm512_loadu_ps(d0 + o), a1 = _mm512_loadu_ps(d1 + o), a2 = _mm512_loadu_ps(d2 + o),
                         a3 = _mm512_loadu_ps(d3 + o);
            for (int j = 0; j < CC; ++j) {
                const __m512 w = _mm512_loadu_ps(wr[j] + wo + o);
                acc[j][0] = _mm512_fmadd_ps(w, a0, acc[j][0]);
                acc[j][1] = _mm512_fmadd_ps(w, a1, acc[j][1]);
                acc[j][2] = _mm512_fmadd_ps(w, a2, acc[j][2]);
                acc[j][3] = _mm512_fmadd_ps(w, a3, acc[j][3]);
            }
        }
    }
    _mm512_storeu_ps(&out[0][0], hsum16(&acc[0][0]));
}

// The same 16 dot products over bf16 rows: 32 output channels per step, pairs (o, o + 1) per VDPBF16PS (O is a
// multiple of 16; a last step of 16 loads half a vector)
inline void dots_group(const uint16_t* const (*dyr)[P], const uint16_t* const* wr, int64_t K2, int64_t O, float out[CC][P]) {
    __m512 acc[CC][P];
    for (int j = 0; j < CC; ++j)
        for (int i = 0; i < P; ++i) acc[j][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
        const int64_t wo = k * O;
        for (int64_t o = 0; o < O; o += 32) {
            const __mmask32 lm = O - o >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu;
            __m512bh a[P];
            for (int i = 0; i < P; ++i) a[i] = (__m512bh)_mm512_maskz_loadu_epi16(lm, dyr[k][i] + o);
            for (int j = 0; j < CC; ++j) {
                const __m512bh w = (__m512bh)_mm512_maskz_loadu_epi16(lm, wr[j] + wo + o);
                for (int i = 0; i < P; ++i) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], w, a[i]);
            }
        }
    }
    _mm512_storeu_ps(&out[0][0], hsum16(&acc[0][0]));
}

template <typename T>
T from_f32(float v);
template <>
inline float from_f32<float>(float v) { return v; }
template <>
inline uint16_t from_f32<uint16_t>(float v) { return sparsa_f32_to_bf16(v); }

// The union kernel, for fp32 (T = float) or bf16 (T = uint16_t) dY, weight rows and dX: groups of 4 pixels, the union
// of their channels 4 at a time.
template <typename T>
void igrad_x_union_run(const Geo& G, const uint64_t* bm, const T* dy, const T* wc, T* dx, int nthreads) {
    const int64_t C = G.C, O = G.O, HW = G.H * G.W, HWo = G.Ho * G.Wo, K2 = G.KH * G.KW, NW = (C + 63) / 64;
    const std::vector<int32_t> tab = sparsa_adaptive::output_pixel_table(G);
    std::vector<T> zero((size_t)O, T(0));
    // groups of 4 pixels: 2x2 tiles on even-sized images of 16x16 and up (neighbours in both directions share
    // more of relu(x)'s zeros, as in the union kernels' Groups), else runs of 4 along the flattened rows
    const bool tiles = G.H % 2 == 0 && G.W % 2 == 0 && G.H >= 16 && G.W >= 16;
    const int64_t per_image = tiles ? HW / 4 : (HW + P - 1) / P, groups = G.N * per_image, tw = G.W / 2;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<const T*> rows((size_t)K2 * P);
        const T* const(*dyr)[P] = reinterpret_cast<const T* const(*)[P]>(rows.data());
#pragma omp for schedule(dynamic, 4)
        for (int64_t t = 0; t < groups; ++t) {
            const int64_t n = t / per_image, gi = t % per_image;
            int64_t pos[P], q[P];
            int np = 0;
            for (int i = 0; i < P; ++i) {
                const int64_t ps = tiles ? (2 * (gi / tw) + (i >> 1)) * G.W + 2 * (gi % tw) + (i & 1) : gi * P + i;
                if (ps < HW) pos[np] = ps, q[np] = n * HW + ps, ++np;
            }
            for (int i = 0; i < np; ++i) std::memset(dx + q[i] * C, 0, sizeof(T) * C);
            for (int i = 0; i < P; ++i)
                for (int64_t k = 0; k < K2; ++k) {
                    const int32_t p = i < np ? tab[pos[i] * K2 + k] : -1;
                    rows[k * P + i] = p >= 0 ? dy + (n * HWo + p) * O : zero.data();
                }
            // the union's channels, CC at a time (the last step repeats its final channel)
            int64_t cs[CC];
            int nc = 0;
            auto flush = [&](int cnt) {
                const T* wr[CC];
                for (int j = 0; j < CC; ++j) wr[j] = wc + cs[j < cnt ? j : cnt - 1] * K2 * O;
                float out[CC][P];
                dots_group(dyr, wr, K2, O, out);
                for (int j = 0; j < cnt; ++j) {
                    const int64_t c = cs[j];
                    for (int i = 0; i < np; ++i)
                        if ((bm[q[i] * NW + c / 64] >> (c % 64)) & 1) dx[q[i] * C + c] = from_f32<T>(out[j][i]);
                }
            };
            for (int64_t w = 0; w < NW; ++w) {
                uint64_t m = 0;
                for (int i = 0; i < np; ++i) m |= bm[q[i] * NW + w];
                while (m) {
                    cs[nc++] = w * 64 + __builtin_ctzll(m);
                    m &= m - 1;
                    if (nc == CC) flush(CC), nc = 0;
                }
            }
            if (nc) flush(nc);
        }
    }
}

// out[i] = the horizontal sum of a[i], i < 4, in one shuffle tree (about a third of 4 separate reductions)
inline void hsum4(const __m512* a, float* out) {
    // lanes 0-1: a[0]'s (a[2]'s) 256-bit halves added, lanes 2-3: a[1]'s (a[3]'s)
    const __m512 b0 = _mm512_add_ps(_mm512_shuffle_f32x4(a[0], a[1], 0x44), _mm512_shuffle_f32x4(a[0], a[1], 0xEE));
    const __m512 b1 = _mm512_add_ps(_mm512_shuffle_f32x4(a[2], a[3], 0x44), _mm512_shuffle_f32x4(a[2], a[3], 0xEE));
    // lane k: four partial sums of a[k]
    const __m512 c = _mm512_add_ps(_mm512_shuffle_f32x4(b0, b1, 0x88), _mm512_shuffle_f32x4(b0, b1, 0xDD));
    const __m512 d = _mm512_add_ps(c, _mm512_permute_ps(c, 0x4E));
    const __m512 e = _mm512_add_ps(d, _mm512_permute_ps(d, 0xB1));  // every element of lane k: the sum of a[k]
    alignas(64) float t[16];
    _mm512_store_ps(t, e);
    for (int k = 0; k < 4; ++k) out[k] = t[4 * k];
}

// The dot products of one channel's weight rows wr with DP pixels' dY patches (slots s[i] of the block's row
// table) into out[i]: one weight load serves the DP pixels, and NS sets of sums, one per output-channel step of
// an unrolled turn, keep DP x NS chains in flight.
template <int DP, int NS>
inline void dots(const float* const* rows, int64_t PB1, const int* s, const float* wr, int64_t K2, int64_t O,
                 float* out) {
    __m512 a[NS][4];
    for (int u = 0; u < NS; ++u)
        for (int i = 0; i < 4; ++i) a[u][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
        const float* r[DP];
        for (int i = 0; i < DP; ++i) r[i] = rows[k * PB1 + s[i]];
        const float* w = wr + k * O;
        int64_t o = 0;
        for (; o + 16 * NS <= O; o += 16 * NS)
            for (int u = 0; u < NS; ++u) {
                const __m512 wv = _mm512_loadu_ps(w + o + 16 * u);
                for (int i = 0; i < DP; ++i) a[u][i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(r[i] + o + 16 * u), a[u][i]);
            }
        for (; o < O; o += 16) {  // O is a multiple of 16
            const __m512 wv = _mm512_loadu_ps(w + o);
            for (int i = 0; i < DP; ++i) a[0][i] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(r[i] + o), a[0][i]);
        }
    }
    for (int u = 1; u < NS; ++u)
        for (int i = 0; i < DP; ++i) a[0][i] = _mm512_add_ps(a[0][i], a[u][i]);
    float t[4];
    hsum4(a[0], t);
    for (int i = 0; i < DP; ++i) out[i] = t[i];
}

// The same over bf16 rows: pairs (o, o + 1) per VDPBF16PS, 32 output channels a vector (a last step of 16 loads
// half of one).
template <int DP, int NS>
inline void dots(const uint16_t* const* rows, int64_t PB1, const int* s, const uint16_t* wr, int64_t K2, int64_t O,
                 float* out) {
    __m512 a[NS][4];
    for (int u = 0; u < NS; ++u)
        for (int i = 0; i < 4; ++i) a[u][i] = _mm512_setzero_ps();
    for (int64_t k = 0; k < K2; ++k) {
        const uint16_t* r[DP];
        for (int i = 0; i < DP; ++i) r[i] = rows[k * PB1 + s[i]];
        const uint16_t* w = wr + k * O;
        int64_t o = 0;
        for (; o + 32 * NS <= O; o += 32 * NS)
            for (int u = 0; u < NS; ++u) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + o + 32 * u);
                for (int i = 0; i < DP; ++i)
                    a[u][i] = _mm512_dpbf16_ps(a[u][i], wv, (__m512bh)_mm512_loadu_si512(r[i] + o + 32 * u));
            }
        for (; o < O; o += 32) {
            const __mmask32 lm = O - o >= 32 ? (__mmask32)0xFFFFFFFFu : (__mmask32)0xFFFFu;
            const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(lm, w + o);
            for (int i = 0; i < DP; ++i)
                a[0][i] = _mm512_dpbf16_ps(a[0][i], wv, (__m512bh)_mm512_maskz_loadu_epi16(lm, r[i] + o));
        }
    }
    for (int u = 1; u < NS; ++u)
        for (int i = 0; i < DP; ++i) a[0][i] = _mm512_add_ps(a[0][i], a[u][i]);
    float t[4];
    hsum4(a[0], t);
    for (int i = 0; i < DP; ++i) out[i] = t[i];
}

// Blocks of PB consecutive pixels (flattened rows): each channel's list of the block's pixels where relu(x) is set
// (the block's mask bits transposed), walked 4 pixels at a time, so the work is nnz(relu(x)) dot products, each
// weight row load serves up to 4 of them and the block's dY patches stay in L1.
constexpr int64_t PB = 32;

template <typename T>
void igrad_x_lists_run(const Geo& G, const uint64_t* bm, const T* dy, const T* wc, T* dx, int nthreads) {
    const int64_t C = G.C, O = G.O, HW = G.H * G.W, HWo = G.Ho * G.Wo, K2 = G.KH * G.KW, NW = (C + 63) / 64;
    const std::vector<int32_t> tab = sparsa_adaptive::output_pixel_table(G);
    std::vector<T> zero((size_t)O + 32, T(0));
    const int64_t per_image = (HW + PB - 1) / PB, blocks = G.N * per_image;
    constexpr int64_t PB1 = PB + 1;  // slot PB: the zero row
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<const T*> rows((size_t)K2 * PB1);
        uint32_t pm[64];
#pragma omp for schedule(dynamic, 2)
        for (int64_t t = 0; t < blocks; ++t) {
            const int64_t n = t / per_image, p0 = (t % per_image) * PB, np = std::min(PB, HW - p0);
            const int64_t q0 = n * HW + p0;
            std::memset(dx + q0 * C, 0, sizeof(T) * np * C);
            for (int64_t k = 0; k < K2; ++k) {
                for (int64_t i = 0; i < np; ++i) {
                    const int32_t p = tab[(p0 + i) * K2 + k];
                    rows[k * PB1 + i] = p >= 0 ? dy + (n * HWo + p) * O : zero.data();
                }
                for (int64_t i = np; i < PB1; ++i) rows[k * PB1 + i] = zero.data();
            }
            for (int64_t j = 0; j < NW; ++j) {
                std::memset(pm, 0, sizeof pm);
                for (int64_t i = 0; i < np; ++i) {
                    uint64_t m = bm[(q0 + i) * NW + j];
                    while (m) {
                        pm[__builtin_ctzll(m)] |= 1u << i;
                        m &= m - 1;
                    }
                }
                const int64_t cw = std::min<int64_t>(64, C - j * 64);
                for (int64_t b = 0; b < cw; ++b) {
                    uint32_t m = pm[b];
                    if (!m) continue;
                    const int64_t c = j * 64 + b;
                    const T* wr = wc + c * K2 * O;
                    while (m) {
                        // 4 pixels a step (8 measured slower); a short list's last step takes 1 or 2, or 3
                        // padded with the zero slot, so that short lists (small images, high sparsity) do not
                        // multiply zero rows
                        int s[4], cnt = 0;
                        for (; cnt < 4 && m; ++cnt) {
                            s[cnt] = __builtin_ctz(m);
                            m &= m - 1;
                        }
                        for (int i = cnt; i < 4; ++i) s[i] = (int)PB;
                        float out[4];
                        if (cnt == 1) dots<1, 4>(rows.data(), PB1, s, wr, K2, O, out);
                        else if (cnt == 2) dots<2, 4>(rows.data(), PB1, s, wr, K2, O, out);
                        else dots<4, 2>(rows.data(), PB1, s, wr, K2, O, out);
                        for (int i = 0; i < cnt; ++i) dx[(q0 + s[i]) * C + c] = from_f32<T>(out[i]);
                    }
                }
            }
        }
    }
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// dx [N*H*W, C] (NHWC, every element written) from dy [N*Ho*Wo, O] (contiguous), relu(x)'s masks bm
// [N*H*W, ceil(C/64)] and wc [C][KH*KW][O], by the lists kernel (lists != 0) or the union kernel. Returns 1 when O
// is not a multiple of 16, 2 without AVX-512.
int sparsa_union_conv_igrad_x_f32(const int64_t* g, const uint64_t* bm, const float* dy, const float* wc, float* dx,
                                  int lists, int nthreads) {
    const Geo G(g);
    if (G.O % 16) return 1;
    if (!sparsa_cpu_avx512_enabled()) return 2;
#ifdef SPARSA_IGX_AVX512
    if (lists) igrad_x_lists_run<float>(G, bm, dy, wc, dx, nthreads);
    else igrad_x_union_run<float>(G, bm, dy, wc, dx, nthreads);
    return 0;
#else
    return 2;
#endif
}

// As sparsa_union_conv_igrad_x_f32 with bf16 dy, wc and dx (dX rounded to bf16 once). Returns 1 when O is not a
// multiple of 16, 2 without AVX512-BF16.
int sparsa_union_conv_igrad_x_bf16(const int64_t* g, const uint64_t* bm, const uint16_t* dy, const uint16_t* wc,
                                   uint16_t* dx, int lists, int nthreads) {
    const Geo G(g);
    if (G.O % 16) return 1;
    if (!sparsa_cpu_dpbf16_enabled()) return 2;
#ifdef SPARSA_IGX_AVX512
    if (lists) igrad_x_lists_run<uint16_t>(G, bm, dy, wc, dx, nthreads);
    else igrad_x_union_run<uint16_t>(G, bm, dy, wc, dx, nthreads);
    return 0;
#else
    return 2;
#endif
}

}  // extern "C"
