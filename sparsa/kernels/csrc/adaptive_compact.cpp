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
// Entries past the count are not written. Returns the total number of nonzeros.
#include <cstdint>
#include <cstring>
#include <immintrin.h>
#include <omp.h>

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

alignas(32) const int32_t kLaneIdx[8] = {0, 1, 2, 3, 4, 5, 6, 7};

}  // namespace

extern "C" {

int64_t sparsa_adaptive_compact_f32(const float* x, int64_t N, int64_t C, int64_t H, int64_t W,
                                    int64_t sn, int64_t sc, int64_t sh, int64_t sw, int64_t CS,
                                    int32_t* cnt, int32_t* idx, float* val, int nthreads) {
    const int64_t S = (C + CS - 1) / CS;
    const int64_t rows = N * H;
    int64_t total = 0;
#pragma omp parallel for schedule(dynamic, 4) num_threads(nthreads) reduction(+ : total)
    for (int64_t r = 0; r < rows; ++r) {
        const int64_t n = r / H, h = r % H;
        const float* xr = x + n * sn + h * sh;
        const int64_t q0 = r * W;
        int64_t local = 0;
        if (sc == 1) {
            // channels contiguous: AVX2 left-pack of 8 channels at a time
            const __m256 zero = _mm256_setzero_ps();
            const __m256i lane = _mm256_load_si256(reinterpret_cast<const __m256i*>(kLaneIdx));
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
                        int m = _mm256_movemask_ps(_mm256_cmp_ps(v, zero, _CMP_GT_OQ));
                        if (!m) continue;
                        __m256i p = _mm256_load_si256(reinterpret_cast<const __m256i*>(kPerm.perm[m]));
                        int pc = kPerm.pop[m];
                        __m256i keep = _mm256_cmpgt_epi32(_mm256_set1_epi32(pc), lane);
                        _mm256_maskstore_ps(vp + k, keep, _mm256_permutevar8x32_ps(v, p));
                        _mm256_maskstore_epi32(ip + k, keep,
                                               _mm256_add_epi32(p, _mm256_set1_epi32((int32_t)c)));
                        k += pc;
                    }
                    for (; c < c1; ++c) {
                        float v = xp[c];
                        if (v > 0.f) { ip[k] = (int32_t)c; vp[k] = v; ++k; }
                    }
                    cnt[q * S + s] = k;
                    local += k;
                }
            }
        } else {
            // channel-strided (NCHW): sweep channels outer, pixels of the row inner
            for (int64_t w = 0; w < W; ++w)
                for (int64_t s = 0; s < S; ++s) cnt[(q0 + w) * S + s] = 0;
            for (int64_t c = 0; c < C; ++c) {
                const int64_t s = c / CS;
                const float* xc = xr + c * sc;
                for (int64_t w = 0; w < W; ++w) {
                    float v = xc[w * sw];
                    if (v > 0.f) {
                        const int64_t q = q0 + w;
                        int32_t k = cnt[q * S + s]++;
                        idx[q * C + s * CS + k] = (int32_t)c;
                        val[q * C + s * CS + k] = v;
                        ++local;
                    }
                }
            }
        }
        total += local;
    }
    return total;
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

}  // extern "C"
