// Smoke-test library: proves the toolchain works. sparsa_probe_saxpy: y += a * x.
#include <cstdint>
#include <omp.h>
extern "C" {
int sparsa_probe_version() { return 1; }
int sparsa_probe_max_threads() { return omp_get_max_threads(); }
void sparsa_probe_saxpy(int64_t n, float a, const float* x, float* y) {
#pragma omp parallel for
    for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
}
