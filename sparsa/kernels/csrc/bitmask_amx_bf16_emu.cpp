// The bitmask AMX kernel on software tiles (amx_tiles.h, SPARSA_AMX_EMULATE) with scalar expand and
// epilogue: a test build, so the tile order, tails and bias are checked on any CPU.
#define SPARSA_AMX_EMULATE 1
#include "bitmask_amx_bf16.cpp"
