// Y[T, R] = X[T, K] * W^T + b with W stored in the SlicedELL layout (slices of 2 rows):
//   slice s holds rows 2s and 2s+1, padded to a common length L_s; entries are interleaved
//   (slot j of row 2s at slice_ptr[s] + 2j, of row 2s+1 at slice_ptr[s] + 2j + 1);
//   padding entries have value 0 and a valid column.
//
// Tokens are vectorised: a panel of up to 32 tokens of X is transposed into xt[K][TB] (8x8 AVX
// transposes), so one kept weight w[r][c] multiplies the contiguous vector xt[c][0:TB]. Two rows are
// processed together (2 x TB/8 accumulators) for instruction-level parallelism, over K in chunks that
// keep the panel's rows being read in L1 (see panel_rows). OpenMP over (token panel, row chunk).
// A single token (decode) takes a scalar path instead (one_token): same products, each row summed in two
// interleaved partial sums, so its rounding differs slightly from the panel path's.
//
// bfloat16 (sparsa_sliced_ell_linear_bf16): the same kernel with bf16 X, weight values and Y. X is widened
// to fp32 while its panel is transposed into xt, each weight is widened (a shift) as it is broadcast,
// products accumulate in fp32 exactly as in the fp32 kernel (same order),
// and the output (+ bias, fp32 or bf16) is rounded to bf16 once (nearest even). AVX2 only: no AVX-512 here.
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <vector>
#include <omp.h>
#ifdef __AVX2__
#include <immintrin.h>
#endif
#include "bf16.h"
#include "gelu.h"
#include "transpose8.h"

namespace {

constexpr int TBMAX = 32;

// element access of X / weights as fp32 (float: as is; bf16 stored as uint16_t: widened)
inline float to_f32(float v) { return v; }
inline float to_f32(uint16_t v) { return sparsa_bf16_to_f32(v); }
inline void store_y(float* p, float v) { *p = v; }
inline void store_y(uint16_t* p, float v) { *p = sparsa_f32_to_bf16(v); }
#ifdef __AVX2__
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) { return sparsa_load8_bf16(p); }
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(uint16_t* p, __m256 v) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), sparsa_cvt8_f32_bf16(v)); }
#endif

// xt[c * TB + i] = x[i * K + c] for i < nt, zero for nt <= i < TB (widened to fp32)
template <typename XT>
void transpose_panel(const XT* __restrict x, int64_t K, int nt, int TB, float* __restrict xt) {
    int64_t c = 0;
#ifdef __AVX2__
    if (TB % 8 == 0) {
        for (; c + 8 <= K; c += 8) {
            for (int i0 = 0; i0 < TB; i0 += 8) {
                __m256 r[8];
                if (i0 + 8 <= nt) {
                    for (int i = 0; i < 8; ++i) r[i] = load8(x + (int64_t)(i0 + i) * K + c);
                } else {
                    for (int i = 0; i < 8; ++i)
                        r[i] = (i0 + i < nt) ? load8(x + (int64_t)(i0 + i) * K + c) : _mm256_setzero_ps();
                }
                transpose8(r);
                float* o = xt + c * TB + i0;
                for (int k = 0; k < 8; ++k) _mm256_storeu_ps(o + k * TB, r[k]);
            }
        }
    }
#endif
    for (; c < K; ++c)
        for (int i = 0; i < TB; ++i) xt[c * TB + i] = i < nt ? to_f32(x[(int64_t)i * K + c]) : 0.f;
}

// Rows [r0, r0 + nr) of one panel, held as part[row][0:TB] (token vectors, TB a multiple of 8): + bias,
// optional GELU, then stored token by token, so each token's nr outputs go to y as one contiguous run.
// Lanes past nt are computed (on zeros) but never stored.
template <typename YT>
inline void store_block(float* __restrict part, int TB, int nt, int64_t r0, int64_t nr, int64_t R,
                        const float* __restrict bias, YT* __restrict y, bool act) {
    for (int64_t r = 0; r < nr; ++r) {
        float* p = part + r * TB;
        if (bias) {
            const float b = bias[r0 + r];
            for (int i = 0; i < TB; ++i) p[i] += b;
        }
        if (act) sparsa_gelu_inplace(p, TB);  // GELU after the bias
    }
    int64_t r = 0;
#ifdef __AVX2__
    // 8 rows x 8 tokens at a time: one transpose turns 8 row vectors into 8 token runs
    for (; r + 8 <= nr; r += 8) {
        int i = 0;
        for (; i + 8 <= nt; i += 8) {
            __m256 v[8];
            for (int k = 0; k < 8; ++k) v[k] = _mm256_load_ps(part + (r + k) * TB + i);
            transpose8(v);
            for (int k = 0; k < 8; ++k) store8(y + (int64_t)(i + k) * R + r0 + r, v[k]);
        }
        for (; i < nt; ++i)
            for (int k = 0; k < 8; ++k) store_y(y + (int64_t)i * R + r0 + r + k, part[(r + k) * TB + i]);
    }
#endif
    for (int i = 0; i < nt; ++i) {
        YT* yi = y + (int64_t)i * R + r0;
        for (int64_t q = r; q < nr; ++q) store_y(yi + q, part[q * TB + i]);
    }
}

// Columns per chunk: a 32-token panel's chunk (KCHUNK x 128 B) stays in L1 while every row of a block
// reads its kept columns from it, instead of each row reading at random from an L2-sized panel.
constexpr int KCHUNK = 256;
// Slices per block: the block's partial sums (SBLOCK x 2 x TB floats) stay in L1 between chunks, and its
// outputs are stored as runs of 2 * SBLOCK contiguous values per token.
constexpr int SBLOCK = 64;

#ifdef __AVX2__
inline __m256 bcast1(const float* w) { return _mm256_broadcast_ss(w); }
// bf16 w broadcast to every 16-bit lane, then the low halves cleared: fp32 (w << 16) in every lane
inline __m256 bcast1(const uint16_t* w) {
    const __m256i b = _mm256_broadcastw_epi16(_mm_cvtsi32_si128(*w));
    return _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int32_t)0xffff0000u)));
}
// the two rows' weights of one slot (w[0], w[1]); bf16: one 32-bit broadcast split into two (shift / mask)
inline void bcast2(const float* w, __m256& w0, __m256& w1) {
    w0 = _mm256_broadcast_ss(w);
    w1 = _mm256_broadcast_ss(w + 1);
}
inline void bcast2(const uint16_t* w, __m256& w0, __m256& w1) {
    int32_t u;
    std::memcpy(&u, w, 4);  // w[0] in the low half, w[1] in the high half (little endian)
    const __m256i b = _mm256_set1_epi32(u);
    w0 = _mm256_castsi256_ps(_mm256_slli_epi32(b, 16));
    w1 = _mm256_castsi256_ps(_mm256_and_si256(b, _mm256_set1_epi32((int32_t)0xffff0000u)));
}
#endif

// Chunks pay once the panel (K x TB floats) outgrows L2's share for it; below, one chunk reads it from L2
// with less bookkeeping.
inline int64_t k_chunk(int64_t K, int TB) { return (int64_t)K * TB * 4 > (128 << 10) ? KCHUNK : K; }

// Rows of slices [s0, s1) for one panel of nt tokens (TB = 8 * NV lanes in xt, 64-byte aligned). WT / YT:
// float, or uint16_t for bf16 weight values / output.
//
// K is walked in chunks of KCHUNK columns for a block of SBLOCK slices at a time. Each row keeps its own
// position in its slot list and takes entries while their column is below the chunk's end; the last
// chunk takes whatever is left (padding, or columns in any order), so the result does not depend on the
// columns being sorted. Per row the products are added in slot order, as without chunks.
template <int NV, typename WT, typename YT>
void panel_rows(const float* __restrict xt, int nt, int64_t K, const int64_t* __restrict sptr,
                const int32_t* __restrict cols, const WT* __restrict vals, int64_t s0, int64_t s1, int64_t R,
                const float* __restrict bias, YT* __restrict y, bool act) {
    constexpr int TB = 8 * NV;
    alignas(64) float part[SBLOCK][2][TB];
    const int64_t kc = k_chunk(K, TB);
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
#ifdef __AVX2__
        if (kc >= K) {  // one chunk: both rows of a slice walk their padded slot lists in step
            for (int64_t s = sb; s < se; ++s) {
                const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
                const int32_t* c = cols + p0;
                const WT* w = vals + p0;
                __m256 a0[NV], a1[NV];
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) a0[v] = a1[v] = _mm256_setzero_ps();
#pragma GCC unroll 2
                for (int64_t j = 0; j < L; ++j) {
                    const float* x0 = xt + (int64_t)c[2 * j] * TB;
                    const float* x1 = xt + (int64_t)c[2 * j + 1] * TB;
                    __m256 w0, w1;
                    bcast2(w + 2 * j, w0, w1);
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) {
                        a0[v] = _mm256_fmadd_ps(w0, _mm256_load_ps(x0 + 8 * v), a0[v]);
                        a1[v] = _mm256_fmadd_ps(w1, _mm256_load_ps(x1 + 8 * v), a1[v]);
                    }
                }
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) {
                    _mm256_store_ps(part[s - sb][0] + 8 * v, a0[v]);
                    _mm256_store_ps(part[s - sb][1] + 8 * v, a1[v]);
                }
            }
        } else {
            int64_t pos[SBLOCK][2];
            for (int64_t s = sb; s < se; ++s) pos[s - sb][0] = pos[s - sb][1] = 0;
            for (int64_t k0 = 0;; k0 += kc) {
                const bool first = k0 == 0, last = k0 + kc >= K;
                const int32_t kend = last ? INT32_MAX : (int32_t)(k0 + kc);
                for (int64_t s = sb; s < se; ++s) {
                    const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
                    const int32_t* c = cols + p0;
                    const WT* w = vals + p0;
                    int64_t j0 = pos[s - sb][0], j1 = pos[s - sb][1];
                    float* q0 = part[s - sb][0];
                    float* q1 = part[s - sb][1];
                    __m256 a0[NV], a1[NV];
                    if (first) {
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a0[v] = a1[v] = _mm256_setzero_ps();
                    } else {
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) {
                            a0[v] = _mm256_load_ps(q0 + 8 * v);
                            a1[v] = _mm256_load_ps(q1 + 8 * v);
                        }
                    }
                    // both rows together while both have entries in this chunk (two independent FMA chains)
                    while (j0 < L && j1 < L) {
                        const int32_t c0 = c[2 * j0], c1 = c[2 * j1 + 1];
                        if (c0 >= kend || c1 >= kend) break;
                        const float* x0 = xt + (int64_t)c0 * TB;
                        const float* x1 = xt + (int64_t)c1 * TB;
                        const __m256 w0 = bcast1(w + 2 * j0), w1 = bcast1(w + 2 * j1 + 1);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) {
                            a0[v] = _mm256_fmadd_ps(w0, _mm256_load_ps(x0 + 8 * v), a0[v]);
                            a1[v] = _mm256_fmadd_ps(w1, _mm256_load_ps(x1 + 8 * v), a1[v]);
                        }
                        ++j0;
                        ++j1;
                    }
                    for (; j0 < L; ++j0) {
                        const int32_t c0 = c[2 * j0];
                        if (c0 >= kend) break;
                        const float* x0 = xt + (int64_t)c0 * TB;
                        const __m256 w0 = bcast1(w + 2 * j0);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a0[v] = _mm256_fmadd_ps(w0, _mm256_load_ps(x0 + 8 * v), a0[v]);
                    }
                    for (; j1 < L; ++j1) {
                        const int32_t c1 = c[2 * j1 + 1];
                        if (c1 >= kend) break;
                        const float* x1 = xt + (int64_t)c1 * TB;
                        const __m256 w1 = bcast1(w + 2 * j1 + 1);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a1[v] = _mm256_fmadd_ps(w1, _mm256_load_ps(x1 + 8 * v), a1[v]);
                    }
                    pos[s - sb][0] = j0;
                    pos[s - sb][1] = j1;
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) {
                        _mm256_store_ps(q0 + 8 * v, a0[v]);
                        _mm256_store_ps(q1 + 8 * v, a1[v]);
                    }
                }
                if (last) break;
            }
        }
#else
        (void)kc;
        for (int64_t s = sb; s < se; ++s) {
            const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
            const int32_t* c = cols + p0;
            const WT* w = vals + p0;
            float* q0 = part[s - sb][0];
            float* q1 = part[s - sb][1];
            for (int i = 0; i < TB; ++i) q0[i] = q1[i] = 0.f;
            for (int64_t j = 0; j < L; ++j) {
                const float* x0 = xt + (int64_t)c[2 * j] * TB;
                const float* x1 = xt + (int64_t)c[2 * j + 1] * TB;
                for (int i = 0; i < TB; ++i) {
                    q0[i] += to_f32(w[2 * j]) * x0[i];
                    q1[i] += to_f32(w[2 * j + 1]) * x1[i];
                }
            }
        }
#endif
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        store_block(&part[0][0][0], TB, nt, r0, nr, R, bias, y, act);
    }
}

// One token: the panel path would spend a 32-byte load of mostly idle lanes on every kept weight. Instead
// each weight multiplies its scalar X value; each row sums its even and odd slots in two chains (latency),
// then adds them. Not auto-vectorised: gcc would turn the indexed loads into gathers, which are slower
// than scalar loads on AMD Zen.
template <typename XT, typename WT, typename YT>
__attribute__((optimize("no-tree-vectorize"))) void one_token(const XT* __restrict x, const int64_t* __restrict sptr,
                                                               const int32_t* __restrict cols,
                                                               const WT* __restrict vals, int64_t s0, int64_t s1,
                                                               int64_t R, const float* __restrict bias,
                                                               YT* __restrict y, bool act) {
    alignas(64) float out[2 * SBLOCK];
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
        for (int64_t s = sb; s < se; ++s) {
            const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
            const int32_t* c = cols + p0;
            const WT* w = vals + p0;
            float e0 = 0.f, e1 = 0.f, o0 = 0.f, o1 = 0.f;
            int64_t j = 0;
            for (; j + 2 <= L; j += 2) {
                const int32_t* cj = c + 2 * j;
                const WT* wj = w + 2 * j;
                e0 += to_f32(wj[0]) * to_f32(x[cj[0]]);
                o0 += to_f32(wj[1]) * to_f32(x[cj[1]]);
                e1 += to_f32(wj[2]) * to_f32(x[cj[2]]);
                o1 += to_f32(wj[3]) * to_f32(x[cj[3]]);
            }
            if (j < L) {
                e0 += to_f32(w[2 * j]) * to_f32(x[c[2 * j]]);
                o0 += to_f32(w[2 * j + 1]) * to_f32(x[c[2 * j + 1]]);
            }
            out[2 * (s - sb)] = e0 + e1;
            out[2 * (s - sb) + 1] = o0 + o1;
        }
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        if (bias)
            for (int64_t r = 0; r < nr; ++r) out[r] += bias[r0 + r];
        if (act) sparsa_gelu_inplace(out, nr);
        for (int64_t r = 0; r < nr; ++r) store_y(y + r0 + r, out[r]);
    }
}

template <typename XT, typename WT, typename YT>
void run_one_token(const XT* x, const int64_t* slice_ptr, const int32_t* cols, const WT* vals, int64_t R,
                   const float* bias, YT* y, int nthreads, bool act) {
    const int64_t ns = (R + 1) / 2, nblk = (ns + SBLOCK - 1) / SBLOCK;
    // whole blocks per thread, and fewer threads when there are too few weights to pay for waking them
    const int64_t by_work = std::max<int64_t>(1, slice_ptr[ns] / (1 << 15));
    const int nth = (int)std::max<int64_t>(1, std::min<int64_t>({(int64_t)nthreads, nblk, by_work}));
    if (nth == 1) {
        one_token(x, slice_ptr, cols, vals, 0, ns, R, bias, y, act);
        return;
    }
#pragma omp parallel for num_threads(nth) schedule(static)
    for (int i = 0; i < nth; ++i) {
        const int64_t s0 = nblk * i / nth * SBLOCK, s1 = std::min(ns, nblk * (i + 1) / nth * SBLOCK);
        if (s0 < s1) one_token(x, slice_ptr, cols, vals, s0, s1, R, bias, y, act);
    }
}

template <typename WT, typename YT>
using PanelFn = void (*)(const float*, int, int64_t, const int64_t*, const int32_t*, const WT*, int64_t, int64_t,
                         int64_t, const float*, YT*, bool);

template <typename XT, typename WT, typename YT>
void run(const XT* x, int64_t T, int64_t K, const int64_t* slice_ptr, const int32_t* cols, const WT* vals, int64_t R,
         const float* bias, YT* y, int nthreads, bool act) {
    if (T == 1) return run_one_token(x, slice_ptr, cols, vals, R, bias, y, nthreads, act);
    const int64_t ns = (R + 1) / 2;
    const int64_t npan = (T + TBMAX - 1) / TBMAX;
    int64_t nrc = 1;  // row chunks per panel
    if (nthreads > 1 && npan < 4 * nthreads) nrc = std::min<int64_t>(ns, (4 * nthreads + npan - 1) / npan);
    nrc = std::max<int64_t>(1, nrc);
    const int64_t per_chunk = (ns + nrc - 1) / nrc;
    const int64_t ntasks = npan * nrc;
    static const PanelFn<WT, YT> fns[5] = {nullptr, &panel_rows<1, WT, YT>, &panel_rows<2, WT, YT>,
                                           &panel_rows<3, WT, YT>, &panel_rows<4, WT, YT>};

    auto panel_tokens = [&](int64_t p) { return (int)std::min<int64_t>(TBMAX, T - p * TBMAX); };
    // 64-byte aligned panels: a 32-byte load that straddles two cache lines costs two
    auto aligned = [](std::vector<float>& buf, size_t n) {
        buf.resize(n + 16);
        return buf.data() + ((64 - (reinterpret_cast<uintptr_t>(buf.data()) & 63)) & 63) / sizeof(float);
    };
    auto rows = [&](int64_t id, const float* xt) {
        const int64_t p = id / nrc, rc = id % nrc;
        const int nt = panel_tokens(p), nv = (nt + 7) / 8;
        const int64_t s0 = rc * per_chunk, s1 = std::min(ns, s0 + per_chunk);
        if (s0 < s1) fns[nv](xt, nt, K, slice_ptr, cols, vals, s0, s1, R, bias, y + p * TBMAX * R, act);
    };
    auto transpose = [&](int64_t p, float* xt) {
        const int nt = panel_tokens(p);
        transpose_panel(x + p * TBMAX * K, K, nt, 8 * ((nt + 7) / 8), xt);
    };
    if (nthreads <= 1 || ntasks == 1) {
        std::vector<float> buf;
        float* xt = aligned(buf, (size_t)K * TBMAX);
        for (int64_t id = 0; id < ntasks; ++id) {
            if (id % nrc == 0) transpose(id / nrc, xt);
            rows(id, xt);
        }
    } else if (nrc == 1) {  // one task per panel: each thread transposes its own panels
#pragma omp parallel num_threads(nthreads)
        {
            std::vector<float> buf;
            float* xt = aligned(buf, (size_t)K * TBMAX);
#pragma omp for schedule(static)
            for (int64_t id = 0; id < ntasks; ++id) {
                transpose(id, xt);
                rows(id, xt);
            }
        }
    } else {  // few panels, split by rows: transpose each panel once, shared by its row chunks
        std::vector<float> buf;
        float* all = aligned(buf, (size_t)npan * K * TBMAX);
#pragma omp parallel num_threads(nthreads)
        {
#pragma omp for schedule(static)
            for (int64_t p = 0; p < npan; ++p) transpose(p, all + p * K * TBMAX);
#pragma omp for schedule(static)
            for (int64_t id = 0; id < ntasks; ++id) rows(id, all + (id / nrc) * K * TBMAX);
        }
    }
}

}  // namespace

extern "C" {

int sparsa_sliced_ell_version() { return 6; }

// x: [T, K]; slice_ptr: [ceil(R/2) + 1]; cols, vals: [slice_ptr[last]]; bias: [R] or null; y: [T, R];
// act: 0 none, 1 GELU (erf form) after the bias.
int sparsa_sliced_ell_linear_f32(const float* x, int64_t T, int64_t K, const int64_t* slice_ptr, const int32_t* cols,
                                 const float* vals, int64_t R, const float* bias, float* y, int nthreads, int act) {
    run(x, T, K, slice_ptr, cols, vals, R, bias, y, nthreads, act == 1);
    return 0;
}

// The same with bf16 (raw uint16 bits) x, vals and y; fp32 accumulation, y rounded to bf16 once (nearest
// even). bias: null, fp32 (bias_bf16 = 0) or bf16 (bias_bf16 = 1), added in fp32 before the rounding.
int sparsa_sliced_ell_linear_bf16(const uint16_t* x, int64_t T, int64_t K, const int64_t* slice_ptr,
                                  const int32_t* cols, const uint16_t* vals, int64_t R, const void* bias,
                                  int bias_bf16, uint16_t* y, int nthreads, int act) {
    std::vector<float> b32;
    const float* b = sparsa_bias_f32(bias, bias_bf16, R, b32);
    run(x, T, K, slice_ptr, cols, vals, R, b, y, nthreads, act == 1);
    return 0;
}

}  // extern "C"
