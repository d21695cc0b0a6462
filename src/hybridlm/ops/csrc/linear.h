// The linear products of gemm.cpp for the other C++ files of the library (mixers.cpp):
// y[m, n] = sum_k x[m, k] W[n, k] for any number of rows M (1 for decode, a serving batch, a prompt), W read in the
// form it is stored in. x [M, K] float32 (row-major, contiguous), y [M, N] float32 unless said; every function
// splits its work over OpenMP threads itself (call it from outside a parallel region).
#pragma once
#include <cstdint>

extern "C" {
// float32 W [N, K]
void mv_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y);
// bfloat16 W [N, K] (x rounded to bf16 once where the library's level has bf16 dot products: mv_bf16_dot() = 1)
void mv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y);
int mv_bf16_dot();
// bfloat16 x [M, K], W [N, K], bias [N] (or null) -> bfloat16 y [M, N]; sums and the bias add in float32
void mv_bf16_io(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, const uint16_t* bias,
                uint16_t* y);
// int8 per output channel: W[n] = scale[n] q[n], q int8 [N, K], scale float32 [N]
void mv_int8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N, float* y);
// int4 per group (ops/quant.py), repacked at load: q4_pack turns the stored (q, scale, zero) of an [N, Kp] weight
// (Kp = G * group, group 32 / 64 / 128) into q4_packed_bytes(N, Kp, G) bytes; q4_linear then reads x [M, K]
// (K <= Kp: the missing columns count as zeros), rounds it to int8 per block of 32 columns once per call (as
// llama.cpp's Q8_0) and takes integer dot products against the packed nibbles.
int64_t q4_packed_bytes(int64_t N, int64_t Kp, int64_t G);
void q4_pack(const uint8_t* q, const float* scale, const float* zero, int64_t N, int64_t Kp, int64_t G,
             uint8_t* packed);
void q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, int64_t Kp, int64_t G,
               float* y);

// the library's instruction-set level: "portable", "avx2", "avx512", "avx512_vnni" or "avx512_bf16"
const char* cpu_level();
}
