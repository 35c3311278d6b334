// A transformer MLP, y = act(x W1^T + b1) W2^T + b2, with both weights RowGroup (groups of 16) on AMX
// tiles, one 32-token panel at a time (included by row_group_linear.cpp after row_group_amx.h, whose tiles
// it runs). Two separate products would round the hidden activation into a [T, R1] tensor (a 16 x 16
// transpose per tile to get there) and then pack it back into column-major panels for the second product.
// Here the first product's tiles, which hold rows x tokens, are stored straight into that panel, one
// 64-byte line per hidden row, and the second product reads it: no transpose, no pack, one call.
#pragma once

#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16,avx512f,avx512vl,avx512dq,avx512bw,avx512bf16,avx2,fma")
namespace amx {

// idx[dp::amx_panel_pos(t)] = t: a word permutation from token order to the panel's order
struct PanelOrder {
    alignas(64) uint16_t idx[32];
    PanelOrder() {
        for (int t = 0; t < 32; ++t) idx[dp::amx_panel_pos(t)] = (uint16_t)t;
    }
};

// h[r * 32 + amx_panel_pos(t)] = bf16(act(buf[r][t] + bias[r])) for the 16 rows of a tile (bias only for the
// nout real rows; the padding rows of the last group hold zero weights and stay zero without GELU(bias))
inline void store_panel_rows(const float (&buf)[16][32], const float* bias, int nout, bool act, uint16_t* h) {
    static const PanelOrder order;
    const __m512i idx = _mm512_load_si512(order.idx);
    for (int r = 0; r < 16; ++r) {
        __m512 v0 = _mm512_load_ps(&buf[r][0]), v1 = _mm512_load_ps(&buf[r][16]);
        if (r < nout) {
            if (bias) {
                const __m512 b = _mm512_set1_ps(bias[r]);
                v0 = _mm512_add_ps(v0, b);
                v1 = _mm512_add_ps(v1, b);
            }
            if (act) {
                v0 = sparsa_gelu16(v0);
                v1 = sparsa_gelu16(v1);
            }
        }
        const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // tokens 0-15, then 16-31
        _mm512_store_si512(h + r * 32, _mm512_permutexvar_epi16(idx, w));
    }
}

// Whether mlp16 runs for T tokens on nthreads: a task is one panel, so the panels must keep every thread
// about equally busy (else two products, which split their rows among the threads, are faster)
inline bool mlp_balanced(int64_t T, int nthreads) {
    const int64_t npan = (T + 31) / 32;
    return nthreads <= 1 || (npan >= nthreads && (npan % nthreads == 0 || npan >= 3 * nthreads));
}

// wa1, wa2: the weights' AMX packs (amx::pack, groups of 16). cols2 index the R1 hidden rows.
inline void mlp16(const uint16_t* x, int64_t T, int64_t K, const int32_t* cols1, const uint16_t* wa1, int64_t ng1,
                  int64_t k1, const float* b1, int64_t R1, const int32_t* cols2, const uint16_t* wa2, int64_t ng2,
                  int64_t k2, const float* b2, uint16_t* y, int64_t R2, int nthreads, bool act) {
    const int64_t npan = (T + 31) / 32, ws1 = wsize(k1, 16), ws2 = wsize(k2, 16);
    auto task = [&](int64_t pa) {
        const int64_t t0 = pa * 32;
        const int nt = (int)std::min<int64_t>(32, T - t0);
        const dp::AlignedBuf<uint16_t> xt = dp::aligned_buf<uint16_t>(K * 32);
        const dp::AlignedBuf<uint16_t> h = dp::aligned_buf<uint16_t>(ng1 * 16 * 32);  // the hidden panel
        alignas(64) float buf[16][32];
        Tiles<1>::begin();
        dp::pack_panel_amx(x + t0 * K, K, nt, xt.get());
        BRing ring1;
        for (int64_t g = 0; g < ng1; ++g) {
            accumulate<1>(xt.get(), cols1 + g * k1, wa1 + g * ws1, k1, buf, ring1,
                          g + 1 < ng1 ? cols1 + (g + 1) * k1 : nullptr);
            store_panel_rows(buf, b1 ? b1 + g * 16 : nullptr, (int)std::min<int64_t>(16, R1 - g * 16), act,
                             h.get() + g * 16 * 32);
        }
        // tokens past nt hold act(b1) in the hidden panel: their outputs are computed but never stored
        BRing ring2;
        for (int64_t g = 0; g < ng2; ++g) {
            const int nout = (int)std::min<int64_t>(16, R2 - g * 16);
            tile_store<1>(h.get(), cols2 + g * k2, wa2 + g * ws2, k2, b2 ? b2 + g * 16 : nullptr, false, nt, nout,
                          y + t0 * R2 + g * 16, R2, ring2, g + 1 < ng2 ? cols2 + (g + 1) * k2 : nullptr);
        }
        Tiles<1>::end();
    };
    if (nthreads <= 1 || npan == 1) {
        for (int64_t p = 0; p < npan; ++p) task(p);
    } else {
#pragma omp parallel for num_threads(nthreads) schedule(dynamic, 1)
        for (int64_t p = 0; p < npan; ++p) task(p);
    }
}

}  // namespace amx
#pragma GCC pop_options
