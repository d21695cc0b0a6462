// Matrix-vector products for decode on a CPU: y[m, n] = sum_k x[m, k] * W[n, k] for a few rows m, W read once in the
// dtype it is stored in (float32, bfloat16, int8 per channel, int4 per group). Decode on a CPU is bound by how fast
// the weights stream from memory, so the loops do one multiply-add per weight in float32, four rows of W at a time
// (four independent accumulators hide the FMA latency; one load of x serves four rows), in GCC/Clang vector types
// of 8 floats that -march=native maps to the CPU's SIMD. Threads split the output rows (OpenMP: the runtime torch
// itself loaded, so the two never compete). Compiled on first use by ops/cpu_kernels.py; tests hold each kernel to
// ops/quant.py's float32 reference.
//
// Shapes: x float32 [M, K] (M small: a block of four rows of W meets all M rows of x while it is in L1);
// y float32 [M, N]. int8: q [N, K], scale [N]. int4: q uint8 [N, K/2] (k even in the low nibble), scale and
// zero [N, G], K = G * group; the dequantized weight is (v - 8) * scale + zero, v in 0..15.
#include <cstdint>
#include <cstring>

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef int8_t s8 __attribute__((vector_size(8)));
typedef uint8_t u8 __attribute__((vector_size(8)));
typedef uint16_t h8 __attribute__((vector_size(16)));

static inline f8 load(const float* p) { f8 v; std::memcpy(&v, p, 32); return v; }
static inline f8 wvec(const float* p) { return load(p); }
static inline f8 wvec(const uint16_t* p) {          // bfloat16 -> float32: the high half of the bits
    h8 h; std::memcpy(&h, p, 16);
    i8x u = __builtin_convertvector(h, i8x) << 16;
    f8 f; std::memcpy(&f, &u, 32); return f;
}
static inline f8 wvec(const int8_t* p) { s8 v; std::memcpy(&v, p, 8); return __builtin_convertvector(v, f8); }
static inline float wone(float v) { return v; }
static inline float wone(int8_t v) { return float(v); }
static inline float wone(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline float hsum(f8 v) { float s = 0.f; for (int i = 0; i < 8; i++) s += v[i]; return s; }

// rows [n0, n0 + R) of W (R <= 4) against x's M rows; out[m * N + n] = dot * (scale ? scale[n] : 1).
template <typename T, int R>
static inline void rows_dot(const float* x, int64_t M, int64_t K, const T* w, int64_t n0, int64_t N,
                            const float* scale, float* y) {
    const int64_t K8 = K & ~int64_t(7);
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        f8 acc[R] = {};
        for (int64_t k = 0; k < K8; k += 8) {
            f8 xv = load(xm + k);
            for (int r = 0; r < R; r++) acc[r] += xv * wvec(w + (n0 + r) * K + k);
        }
        for (int r = 0; r < R; r++) {
            float s = hsum(acc[r]);
            for (int64_t k = K8; k < K; k++) s += xm[k] * wone(w[(n0 + r) * K + k]);
            y[m * N + n0 + r] = scale ? s * scale[n0 + r] : s;
        }
    }
}

template <typename T>
static void matvec(const float* x, int64_t M, int64_t K, const T* w, int64_t N, const float* scale, float* y) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 4;
        if (n0 + 4 <= N) rows_dot<T, 4>(x, M, K, w, n0, N, scale, y);
        else for (int64_t n = n0; n < N; n++) rows_dot<T, 1>(x, M, K, w, n, N, scale, y);
    }
}

static inline void nibbles(const uint8_t* p, f8& lo, f8& hi) {
    u8 v; std::memcpy(&v, p, 8);
    i8x i = __builtin_convertvector(v, i8x);
    lo = __builtin_convertvector(i & 15, f8);
    hi = __builtin_convertvector(i >> 4, f8);
}

extern "C" {

void mv_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
    matvec(x, M, K, w, N, nullptr, y);
}

void mv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
    matvec(x, M, K, w, N, nullptr, y);
}

void mv_int8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N, float* y) {
    matvec(x, M, K, q, N, scale, y);
}

// xe / xo: x's even / odd columns [M, K/2] (the low / high nibbles' inputs); xsum: x summed per group [M, G].
// The group's bytes per row, K / 2 / G, are a multiple of 8 (groups of 32, 64 or 128).
void mv_int4(const float* xe, const float* xo, const float* xsum, int64_t M, int64_t K, const uint8_t* q,
             const float* scale, const float* zero, int64_t G, int64_t N, float* y) {
    const int64_t half = K / 2, hg = half / G;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* row = q + n * half;
        const float* s = scale + n * G;
        const float* z = zero + n * G;
        for (int64_t m = 0; m < M; m++) {
            const float* e = xe + m * half;
            const float* o = xo + m * half;
            const float* xs = xsum + m * G;
            f8 out = {};
            float bias = 0.f;
            for (int64_t g = 0; g < G; g++) {
                f8 a0 = {}, a1 = {};
                for (int64_t j = g * hg; j < (g + 1) * hg; j += 8) {
                    f8 lo, hi;
                    nibbles(row + j, lo, hi);
                    a0 += load(e + j) * lo;
                    a1 += load(o + j) * hi;
                }
                out += s[g] * (a0 + a1);
                bias += (z[g] - 8.f * s[g]) * xs[g];
            }
            y[m * N + n] = hsum(out) + bias;
        }
    }
}

}  // extern "C"
