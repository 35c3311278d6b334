// Fused ReLU + dense-to-compact conversion of an activation (sparsa adaptive runtime).
//
// Input: a float tensor with logical shape [N, C, H, W] and arbitrary element strides (NCHW,
// channels-last, or a [P, K] matrix seen as N=1, H=P, W=1). The ReLU is applied on the fly
// (only x > 0 is kept), so the kernel can read either a pre-activation or a ReLU output.
//
// Output, "sliced padded CSR" over pixels q = (n*H + h)*W + w, channels cut in slices of CS:
//   cnt[q*S + s]            number of nonzeros of pixel q in channel slice s  (S = ceil(C/CS))
//   idx[q*C + s*CS + j]     channel index (ascending) of the j-th nonzero, j < cnt[q*S+s]
//   val[q*C + s*CS + j]     its value
// Entries past the count are not written (the _zeroed variant writes 0 there: canonical components, as
// the ReluCompact layout stores them). Returns the total number of nonzeros.
//
// sparsa_adaptive_compact_signed_f32 is the same conversion without the ReLU: it keeps every
// element that is != 0 (negative values, NaN and +-inf too; -0.0 compares equal to 0 and is
// dropped). The input-gradient path over a sparse output gradient dY compacts dY with it.
// sparsa_adaptive_mask_f32 applies the ReLU derivative of an operand (keep only its nonzeros);
// sparsa_adaptive_restrict_f32 does the same out of place, from any strides; sparsa_adaptive_to_dense_f32
// rebuilds the dense activation.
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>
#include <vector>

#include "adaptive_transpose.h"

namespace {

struct PermTable {
    alignas(32) int32_t perm[256][8];
    int32_t pop[256];
    PermTable() {
        for (int m = 0; m < 256; ++m) {
            int k = 0;
            for (int b = 0; b < 8; ++b)
                if (m & (1 << b)) perm[m][k++] = b;
            pop[m] = k;
            for (; k < 8; ++k) perm[m][k] = 0;
        }
    }
};
const PermTable kPerm;

// Kept elements: x > 0 (fused ReLU) or, SIGNED, x != 0 (unordered compare: NaN is kept).
template <bool SIGNED>
inline bool keep(float v) { return SIGNED ? !(v == 0.f) : v > 0.f; }

// Entries [k, n) of one slice's idx/val set to 0 (ZERO) or left as they are.
template <bool ZERO>
inline void zero_tail(int32_t* ip, float* vp, int64_t k, int64_t n) {
    if (ZERO && k < n) {
        std::memset(ip + k, 0, sizeof(int32_t) * (n - k));
        std::memset(vp + k, 0, sizeof(float) * (n - k));
    }
}

// One row of W pixels whose channels are contiguous (pixel w at xr + w * sw): AVX2 left-pack of
// 8 channels at a time. Returns the row's nonzero count.
template <bool SIGNED, bool ZERO>
int64_t compact_row_cl(const float* xr, int64_t sw, int64_t W, int64_t C, int64_t CS, int64_t S, int64_t q0,
                       int32_t* cnt, int32_t* idx, float* val) {
    const __m256 zero = _mm256_setzero_ps();
    int64_t local = 0;
    for (int64_t w = 0; w < W; ++w) {
        const float* xp = xr + w * sw;
        const int64_t q = q0 + w;
        for (int64_t s = 0; s < S; ++s) {
            const int64_t c0 = s * CS, c1 = (c0 + CS < C) ? c0 + CS : C;
            int32_t* ip = idx + q * C + c0;
            float* vp = val + q * C + c0;
            int32_t k = 0;
            int64_t c = c0;
            for (; c + 8 <= c1; c += 8) {
                __m256 v = _mm256_loadu_ps(xp + c);
                int m = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, SIGNED ? _CMP_NEQ_UQ : _CMP_GT_OQ));
                if (!m) continue;
                __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPerm.perm[m]));
                int pc = kPerm.pop[m];
                // full (unmasked) stores: k <= c - c0 and c + 8 <= c1, so the 8 lanes stay inside
                // this slice; lanes past the count are overwritten later or ignored (masked stores
                // are microcoded and slow on some CPUs)
                _mm256_storeu_ps(vp + k, _mm256_permutevar8x32_ps(v, p));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(ip + k),
                                    _mm256_add_epi32(p, _mm256_set1_epi32((int32_t)c)));
                k += pc;
            }
            for (; c < c1; ++c) {
                float v = xp[c];
                if (keep<SIGNED>(v)) { ip[k] = (int32_t)c; vp[k] = v; ++k; }
            }
            cnt[q * S + s] = k;
            zero_tail<ZERO>(ip, vp, k, c1 - c0);
            local += k;
        }
    }
    return local;
}

template <bool SIGNED, bool ZERO>
int64_t compact_impl(const float* x, int64_t N, int64_t C, int64_t H, int64_t W, int64_t sn, int64_t sc,
                     int64_t sh, int64_t sw, int64_t CS, int32_t* cnt, int32_t* idx, float* val, int nthreads) {
    const int64_t S = (C + CS - 1) / CS;
    const int64_t rows = N * H;
    int64_t total = 0;
#pragma omp parallel num_threads(nthreads) reduction(+ : total)
    {
        std::vector<float> buf;  // NCHW rows: the row transposed to [W][C] (8x8 AVX2 tiles)
#pragma omp for schedule(dynamic, 4)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = r / H, h = r % H;
            const float* xr = x + n * sn + h * sh;
            const int64_t q0 = r * W;
            if (sc == 1) {
                total += compact_row_cl<SIGNED, ZERO>(xr, sw, W, C, CS, S, q0, cnt, idx, val);
            } else if (sw == 1) {
                if ((int64_t)buf.size() < W * C) buf.resize(W * C);
                float* t = buf.data();
                int64_t c = 0;
                for (; c + 8 <= C; c += 8) {
                    int64_t w = 0;
                    for (; w + 8 <= W; w += 8) sparsa_adaptive::tr8x8(xr + c * sc + w, sc, t + w * C + c, C);
                    for (; w < W; ++w)
                        for (int64_t i = 0; i < 8; ++i) t[w * C + c + i] = xr[(c + i) * sc + w];
                }
                for (; c < C; ++c)
                    for (int64_t w = 0; w < W; ++w) t[w * C + c] = xr[c * sc + w];
                total += compact_row_cl<SIGNED, ZERO>(t, C, W, C, CS, S, q0, cnt, idx, val);
            } else {
                // general strides: channels outer, pixels of the row inner
                int64_t local = 0;
                for (int64_t w = 0; w < W; ++w)
                    for (int64_t s = 0; s < S; ++s) cnt[(q0 + w) * S + s] = 0;
                for (int64_t c = 0; c < C; ++c) {
                    const int64_t s = c / CS;
                    const float* xc = xr + c * sc;
                    for (int64_t w = 0; w < W; ++w) {
                        float v = xc[w * sw];
                        if (keep<SIGNED>(v)) {
                            const int64_t q = q0 + w;
                            int32_t k = cnt[q * S + s]++;
                            idx[q * C + s * CS + k] = (int32_t)c;
                            val[q * C + s * CS + k] = v;
                            ++local;
                        }
                    }
                }
                for (int64_t w = 0; ZERO && w < W; ++w)
                    for (int64_t s = 0; s < S; ++s) {
                        const int64_t q = q0 + w, c0 = s * CS, n = (c0 + CS < C ? c0 + CS : C) - c0;
                        zero_tail<ZERO>(idx + q * C + c0, val + q * C + c0, cnt[q * S + s], n);
                    }
                total += local;
            }
        }
    }
    return total;
}

}  // namespace

extern "C" {

int64_t sparsa_adaptive_compact_f32(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                                    int64_t sn, int64_t sc, int64_t sh, int64_t sw, int64_t CS,
                                    int32_t* cnt, int32_t* idx, float* val, int nthreads) {
    return compact_impl<false, false>(x, N, C, H, W, sn, sc, sh, sw, CS, cnt, idx, val, nthreads);
}

int64_t sparsa_adaptive_compact_zeroed_f32(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                                           int64_t sn, int64_t sc, int64_t sh, int64_t sw, int64_t CS,
                                           int32_t* cnt, int32_t* idx, float* val, int nthreads) {
    return compact_impl<false, true>(x, N, C, H, W, sn, sc, sh, sw, CS, cnt, idx, val, nthreads);
}

int64_t sparsa_adaptive_compact_signed_f32(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                                           int64_t sn, int64_t sc, int64_t sh, int64_t sw, int64_t CS,
                                           int32_t* cnt, int32_t* idx, float* val, int nthreads) {
    return compact_impl<true, false>(x, N, C, H, W, sn, sc, sh, sw, CS, cnt, idx, val, nthreads);
}

// ReLU derivative of a compacted operand (cnt, idx over [N, C, H, W], slices of CS channels):
// y is a dense NHWC [N*H*W, C] tensor. dx == nullptr: y itself keeps only the operand's nonzero
// positions (the others set to 0). Otherwise dx (logical [N, C, H, W], element strides das[4],
// zero-filled by the caller) receives y at those positions.
void sparsa_adaptive_mask_f32(float* y, int64_t N, int64_t C, int64_t H, int64_t W, int64_t CS,
                              const int32_t* cnt, const int32_t* idx, float* dx, const int64_t* das,
                              int nthreads) {
    const int64_t S = (C + CS - 1) / CS;
    const int64_t rows = N * H;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<float> keep_buf(dx ? 0 : C);
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; ++r) {
            const int64_t n = r / H, h = r % H;
            for (int64_t w = 0; w < W; ++w) {
                const int64_t q = r * W + w;
                float* yr = y + q * C;
                if (dx) {
                    float* base = dx + n * das[0] + h * das[2] + w * das[3];
                    for (int64_t s = 0; s < S; ++s) {
                        const int32_t* ii = idx + q * C + s * CS;
                        for (int32_t j = 0, e = cnt[q * S + s]; j < e; ++j) base[ii[j] * das[1]] = yr[ii[j]];
                    }
                    continue;
                }
                // in place: gather the kept values, clear the row, scatter them back
                const int32_t* ii = idx + q * C;
                float* kb = keep_buf.data();
                int64_t tot = 0;
                for (int64_t s = 0; s < S; ++s) {
                    const int32_t* is = ii + s * CS;
                    for (int32_t j = 0, e = cnt[q * S + s]; j < e; ++j) kb[tot++] = yr[is[j]];
                }
                if (tot == C) continue;
                std::memset(yr, 0, sizeof(float) * C);
                tot = 0;
                for (int64_t s = 0; s < S; ++s) {
                    const int32_t* is = ii + s * CS;
                    for (int32_t j = 0, e = cnt[q * S + s]; j < e; ++j) yr[is[j]] = kb[tot++];
                }
            }
        }
    }
}

// Monitor sample: for m sampled pixels (element offsets base[i] of channel 0, channel stride sc),
// count zero elements and empty channel slices. out[0] = zeros, out[1] = empty (pixel, slice) lists.
void sparsa_adaptive_sample_f32(const float* x, const int64_t* base, int64_t m, int64_t C, int64_t sc,
                                int64_t CS, int64_t* out) {
    int64_t zeros = 0, empty = 0;
    for (int64_t i = 0; i < m; ++i) {
        const float* p = x + base[i];
        for (int64_t c0 = 0; c0 < C; c0 += CS) {
            const int64_t c1 = (c0 + CS < C) ? c0 + CS : C;
            int64_t z = 0;
            for (int64_t c = c0; c < c1; ++c) z += (p[c * sc] == 0.f);
            zeros += z;
            empty += (z == c1 - c0);
        }
    }
    out[0] = zeros;
    out[1] = empty;
}

// The dense NHWC [N*H*W, C] tensor an operand (cnt, idx, val; slices of CS channels) encodes:
// every row zeroed, then its kept values stored at their channels. Rows are independent.
void sparsa_adaptive_to_dense_f32(int64_t N, int64_t C, int64_t H, int64_t W, int64_t CS, const int32_t* cnt,
                                  const int32_t* idx, const float* val, float* out, int nthreads) {
    const int64_t S = (C + CS - 1) / CS;
    const int64_t P = N * H * W;
#pragma omp parallel for num_threads(nthreads) schedule(static)
    for (int64_t q = 0; q < P; ++q) {
        float* o = out + q * C;
        std::memset(o, 0, sizeof(float) * C);
        for (int64_t s = 0; s < S; ++s) {
            const int64_t at = q * C + s * CS;
            const int32_t* is = idx + at;
            const float* vs = val + at;
            for (int32_t j = 0, e = cnt[q * S + s]; j < e; ++j) o[is[j]] = vs[j];
        }
    }
}

// out (dense NHWC [N*H*W, C]) = g (logical [N, C, H, W], element strides gs[4]) at the positions the
// operand (cnt, idx) holds, +0.0 elsewhere (NaN and inf too: a bitwise select, not a multiply).
void sparsa_adaptive_restrict_f32(const float* g, int64_t N, int64_t C, int64_t H, int64_t W, const int64_t* gs,
                                  int64_t CS, const int32_t* cnt, const int32_t* idx, float* out, int nthreads) {
    const int64_t S = (C + CS - 1) / CS;
    const int64_t P = N * H * W;
#pragma omp parallel num_threads(nthreads)
    {
        std::vector<uint32_t> keep(C);  // per pixel: all ones where kept, else 0
#pragma omp for schedule(static)
        for (int64_t q = 0; q < P; ++q) {
            const int64_t n = q / (H * W), h = (q / W) % H, w = q % W;
            const float* gq = g + n * gs[0] + h * gs[2] + w * gs[3];
            uint32_t* k = keep.data();
            std::memset(k, 0, sizeof(uint32_t) * C);
            for (int64_t s = 0; s < S; ++s) {
                const int32_t* is = idx + q * C + s * CS;
                for (int32_t j = 0, e = cnt[q * S + s]; j < e; ++j) k[is[j]] = 0xFFFFFFFFu;
            }
            uint32_t* o = reinterpret_cast<uint32_t*>(out + q * C);
            if (gs[1] == 1) {
                const uint32_t* gu = reinterpret_cast<const uint32_t*>(gq);
                for (int64_t c = 0; c < C; ++c) o[c] = gu[c] & k[c];
            } else {
                for (int64_t c = 0; c < C; ++c) {
                    uint32_t v;
                    std::memcpy(&v, gq + c * gs[1], sizeof(v));
                    o[c] = v & k[c];
                }
            }
        }
    }
}

}  // extern "C"
