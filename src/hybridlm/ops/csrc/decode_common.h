// What the library's C++ files share (gemm.cpp, the one-token decode ops of decode_ops.cpp, the whole-mixer steps of
// mixers.cpp): bf16 <-> float32, typed loads and stores (float32, or bf16 as uint16_t), softplus, and the ops of
// decode_ops.cpp mixers.cpp calls.
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float bf2f(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline uint16_t f2bf(float f) {            // round to nearest even, as torch's .to(bfloat16)
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T> static inline float ld(const T* p, int64_t i);
template <> inline float ld<float>(const float* p, int64_t i) { return p[i]; }
template <> inline float ld<uint16_t>(const uint16_t* p, int64_t i) { return bf2f(p[i]); }
template <typename T> static inline void st(T* p, int64_t i, float v);
template <> inline void st<float>(float* p, int64_t i, float v) { p[i] = v; }
template <> inline void st<uint16_t>(uint16_t* p, int64_t i, float v) { p[i] = f2bf(v); }

static inline float softplus(float x) { return x > 20.f ? x : std::log1p(std::exp(x)); }   // torch's threshold 20

extern "C" void dec_delta_gated(const float* qkv, const float* b, const float* a, const float* A_log,
                                const float* dt_bias, int per_key, float* state, float* o, int64_t Bn, int64_t H,
                                int64_t Hk, int64_t K, int64_t V, float scale, float eps);
extern "C" void dec_ssd_gated(const float* x, const float* dt_raw, const float* dt_bias, const float* A_log,
                              const float* D, float lo, float hi, const float* Bm, const float* Cm, float* state,
                              float* y, int64_t Bn, int64_t H, int64_t P, int64_t G, int64_t N);
extern "C" void dec_gla_step(const float* q, const float* k, const float* v, const float* logd, float* state,
                             float* o, int64_t Bn, int64_t H, int64_t K, int64_t V, float scale);
extern "C" void dec_rms_norm(void* x, const void* res, const void* z, const void* w, void* y, int64_t R, int64_t d,
                             int64_t group, int mode, float eps, int bf);
extern "C" void dec_attention(const void* q, const void* k, const void* v, void* o, int64_t Bn, int64_t Hq, int64_t Hk,
                              int64_t Hv, int64_t D, int64_t Dv, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb,
                              int64_t vss, int64_t vsh, const int64_t* lo, const int64_t* len, int64_t ring,
                              float scale, int bf);
