// The 16-column row loop of the bitmask stream kernel (bitmask_linear.cpp), over the 16-lane primitives of
// an Ops struct. No include guard on purpose: bitmask_linear.cpp includes it twice, once for the AVX2
// pair of halves and once inside an AVX-512 target region, so each copy is compiled for its own ISA
// (a template defined outside that region would be compiled without AVX-512 for every Ops).

// out[t] for NT tokens, 16 columns (two mask bytes) per step and four steps per 64-bit mask word; the
// odd last mask byte reads X up to column 8 * kb + 8, inside the padded panel
template <class Ops, int NT, class V>
inline void row_dot16(const uint8_t* bits, int64_t kb, const V* vp, const float* x, int64_t kp, float* out) {
    using Vec = typename Ops::Vec;
    constexpr int NA = NT <= 2 ? 2 : 1;
    Vec acc[NT][NA];
    for (int t = 0; t < NT; ++t)
        for (int a = 0; a < NA; ++a) acc[t][a] = Ops::zero();
    int64_t g = 0;
    for (; g + 8 <= kb; g += 8) {
        uint64_t m;
        std::memcpy(&m, bits + g, 8);
        const unsigned m0 = m & 0xffffu, m1 = (m >> 16) & 0xffffu, m2 = (m >> 32) & 0xffffu, m3 = m >> 48;
        const int p1 = __builtin_popcount(m0), p2 = p1 + __builtin_popcount(m1), p3 = p2 + __builtin_popcount(m2);
        // every line of the values into L2 a page ahead and into L1 a few lines ahead: one L1 prefetch a
        // step (two lines of values at 50% density) left the DRAM stream well short of a dense GEMV's rate
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kPrefetchBytes, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kPrefetchBytes + 64, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kNearPrefetchBytes, _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(vp) + kNearPrefetchBytes + 64, _MM_HINT_T0);
        const Vec w0 = Ops::expand16(vp, m0), w1 = Ops::expand16(vp + p1, m1);
        const Vec w2 = Ops::expand16(vp + p2, m2), w3 = Ops::expand16(vp + p3, m3);
        vp += __builtin_popcountll(m);
        const float* xc = x + 8 * g;
        for (int t = 0; t < NT; ++t) {
            const float* xt = xc + t * kp;
            acc[t][0] = Ops::fma(w0, Ops::load(xt), acc[t][0]);
            acc[t][1 % NA] = Ops::fma(w1, Ops::load(xt + 16), acc[t][1 % NA]);
            acc[t][0] = Ops::fma(w2, Ops::load(xt + 32), acc[t][0]);
            acc[t][1 % NA] = Ops::fma(w3, Ops::load(xt + 48), acc[t][1 % NA]);
        }
    }
    for (; g < kb; g += 2) {
        const unsigned m = bits[g] | (g + 1 < kb ? (unsigned)bits[g + 1] << 8 : 0u);
        const Vec w = Ops::expand16(vp, m);
        vp += __builtin_popcount(m);
        for (int t = 0; t < NT; ++t) acc[t][0] = Ops::fma(w, Ops::load(x + 8 * g + t * kp), acc[t][0]);
    }
    for (int t = 0; t < NT; ++t) out[t] = Ops::hsum(NA == 2 ? Ops::add(acc[t][0], acc[t][1 % NA]) : acc[t][0]);
}

template <class Ops, class V>
inline void row_dot16_n(int nt, const uint8_t* bits, int64_t kb, const V* vp, const float* x, int64_t kp,
                        float* out) {
    switch (nt) {
        case 1: row_dot16<Ops, 1>(bits, kb, vp, x, kp, out); break;
        case 2: row_dot16<Ops, 2>(bits, kb, vp, x, kp, out); break;
        case 3: row_dot16<Ops, 3>(bits, kb, vp, x, kp, out); break;
        default: row_dot16<Ops, 4>(bits, kb, vp, x, kp, out); break;
    }
}
