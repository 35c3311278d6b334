// The row_group kernels with software AMX tiles (row_group_amx.h, SPARSA_AMX_EMULATE): a test build, so
// the AMX path's packing, tails and epilogue are checked on CPUs with AVX-512 but without AMX.
#define SPARSA_AMX_EMULATE 1
#include "row_group_linear.cpp"
