// bf16 operands for the union kernels (AVX512-BF16, run-time check): the forward, the stride-1 input gradient
// and the weight gradient of conv2d(relu(x), W) under bf16 autocast, with fp32 accumulation (bf16 outputs, an
// fp32 weight gradient).
//
// The operand is as in adaptive_union.cpp (values dense NHWC, one mask bit per element), in bf16. The weight
// pack pairs adjacent input channels: wp2[block][k][c / 2][o][2] = (W[o, c], W[o, c + 1]) for c even, so one
// VDPBF16PS multiplies 16 output channels by a pixel's (x[c], x[c + 1]) -- a single 32-bit broadcast from
// the operand. A channel pair runs when either channel is set in the union of the group's masks; its other
// channel is then a zero product.
//
//   forward  y[p, ob..ob+OB) = bf16(bias + sum_{off, pairs c in U} Wf[off, c, ob..] . x[q_i(p, off), c..c+1])
//   weight   S[row(c, off), ob..] = sum_{groups, c in U} sum_{pixel pairs} (dy[p_i], dy[p_i+1]) . (x[q_i, c], x[q_i+1, c])
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <memory>
#include <omp.h>
#include <vector>

#include "adaptive_geo.h"
#include "adaptive_transpose.h"
#include "adaptive_union_groups.h"
#include "cpu_isa.h"

namespace {

using sparsa_adaptive::Geo;
using sparsa_adaptive::Groups;
using sparsa_adaptive::mask_words;
using sparsa_adaptive::pick_ob;

#if defined(__GNUC__) && !defined(__clang__) && defined(__x86_64__)
#define SPARSA_UNION_DPBF16 1
#pragma GCC push_options
#pragma GCC target("avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma,bmi,popcnt")

constexpr uint64_t kEvenBits = 0x5555555555555555ull;

// One pixel's C contiguous bf16 channels -> (optional) masked copy dst and mask words m; returns its nnz.
// RELU keeps x > 0 (NaN dropped), else x != 0 (NaN and +-inf kept), as the fp32 operand.
template <bool RELU>
int64_t mask_pixel(const uint16_t* src, uint16_t* dst, uint64_t* m, int64_t C) {
    int64_t nnz = 0;
    const __m512 z = _mm512_setzero_ps();
    for (int64_t j = 0; j * 64 < C; ++j) {
        uint64_t word = 0;
        for (int k = 0; k < 4; ++k) {
            const int64_t c0 = j * 64 + 16 * k;
            if (c0 >= C) break;
            const __mmask16 lm = C - c0 >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (C - c0)) - 1);
            const __m256i h = _mm256_maskz_loadu_epi16(lm, src + c0);
            const __m512 v = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
            const __mmask16 nz = (RELU ? _mm512_cmp_ps_mask(v, z, _CMP_GT_OQ) : _mm512_cmp_ps_mask(v, z, _CMP_NEQ_UQ)) & lm;
            if (dst) _mm256_mask_storeu_epi16(dst + c0, lm, _mm256_maskz_mov_epi16(nz, h));
            word |= (uint64_t)nz << (16 * k);
        }
        m[j] = word;
        nnz += __builtin_popcountll(word);
    }
    return nnz;
}

// the bf16 pair (x[c], x[c + 1]) at p broadcast to 16 lanes
static inline __m512bh pair_bcast(const uint16_t* p) {
    uint32_t v;
    std::memcpy(&v, p, sizeof v);
    return (__m512bh)_mm512_set1_epi32((int)v);
}

// y at the PP pixels of group g of image n, output channels [ob, ob + 16 V), from the paired pack: the
// pair of input channels (c, c + 1) at kernel offset k holds wb + koff[k] + (c / 2) * 2 OB.
template <int V, int PP>
void fwd_group(const Geo& G, const Groups& GR, const uint16_t* xa, const uint64_t* bm, const uint16_t* zero,
               const uint64_t* zm, const uint16_t* wb, const int64_t* koff, int64_t OB, const float* bias,
               uint16_t* y, int64_t n, int64_t g, int64_t ob, const uint64_t* omask) {
    const int64_t NW = mask_words(G.C), HW = G.Ho * G.Wo;
    __m512 acc[PP][V];
    for (int i = 0; i < PP; ++i)
        for (int v = 0; v < V; ++v) acc[i][v] = bias ? _mm512_loadu_ps(bias + ob + 16 * v) : _mm512_setzero_ps();
    int64_t ho[PP], wo[PP];
    bool ok[PP];
    for (int i = 0; i < PP; ++i) ok[i] = GR.member(g, i, ho[i], wo[i]);
    for (int64_t kh = 0; kh < G.KH; ++kh)
        for (int64_t kw = 0; kw < G.KW; ++kw) {
            const uint16_t* xr[PP];
            const uint64_t* mr[PP];
            if (!sparsa_adaptive::offset_rows<uint16_t, PP>(G, ho, wo, ok, n, kh, kw, xa, bm, zero, zm, xr, mr)) continue;
            const uint16_t* w0 = wb + koff[kh * G.KW + kw];
            for (int64_t j = 0; j < NW; ++j) {
                uint64_t m = 0;
                for (int i = 0; i < PP; ++i) m |= mr[i][j];
                m = (m | (m >> 1)) & kEvenBits;  // pairs (c, c + 1) with c even
                while (m) {
                    const int64_t c = j * 64 + __builtin_ctzll(m);
                    m &= m - 1;
                    const uint16_t* wr = w0 + c * OB;  // (c / 2) * 2 OB
                    __m512bh w[V];
                    for (int v = 0; v < V; ++v) w[v] = (__m512bh)_mm512_loadu_si512(wr + 32 * v);
                    for (int i = 0; i < PP; ++i) {
                        const __m512bh b = pair_bcast(xr[i] + c);
                        for (int v = 0; v < V; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], w[v], b);
                    }
                }
            }
        }
    const int64_t NWo = mask_words(G.O);
    for (int i = 0; i < PP; ++i) {
        if (!ok[i]) continue;
        const int64_t p = n * HW + ho[i] * G.Wo + wo[i];
        uint16_t* yp = y + p * G.O + ob;
        for (int v = 0; v < V; ++v) {
            __m512 a = acc[i][v];
            if (omask) {
                const int64_t c = ob + 16 * v;
                a = _mm512_maskz_mov_ps((__mmask16)(omask[p * NWo + c / 64] >> (c % 64)), a);
            }
            _mm256_storeu_si256((__m256i*)(yp + 16 * v), (__m256i)_mm512_cvtneps_pbh(a));
        }
    }
}

template <int PP>
void fwd_group_v(int64_t V, const Geo& G, const Groups& GR, const uint16_t* xa, const uint64_t* bm,
                 const uint16_t* zero, const uint64_t* zm, const uint16_t* wb, const int64_t* koff, int64_t OB,
                 const float* bias, uint16_t* y, int64_t n, int64_t g, int64_t ob, const uint64_t* omask) {
    switch (V) {
        case 1: fwd_group<1, PP>(G, GR, xa, bm, zero, zm, wb, koff, OB, bias, y, n, g, ob, omask); break;
        case 2: fwd_group<2, PP>(G, GR, xa, bm, zero, zm, wb, koff, OB, bias, y, n, g, ob, omask); break;
        case 3: fwd_group<3, PP>(G, GR, xa, bm, zero, zm, wb, koff, OB, bias, y, n, g, ob, omask); break;
        default: fwd_group<4, PP>(G, GR, xa, bm, zero, zm, wb, koff, OB, bias, y, n, g, ob, omask); break;
    }
}

int fwd_run(const Geo& G, const uint16_t* xa, const uint64_t* bm, const uint16_t* wp, const float* bias, uint16_t* y,
            const uint64_t* omask, int tiles, int group, int nthreads) {
    const int64_t OB = pick_ob(G.O), K2 = G.KH * G.KW;
    const Groups GR(G, tiles != 0, group);
    const int64_t nob = G.O / OB, ng = GR.per_image, bstride = K2 * G.C * OB;
    std::vector<int64_t> koff((size_t)K2);
    for (int64_t k = 0; k < K2; ++k) koff[k] = k * G.C * OB;
    // about 32 pixels a task, fewer when that leaves under 8 tasks a thread (as the fp32 kernel)
    const int64_t most = 32 / group;
    const int64_t gpt = std::max<int64_t>(1, std::min<int64_t>(most, G.N * ng * nob / (8 * nthreads)));
    const int64_t ngt = (ng + gpt - 1) / gpt, ntask = nob * G.N * ngt;
    std::vector<uint16_t> zero((size_t)G.C + 32, 0);
    std::vector<uint64_t> zm((size_t)mask_words(G.C), 0);
#pragma omp parallel for schedule(dynamic, 1) num_threads(nthreads)
    for (int64_t t = 0; t < ntask; ++t) {
        const int64_t obi = t / (G.N * ngt), n = (t / ngt) % G.N, gt = t % ngt;
        const uint16_t* wb = wp + obi * bstride;
        for (int64_t gi = gt * gpt; gi < std::min(ng, gt * gpt + gpt); ++gi) {
            switch (GR.pg) {
                case 1: fwd_group_v<1>(OB / 16, G, GR, xa, bm, zero.data(), zm.data(), wb, koff.data(), OB, bias, y, n, gi, obi * OB, omask); break;
                case 2: fwd_group_v<2>(OB / 16, G, GR, xa, bm, zero.data(), zm.data(), wb, koff.data(), OB, bias, y, n, gi, obi * OB, omask); break;
                default: fwd_group_v<4>(OB / 16, G, GR, xa, bm, zero.data(), zm.data(), wb, koff.data(), OB, bias, y, n, gi, obi * OB, omask); break;
            }
        }
    }
    return 0;
}

// Weight gradient block blk[c - 64 j][0..16 V) (channels of mask word j, output channels ob..) at kernel offset
// (kh, kw) over the pixel groups [g0, g1), as the fp32 union kernel's, with the group's pixels paired: dY rows of
// members (0, 1) and (2, 3) interleaved once per group, and per channel the pair (x[q0, c], x[q1, c]) broadcast,
// so one VDPBF16PS adds two pixels' products per output channel.
template <int V>
void wgrad_block(const Geo& G, const Groups& GR, const uint16_t* xa, const uint64_t* bm, const uint16_t* zero,
                 const uint16_t* dy, float* blk, int64_t OB, int64_t kh, int64_t kw, int64_t j, int64_t ob, int64_t g0,
                 int64_t g1) {
    const int64_t NW = mask_words(G.C), HW = G.Ho * G.Wo;
    std::memset(blk, 0, sizeof(float) * std::min<int64_t>(64, G.C - j * 64) * OB);
    float* b0 = blk - j * 64 * OB;  // indexed by absolute channel
    // word t of the interleave: t even from the first row, odd from the second (16 words each)
    alignas(64) uint16_t lanes[32];
    for (int t = 0; t < 32; ++t) lanes[t] = (uint16_t)((t & 1) ? 32 + t / 2 : t / 2);
    const __m512i inter = _mm512_load_si512(lanes);
    int64_t n = g0 / GR.per_image, g = g0 - n * GR.per_image;
    for (int64_t gg = g0; gg < g1; ++gg) {
        const uint16_t* dr[4];
        const uint16_t* xr[4];
        uint64_t m = 0;
        for (int i = 0; i < 4; ++i) {
            xr[i] = zero;
            dr[i] = zero;
            int64_t ho, wo;
            if (!GR.member(g, i, ho, wo)) continue;
            dr[i] = dy + (n * HW + ho * G.Wo + wo) * G.O + ob;
            const int64_t hi = ho * G.sh - G.ph + kh * G.dh, wi = wo * G.sw - G.pw + kw * G.dw;
            if (hi >= 0 && hi < G.H && wi >= 0 && wi < G.W) {
                const int64_t q = (n * G.H + hi) * G.W + wi;
                xr[i] = xa + q * G.C;
                m |= bm[q * NW + j];
            }
        }
        if (++g == GR.per_image) g = 0, ++n;
        if (!m) continue;
        __m512bh d[2][V];
        for (int h = 0; h < 2; ++h)
            for (int v = 0; v < V; ++v) {
                const __m512i a = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(dr[2 * h] + 16 * v)));
                const __m512i b = _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i*)(dr[2 * h + 1] + 16 * v)));
                d[h][v] = (__m512bh)_mm512_permutex2var_epi16(a, inter, b);
            }
        while (m) {
            const int64_t c = j * 64 + __builtin_ctzll(m);
            m &= m - 1;
            const __m512bh x01 = (__m512bh)_mm512_set1_epi32((int)((uint32_t)xr[0][c] | ((uint32_t)xr[1][c] << 16)));
            const __m512bh x23 = (__m512bh)_mm512_set1_epi32((int)((uint32_t)xr[2][c] | ((uint32_t)xr[3][c] << 16)));
            float* r = b0 + c * OB;
            for (int v = 0; v < V; ++v) {
                __m512 a = _mm512_loadu_ps(r + 16 * v);
                a = _mm512_dpbf16_ps(a, d[0][v], x01);
                a = _mm512_dpbf16_ps(a, d[1][v], x23);
                _mm512_storeu_ps(r + 16 * v, a);
            }
        }
    }
}

void wgrad_block_any(int64_t V, const Geo& G, const Groups& GR, const uint16_t* xa, const uint64_t* bm,
                     const uint16_t* zero, const uint16_t* dy, float* blk, int64_t OB, int64_t kh, int64_t kw, int64_t j,
                     int64_t ob, int64_t g0, int64_t g1) {
    switch (V) {
        case 1: wgrad_block<1>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        case 2: wgrad_block<2>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        case 3: wgrad_block<3>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
        default: wgrad_block<4>(G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1); break;
    }
}

// n (a multiple of 16) bf16 pairs at d from the floats a[i] (low half) and b[i], rounded to nearest even
inline void pair_two(const float* a, const float* b, int64_t n, uint16_t* d) {
    for (int64_t o = 0; o < n; o += 16) {
        const __m512i lo = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + o)));
        const __m512i hi = _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(b + o)));
        _mm512_storeu_si512(d + 2 * o, _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
}

// n (a multiple of 16) floats at a as bf16 at d
inline void round_row(const float* a, int64_t n, uint16_t* d) {
    for (int64_t o = 0; o < n; o += 16)
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(d + o), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(a + o)));
}

#pragma GCC pop_options
#endif

}  // namespace

extern "C" {

// 1 when this CPU runs the bf16 union kernels (the union kernels' AVX-512 plus AVX512-BF16, as SPARSA_ISA allows).
int sparsa_union_has_dpbf16() {
#ifdef SPARSA_UNION_DPBF16
    return sparsa_cpu_dpbf16_enabled() ? 1 : 0;
#else
    return 0;
#endif
}

// The bf16 operand of x (NHWC contiguous, [N, H, W, C]): as sparsa_union_compact_f32 (relu != 0 keeps x > 0,
// else x != 0; xa may be null for the masks alone; union4 may be null). Returns the number of nonzeros, or -1
// without AVX512-BF16.
int64_t sparsa_union_compact_bf16(const uint16_t* x, int64_t N, int64_t C, int64_t H, int64_t W, int relu, uint16_t* xa,
                                  uint64_t* bm, int64_t* union4, int nthreads) {
    if (!sparsa_union_has_dpbf16()) return -1;
#ifdef SPARSA_UNION_DPBF16
    const int64_t NW = mask_words(C), P = N * H * W;
    int64_t total = 0, uni = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total, uni)
    {
#pragma omp for schedule(static)
        for (int64_t q = 0; q < P; ++q) {
            uint16_t* dst = xa ? xa + q * C : nullptr;
            total += relu ? mask_pixel<true>(x + q * C, dst, bm + q * NW, C) : mask_pixel<false>(x + q * C, dst, bm + q * NW, C);
        }
        if (union4) uni += sparsa_adaptive::union4_share(bm, N, H * W, NW);
    }
    if (union4) *union4 = uni;
    return total;
#else
    return -1;
#endif
}

// T[b] = A[b]^T for B batches of R x M 16-bit matrices (row-major, contiguous): NCHW <-> NHWC for bf16 activations
// (R = C, M = H*W, or the reverse). AVX2 16x16 tiles.
void sparsa_transpose16(const uint16_t* A, int64_t B, int64_t R, int64_t M, uint16_t* T, int nthreads) {
    sparsa_adaptive::transpose16(A, B, R, M, T, nthreads);
}

// The bf16 packs of the union path straight from W [O, C, KH, KW] (OIHW or channels-last strides ws), rounded to
// nearest even, once per weight version: wf2 [O / OB][KH][KW][C / 2][OB][2] (sparsa_union_pack_f32's wf with
// adjacent input channels paired), wfl2 [C / OB'][KH][KW][O / 2][OB'][2] (its wfl, adjacent output channels paired)
// and wc [C][KH][KW][O] (the input gradient's rows at relu(x)'s nonzeros); wf2 and wc, or wfl2, may be null.
// One transpose of W to output channels innermost, then each block rounded and paired from it: the fp32 packs are
// never written. Returns 1 when OB or OB' is not a multiple of 16, 2 without AVX512-BF16, 3 for other strides.
int sparsa_union_pair_packs_bf16(const float* w, const int64_t* ws, int64_t O, int64_t C, int64_t KH, int64_t KW,
                                 uint16_t* wf2, uint16_t* wfl2, uint16_t* wc, int nthreads) {
    const int64_t K2 = KH * KW;
    if (O % 8 || C % 8) return 1;
    const int64_t OB = pick_ob(O), nob = O / OB, OB2 = pick_ob(C), ncb = C / OB2;
    if (OB % 16 || (wfl2 && OB2 % 16) || C % 2 || O % 2) return 1;
    if (!sparsa_union_has_dpbf16()) return 2;
    const bool oihw = ws[0] == C * K2 && ws[1] == K2 && ws[2] == KW && ws[3] == 1;
    const bool cl = ws[0] == K2 * C && ws[1] == 1 && ws[2] == KW * C && ws[3] == C;
    if (!oihw && !cl) return 3;
#ifdef SPARSA_UNION_DPBF16
    // T: W with its output channels innermost, rows (c, k) at c * K2 + k (OIHW) or k * C + c (channels-last)
    std::unique_ptr<float[]> T(new float[(size_t)O * C * K2]);
    sparsa_adaptive::transpose(w, O, C * K2, T.get(), nthreads);
    const int64_t rc_ = oihw ? K2 : 1, rk_ = oihw ? 1 : C;  // row of (c, k) = c * rc_ + k * rk_
    auto row = [&](int64_t c, int64_t k) { return T.get() + (c * rc_ + k * rk_) * O; };
#pragma omp parallel num_threads(nthreads)
    {
        if (wf2) {
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < nob * K2; ++t) {
                const int64_t b = t / K2, k = t % K2;
                uint16_t* dst = wf2 + (b * K2 + k) * C * OB;
                for (int64_t c = 0; c < C; c += 2) pair_two(row(c, k) + b * OB, row(c + 1, k) + b * OB, OB, dst + c * OB);
            }
        }
        if (wc) {
#pragma omp for schedule(static) nowait
            for (int64_t t = 0; t < C * K2; ++t) round_row(row(t / K2, t % K2), O, wc + t * O);
        }
        if (wfl2) {
            std::unique_ptr<float[]> tile(new float[(size_t)O * OB2]);  // [o][c] of one block of OB2 channels
#pragma omp for schedule(static)
            for (int64_t t = 0; t < ncb * K2; ++t) {
                const int64_t cb = t / K2, k = t % K2, kf = K2 - 1 - k;
                for (int64_t c8 = 0; c8 < OB2; c8 += 8)
                    for (int64_t o8 = 0; o8 < O; o8 += 8)
                        sparsa_adaptive::tr8x8(row(cb * OB2 + c8, kf) + o8, rc_ * O, tile.get() + o8 * OB2 + c8, OB2);
                uint16_t* dst = wfl2 + (cb * K2 + k) * O * OB2;
                for (int64_t o = 0; o < O; o += 2)
                    pair_two(tile.get() + o * OB2, tile.get() + (o + 1) * OB2, OB2, dst + o * OB2);
            }
        }
    }
    return 0;
#else
    return 2;
#endif
}

// y [N, Ho, Wo, O] bf16 (NHWC) = conv(xa, W) + bias (fp32, may be null) from the paired pack wp2 of the forward
// pack [O / OB][KH][KW][C][OB]; omask, tiles and group as sparsa_union_conv_fwd_f32 (with the flipped conv's
// geometry and paired pack over dY's operand, and relu(x)'s masks as omask: the stride-1 input gradient).
// Returns 1 for a bad geometry or group, 2 without AVX512-BF16.
int sparsa_union_conv_fwd_bf16(const int64_t* g, const uint16_t* xa, const uint64_t* bm, const uint16_t* wp2,
                               const float* bias, uint16_t* y, const uint64_t* omask, int tiles, int group, int nthreads) {
    const Geo G(g);
    if (G.O % 8 || G.C % 2 || pick_ob(G.O) % 16 || (group != 1 && group != 2 && group != 4)) return 1;
    if (!sparsa_union_has_dpbf16()) return 2;
#ifdef SPARSA_UNION_DPBF16
    return fwd_run(G, xa, bm, wp2, bias, y, omask, tiles, group, nthreads);
#else
    return 2;
#endif
}

// The weight gradient of conv2d over the bf16 operand (xa, bm) and the bf16 output gradient dy [N*Ho*Wo, O]
// (contiguous), accumulated in fp32 into the rows of S as sparsa_union_conv_wgrad_f32 writes them. Returns 1 for a
// bad geometry, 2 without AVX512-BF16.
int sparsa_union_conv_wgrad_bf16(const int64_t* g, const uint16_t* xa, const uint64_t* bm, const uint16_t* dy, float* S,
                                 const int64_t* rs, int64_t ldS, int tiles, int nthreads) {
    const Geo G(g);
    const int64_t OB = pick_ob(G.O);
    if (G.O % 8 || OB % 16) return 1;
    if (!sparsa_union_has_dpbf16()) return 2;
#ifdef SPARSA_UNION_DPBF16
    sparsa_adaptive::wgrad_run<uint16_t>(G, S, rs, ldS, tiles, nthreads,
                                         [&](const Groups& GR, const uint16_t* zero, float* blk, int64_t kh, int64_t kw,
                                             int64_t j, int64_t ob, int64_t g0, int64_t g1) {
                                             wgrad_block_any(OB / 16, G, GR, xa, bm, zero, dy, blk, OB, kh, kw, j, ob, g0, g1);
                                         });
    return 0;
#else
    return 2;
#endif
}

}  // extern "C"
