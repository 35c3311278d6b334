// The bitmask AMX kernel on software tiles (amx_tiles.h, SPARSA_AMX_EMULATE) with scalar expand, pack and
// epilogue: a test build, so the row expansion, X pack, tails and bias are checked on any CPU.
#define SPARSA_AMX_EMULATE 1
#include "bitmask_amx_bf16.cpp"
