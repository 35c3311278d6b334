// The FMA rows of the SlicedELL kernel (sliced_ell_linear.cpp), written once over a vector of VW floats and
// included once per width: AVX2 (8 floats) and, inside an AVX-512 target region, 16 floats. The including
// namespace provides vec, VW, TWO_SLICE_NV (the most vectors per row for which two slices' sums fit in
// registers), vzero(), vload(p) (aligned), vstore(p, v), vfma(a, b, c) = a * b + c, and
// bcast1 / bcast2 for float and bf16 (uint16_t) weights; the enclosing scope SBLOCK, chunk_slots and
// store_block. Each lane sums its own token's products in slot order, so both widths give identical results.
// No include guard: it is included once per vector width.

// Slot j of a slice (its entries c[2j], c[2j + 1] and weights w[2j], w[2j + 1]) into both rows' sums.
template <int NV, int TB, typename WT>
__attribute__((always_inline)) inline void slot_fma(const float* __restrict xt, const int32_t* __restrict c,
                                                    const WT* __restrict w, int64_t j, vec* a0, vec* a1) {
    const float* x0 = xt + (int64_t)c[2 * j] * TB;
    const float* x1 = xt + (int64_t)c[2 * j + 1] * TB;
    vec w0, w1;
    bcast2(w + 2 * j, w0, w1);
#pragma GCC unroll 8
    for (int v = 0; v < NV; ++v) {
        a0[v] = vfma(w0, vload(x0 + VW * v), a0[v]);
        a1[v] = vfma(w1, vload(x1 + VW * v), a1[v]);
    }
}

// Rows of slices [s0, s1) for one panel of nt tokens (TB = VW * NV lanes in xt, 64-byte aligned). WT / YT:
// float, or uint16_t for bf16 weight values / output.
//
// With nch > 1, K is walked in chunks of KCHUNK columns for a block of SBLOCK slices at a time; each row
// takes its next slots up to its bound for the chunk (see chunk_bounds; the last chunk takes the rest).
// The two rows of a slice run together while both have slots in the chunk, then the longer one alone.
// Per row the products are added in slot order, chunked or not, so the result does not depend on nch.
template <int NV, typename WT, typename YT>
void panel_rows(const float* __restrict xt, int nt, const int64_t* __restrict sptr, const int32_t* __restrict cols,
                const WT* __restrict vals, const int32_t* __restrict bounds, int64_t nch, int64_t s0, int64_t s1,
                int64_t R, const float* __restrict bias, YT* __restrict y, bool act) {
    constexpr int TB = VW * NV;
    alignas(64) float part[SBLOCK][2][TB];
    for (int64_t sb = s0; sb < s1; sb += SBLOCK) {
        const int64_t se = std::min(s1, sb + SBLOCK);
        if (nch == 1) {  // one chunk: both rows of a slice walk their padded slot lists in step
            int64_t s = sb;
            // two slices at a time where their sums fit in registers, so four rows' FMA chains are in flight
            if (NV <= TWO_SLICE_NV)
                for (; s + 2 <= se; s += 2) {
                    const int64_t pa = sptr[s], pb = sptr[s + 1];
                    const int64_t La = (pb - pa) / 2, Lb = (sptr[s + 2] - pb) / 2, both = std::min(La, Lb);
                    vec a0[NV], a1[NV], b0[NV], b1[NV];
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) a0[v] = a1[v] = b0[v] = b1[v] = vzero();
                    int64_t j = 0;
                    for (; j < both; ++j) {
                        slot_fma<NV, TB>(xt, cols + pa, vals + pa, j, a0, a1);
                        slot_fma<NV, TB>(xt, cols + pb, vals + pb, j, b0, b1);
                    }
                    for (int64_t i = j; i < La; ++i) slot_fma<NV, TB>(xt, cols + pa, vals + pa, i, a0, a1);
                    for (int64_t i = j; i < Lb; ++i) slot_fma<NV, TB>(xt, cols + pb, vals + pb, i, b0, b1);
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) {
                        vstore(part[s - sb][0] + VW * v, a0[v]);
                        vstore(part[s - sb][1] + VW * v, a1[v]);
                        vstore(part[s + 1 - sb][0] + VW * v, b0[v]);
                        vstore(part[s + 1 - sb][1] + VW * v, b1[v]);
                    }
                }
            for (; s < se; ++s) {
                const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
                vec a0[NV], a1[NV];
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) a0[v] = a1[v] = vzero();
#pragma GCC unroll 2
                for (int64_t j = 0; j < L; ++j) slot_fma<NV, TB>(xt, cols + p0, vals + p0, j, a0, a1);
#pragma GCC unroll 8
                for (int v = 0; v < NV; ++v) {
                    vstore(part[s - sb][0] + VW * v, a0[v]);
                    vstore(part[s - sb][1] + VW * v, a1[v]);
                }
            }
        } else {
            int64_t pos[SBLOCK][2];  // each row's next slot: chunk k takes [pos, its bound), the last the rest
            for (int64_t s = sb; s < se; ++s) pos[s - sb][0] = pos[s - sb][1] = 0;
            for (int64_t k = 0; k < nch; ++k) {
                for (int64_t s = sb; s < se; ++s) {
                    const int64_t p0 = sptr[s], L = (sptr[s + 1] - p0) / 2;
                    const int32_t* c = cols + p0;
                    const WT* w = vals + p0;
                    int64_t st[2], en[2];
                    chunk_slots(bounds, s, nch, k, L, pos[s - sb], st, en);
                    int64_t j0 = st[0], j1 = st[1];
                    const int64_t e0 = en[0], e1 = en[1];
                    float* q0 = part[s - sb][0];
                    float* q1 = part[s - sb][1];
                    vec a0[NV], a1[NV];
                    if (k == 0) {
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a0[v] = a1[v] = vzero();
                    } else {
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) {
                            a0[v] = vload(q0 + VW * v);
                            a1[v] = vload(q1 + VW * v);
                        }
                    }
                    // both rows together while both have slots in this chunk (two independent FMA chains)
                    for (const int64_t both = j0 + std::min(e0 - j0, e1 - j1); j0 < both; ++j0, ++j1) {
                        const float* x0 = xt + (int64_t)c[2 * j0] * TB;
                        const float* x1 = xt + (int64_t)c[2 * j1 + 1] * TB;
                        const vec w0 = bcast1(w + 2 * j0), w1 = bcast1(w + 2 * j1 + 1);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) {
                            a0[v] = vfma(w0, vload(x0 + VW * v), a0[v]);
                            a1[v] = vfma(w1, vload(x1 + VW * v), a1[v]);
                        }
                    }
                    for (; j0 < e0; ++j0) {
                        const float* x0 = xt + (int64_t)c[2 * j0] * TB;
                        const vec w0 = bcast1(w + 2 * j0);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a0[v] = vfma(w0, vload(x0 + VW * v), a0[v]);
                    }
                    for (; j1 < e1; ++j1) {
                        const float* x1 = xt + (int64_t)c[2 * j1 + 1] * TB;
                        const vec w1 = bcast1(w + 2 * j1 + 1);
#pragma GCC unroll 8
                        for (int v = 0; v < NV; ++v) a1[v] = vfma(w1, vload(x1 + VW * v), a1[v]);
                    }
#pragma GCC unroll 8
                    for (int v = 0; v < NV; ++v) {
                        vstore(q0 + VW * v, a0[v]);
                        vstore(q1 + VW * v, a1[v]);
                    }
                }
            }
        }
        const int64_t r0 = 2 * sb, nr = std::min<int64_t>(R, 2 * se) - r0;
        store_block(&part[0][0][0], TB, nt, r0, nr, R, bias, y, act);
    }
}
