// Matrix-vector products for decode on a CPU: y[m, n] = sum_k x[m, k] * W[n, k] for a few rows m, W read once in the
// dtype it is stored in (float32, bfloat16, int8 per channel, int4 per group). Decode on a CPU is bound by how fast
// the weights stream from memory. Float weights: one multiply-add per weight in float32, four rows of W at a time
// (four independent accumulators hide the FMA latency; one load of x serves four rows), in GCC/Clang vector types
// of 8 floats that -march=native maps to the CPU's SIMD; int8 / int4: integer multiply-adds (below). Threads split the output rows (OpenMP: the runtime torch
// itself loaded, so the two never compete). Compiled on first use by ops/cpu_kernels.py; tests hold each kernel to
// ops/quant.py's float32 reference.
//
// Shapes: x [M, K] (M small: a row of W meets all M rows of x while it is in L1); y float32 [M, N]. int8: q [N, K],
// scale [N]. int4: q uint8 [N, K/2] (k even in the low nibble), scale and zero [N, G], K = G * group; the
// dequantized weight is (v - 8) * scale + zero, v in 0..15.
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#if defined(__AVX2__) || defined(__AVX512BF16__)
#include <immintrin.h>
#endif

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));

static inline f8 load(const float* p) { f8 v; std::memcpy(&v, p, 32); return v; }
static inline f8 wvec(const float* p) { return load(p); }
#if defined(__AVX2__)
// x86: the widening loads by name (GCC's generic conversions of 8-byte vectors go through scalar inserts)
static inline f8 wvec(const uint16_t* p) {          // bfloat16 -> float32: the high half of the bits
    __m256i u = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p));
    return (f8)_mm256_castsi256_ps(_mm256_slli_epi32(u, 16));
}
#else
static inline f8 wvec(const uint16_t* p) {
    h8 h; std::memcpy(&h, p, 16);
    i8x u = __builtin_convertvector(h, i8x) << 16;
    f8 f; std::memcpy(&f, &u, 32); return f;
}
#endif
static inline float wone(float v) { return v; }
static inline float wone(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline float hsum(f8 v) { float s = 0.f; for (int i = 0; i < 8; i++) s += v[i]; return s; }

// rows [n0, n0 + R) of W (R <= 4) against x's M rows -> y[m * N + n]
template <typename T, int R>
static inline void rows_dot(const float* x, int64_t M, int64_t K, const T* w, int64_t n0, int64_t N, float* y) {
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
            y[m * N + n0 + r] = s;
        }
    }
}

template <typename T>
static void matvec(const float* x, int64_t M, int64_t K, const T* w, int64_t N, float* y) {
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 4;
        if (n0 + 4 <= N) rows_dot<T, 4>(x, M, K, w, n0, N, y);
        else for (int64_t n = n0; n < N; n++) rows_dot<T, 1>(x, M, K, w, n, N, y);
    }
}

extern "C" void mv_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
    matvec(x, M, K, w, N, y);
}

#if defined(__AVX512BF16__)
// bfloat16 weights on CPUs with bf16 dot products (AVX512-BF16: Cooper Lake, Zen 4 and later): vdpbf16ps multiplies
// 32 bf16 pairs a step and adds them into 16 float32 lanes, so W streams with no conversion. x is rounded to bf16
// once per call (round to nearest even; llama.cpp does the same), zero-padded to the vector width; W's last partial
// step is a masked load. Four rows of W a step as the float loop does (one load of x serves four rows).
static inline uint16_t to_bf16(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);       // NaN stays NaN
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

template <int R>
static inline void rows_dot_bf16(const uint16_t* xb, int64_t M, int64_t K, int64_t Kp, const uint16_t* w,
                                 int64_t n0, int64_t N, float* y) {
    const int64_t K32 = K & ~int64_t(31);
    const __mmask32 tail = K > K32 ? __mmask32((1ull << (K - K32)) - 1) : 0;
    for (int64_t m = 0; m < M; m++) {
        const uint16_t* xm = xb + m * Kp;
        __m512 acc[R];
        for (int r = 0; r < R; r++) acc[r] = _mm512_setzero_ps();
        for (int64_t k = 0; k < K32; k += 32) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + k);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], xv, (__m512bh)_mm512_loadu_si512(w + (n0 + r) * K + k));
        }
        if (tail) {
            const __m512bh xv = (__m512bh)_mm512_loadu_si512(xm + K32);
            for (int r = 0; r < R; r++)
                acc[r] = _mm512_dpbf16_ps(acc[r], xv,
                                          (__m512bh)_mm512_maskz_loadu_epi16(tail, w + (n0 + r) * K + K32));
        }
        for (int r = 0; r < R; r++) y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[r]);
    }
}

static void matvec_bf16_dot(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
    const int64_t Kp = (K + 31) & ~int64_t(31);
    std::vector<uint16_t> xb(M * Kp, 0);
    for (int64_t m = 0; m < M; m++)
        for (int64_t k = 0; k < K; k++) xb[m * Kp + k] = to_bf16(x[m * K + k]);
    const int64_t blocks = (N + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; b++) {
        const int64_t n0 = b * 4;
        if (n0 + 4 <= N) rows_dot_bf16<4>(xb.data(), M, K, Kp, w, n0, N, y);
        else for (int64_t n = n0; n < N; n++) rows_dot_bf16<1>(xb.data(), M, K, Kp, w, n, N, y);
    }
}
#endif

// 1 when mv_bf16 runs on the CPU's bf16 dot products (x rounded to bf16), 0 when it converts W to float32
extern "C" int mv_bf16_dot() {
#if defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

extern "C" void mv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
#if defined(__AVX512BF16__)
    matvec_bf16_dot(x, M, K, w, N, y);
#else
    matvec(x, M, K, w, N, y);
#endif
}

// bf16 in, bf16 out (a bf16 model's decode): x [M, K] and y [M, N] bfloat16, bias [N] bfloat16 or null; the sums
// and the bias add in float32, y rounded to nearest even once (what y.float() + bias.float() -> .to(bf16) gives),
// so the caller converts nothing
static inline float bf_f(uint16_t v) { uint32_t u = uint32_t(v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline uint16_t f_bf(float f) {
    uint32_t u; std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return uint16_t((u >> 16) | 0x40);
    return uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
extern "C" void mv_bf16_io(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                           const uint16_t* bias, uint16_t* y) {
    std::vector<float> xf(M * K), yf(M * N);
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf_f(x[i]);
    mv_bf16(xf.data(), M, K, w, N, yf.data());
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) y[m * N + n] = f_bf(yf[m * N + n] + (bias ? bf_f(bias[n]) : 0.f));
}

// the float32-convert loop whatever the build (the reference the bf16 dot-product loop is measured against)
extern "C" void mv_bf16_f32(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
    matvec(x, M, K, w, N, y);
}

// int8 and int4 round x to int16 per row first, x ≈ xs[m] · xq[m, k] (|xq| <= 32767: a relative error of 1.5e-5,
// far below the weights' rounding), so that a multiply-add is an integer one, 16 lanes at a time (vpmaddwd), exact
// in int32 over blocks short enough never to overflow, then scaled in float32. One row of W at a time: on the CPUs
// measured, blocking rows (as the float kernels do) made the integer loops slower.

// x [M, K] float -> xq [M, K] int16 and the row scales xs [M]
static void round_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        float mx = 0.f;
        for (int64_t k = 0; k < K; k++) mx = std::fmax(mx, std::fabs(xm[k]));
        const float s = mx > 0.f ? mx / 32767.f : 1.f, inv = 1.f / s;
        for (int64_t k = 0; k < K; k++) xq[m * K + k] = int16_t(std::nearbyint(xm[k] * inv));
        xs[m] = s;
    }
}

extern "C" void mv_int8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N,
                        float* y) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xs(M);
    round_rows(x, M, K, xq.data(), xs.data());
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* row = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const int16_t* xm = xq.data() + m * K;
            float out = 0.f;
            int64_t k = 0;
#if defined(__AVX2__)
            for (; k + 16 <= K;) {                   // blocks of <= 256: |sum| <= 16 · 2 · 32767 · 127 per lane
                __m256i acc = _mm256_setzero_si256();
                for (const int64_t end = k + 256 <= K ? k + 256 : K & ~int64_t(15); k < end; k += 16) {
                    _mm_prefetch((const char*)(row + k + 2048), _MM_HINT_T0);     // more rows in flight
                    __m256i w = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(row + k)));
                    acc = _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(xm + k)), w));
                }
                out += hsum((f8)_mm256_cvtepi32_ps(acc));
            }
#endif
            int32_t rest = 0;
            for (int64_t j = k; j < K; j++) {
                rest += int32_t(xm[j]) * int32_t(row[j]);
                if (((j - k) & 255) == 255) { out += float(rest); rest = 0; }
            }
            y[m * N + n] = (out + float(rest)) * xs[m] * scale[n];
        }
    }
}

// x [M, K] float (K = G · group, the weight's padded width). Byte j of a row holds column 2j in its low nibble and
// 2j + 1 in its high one. The AVX2 loop takes 32 bytes (64 columns, two groups of 32 or part of a larger one) a
// step: its nibbles widen to int16 within each 128-bit half, so x is laid out in that order once per call
// (`xp`: per 64 columns, the even columns of bytes 0-7 and 16-23, of bytes 8-15 and 24-31, then the odd ones) and
// each half of the int32 sums belongs to one group. The zero points add sum_g (zero - 8 scale)[g] · (x summed over g).
extern "C" void mv_int4(const float* x, int64_t M, int64_t K, const uint8_t* q, const float* scale,
                        const float* zero, int64_t G, int64_t N, float* y) {
    const int64_t half = K / 2, hg = half / G, chunks = half / 32;   // bytes: a row, a group; 32-byte steps
#if defined(__AVX2__)
    const int64_t laid = chunks;       // 32-byte steps laid out for the vector loop; the scalar loop reads the rest
#else
    const int64_t laid = 0;
#endif
    std::vector<int16_t> xq(M * K), xp(M * K);
    std::vector<float> xs(M), xsum(M * G, 0.f);
    round_rows(x, M, K, xq.data(), xs.data());
    for (int64_t m = 0; m < M; m++) {
        const int16_t* a = xq.data() + m * K;
        int16_t* p = xp.data() + m * K;
        for (int64_t c = 0; c < laid; c++)
            for (int64_t i = 0; i < 16; i++) {
                const int64_t j = c * 32 + (i < 8 ? i : i + 8);      // bytes 0-7, 16-23, then +8
                p[c * 64 + i] = a[2 * j];
                p[c * 64 + 16 + i] = a[2 * (j + 8)];
                p[c * 64 + 32 + i] = a[2 * j + 1];
                p[c * 64 + 48 + i] = a[2 * (j + 8) + 1];
            }
        for (int64_t j = laid * 32; j < half; j++) {                   // the rest in column order
            p[2 * j] = a[2 * j];
            p[2 * j + 1] = a[2 * j + 1];
        }
        for (int64_t k = 0; k < K; k++) xsum[m * G + k / (2 * hg)] += x[m * K + k];
    }
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* row = q + n * half;
        const float* s = scale + n * G;
        const float* z = zero + n * G;
#if defined(__AVX2__)
        for (int64_t i = 0; i < G; i += 16) {            // the next rows' scales and zeros, ahead of their use
            _mm_prefetch((const char*)(s + 2 * G + i), _MM_HINT_T0);
            _mm_prefetch((const char*)(z + 2 * G + i), _MM_HINT_T0);
        }
#endif
        for (int64_t m = 0; m < M; m++) {
            const int16_t* p = xp.data() + m * K;
            const float* xg = xsum.data() + m * G;
            float out = 0.f, bias = 0.f;
            int64_t c = 0;
#if defined(__AVX2__)
            f8 acc8 = {};
            const __m256i low = _mm256_set1_epi8(15), zero8 = _mm256_setzero_si256();
            for (; c < chunks; c++) {
                _mm_prefetch((const char*)(row + c * 32 + 1024), _MM_HINT_T0);
                __m256i b = _mm256_loadu_si256((const __m256i*)(row + c * 32));
                __m256i lo = _mm256_and_si256(b, low), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), low);
                const int16_t* pc = p + c * 64;
                __m256i sum = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)pc),
                                                _mm256_unpacklo_epi8(lo, zero8));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(pc + 16)),
                                                              _mm256_unpackhi_epi8(lo, zero8)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(pc + 32)),
                                                              _mm256_unpacklo_epi8(hi, zero8)));
                sum = _mm256_add_epi32(sum, _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)(pc + 48)),
                                                              _mm256_unpackhi_epi8(hi, zero8)));
                const int64_t g0 = c * 32 / hg, g1 = (c * 32 + 16) / hg;          // each 128-bit half's group
                __m256 sv = _mm256_set_m128(_mm_set1_ps(s[g1]), _mm_set1_ps(s[g0]));
                acc8 = (f8)_mm256_fmadd_ps(_mm256_cvtepi32_ps(sum), sv, (__m256)acc8);
            }
            out = hsum(acc8);
#endif
            for (int64_t j = c * 32; j < half; j++)
                out += s[j / hg] * float(int32_t(p[2 * j]) * (row[j] & 15) + int32_t(p[2 * j + 1]) * (row[j] >> 4));
            int64_t g = 0;
            f8 zb = {}, sb = {};
            for (; g + 8 <= G; g += 8) {
                f8 xv = load(xg + g);
                zb += load(z + g) * xv;
                sb += load(s + g) * xv;
            }
            bias = hsum(zb) - 8.f * hsum(sb);
            for (; g < G; g++) bias += (z[g] - 8.f * s[g]) * xg[g];
            y[m * N + n] = out * xs[m] + bias;
        }
    }
}

// the read limit the kernels are measured against: a float32 sum over n values streamed once, threads as the
// kernels' (benchmarks only)
extern "C" float read_sum(const float* p, int64_t n) {
    const int64_t blocks = n / 4096;                     // 16 KB a block, eight independent sums
    float total = 0.f;
#pragma omp parallel reduction(+ : total)
    {
        f8 acc[8] = {};
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; b++)
            for (int64_t k = b * 4096; k < (b + 1) * 4096; k += 64)
                for (int i = 0; i < 8; i++) acc[i] += load(p + k + i * 8);
        total += hsum(((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7])));
    }
    for (int64_t i = blocks * 4096; i < n; i++) total += p[i];
    return total;
}

// prefill: the quantized weight dequantized in one pass, rows in parallel, into float32 or bfloat16 (`bf`) for one
// matmul (PyTorch's form unpacks, widens, scales and shifts in separate passes over the whole matrix).
// int4: q [N, K/2], scale and zero float32 [N, G] -> w [N, K] = (v - 8) scale + zero; int8: w = q scale[n].
extern "C" void dq_int4(const uint8_t* q, const float* scale, const float* zero, int64_t N, int64_t K, int64_t G,
                        void* out, int bf) {
    const int64_t group = K / G;                         // 32, 64 or 128 (ops/quant.INT4_GROUPS)
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        const uint8_t* row = q + n * (K / 2);
        float w[256];                                    // a group (<= 128 columns here), then stored
        for (int64_t g = 0; g < G; g++) {
            const float s = scale[n * G + g], z = zero[n * G + g];
            const uint8_t* b = row + g * group / 2;
            for (int64_t j = 0; j < group / 2; j++) {
                w[2 * j] = (float(b[j] & 15) - 8.f) * s + z;
                w[2 * j + 1] = (float(b[j] >> 4) - 8.f) * s + z;
            }
            const int64_t k0 = n * K + g * group;
            if (bf) for (int64_t k = 0; k < group; k++) ((uint16_t*)out)[k0 + k] = f_bf(w[k]);
            else std::memcpy((float*)out + k0, w, group * 4);
        }
    }
}

extern "C" void dq_int8(const int8_t* q, const float* scale, int64_t N, int64_t K, void* out, int bf) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            const float w = float(q[n * K + k]) * scale[n];
            if (bf) ((uint16_t*)out)[n * K + k] = f_bf(w);
            else ((float*)out)[n * K + k] = w;
        }
}
