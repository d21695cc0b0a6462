// Linear products on a CPU for any number of rows: y[m, n] = sum_k x[m, k] W[n, k], W read in the form it is stored
// in (float32, bfloat16, int8 per channel, int4 per group). One row (decode) is bound by how fast W streams from
// memory; many rows (a serving batch, a prompt) by the multiply-adds, so the products go in register tiles of RM
// rows of x by RN rows of W (tinyBLAS's form, llama.cpp's ggml-cpu/llamafile/sgemm.cpp): each load of W serves RM
// rows and each load of x RN outputs, RM x RN independent sums hide the FMA latency; one row of x streams W a row at
// a time instead (`rows`). Threads (OpenMP: the runtime torch loaded, so the two never compete, its team made once)
// split the tiles or W's rows, each thread a contiguous share.
//
// Compiled once per instruction-set level by ops/cpu_kernels.py, which loads the one the CPU can run:
//   portable     GCC/Clang vector types (SSE2 on x86, NEON on ARM)
//   avx2         AVX2 + FMA + F16C: 8 floats a vector, bf16 widened by a 16-bit shift
//   avx512       AVX-512 F/BW/VL/DQ: 16 floats a vector, int8 / int4 through vpmaddubsw + vpmaddwd
//   avx512_vnni  + VNNI: int4 x int8 in one vpdpbusd, int16 x int16 in one vpdpwssd
//   avx512_bf16  + AVX512-BF16: bf16 weights by vdpbf16ps (x rounded to bf16 once per call)
// Entry points: linear.h. Tests hold every level to ops/quant.py's float32 reference.
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>
#include <algorithm>
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "decode_common.h"                       // bf16 <-> float32
#include "linear.h"

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#define L512 1
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define L256 1
#endif

extern "C" const char* cpu_level() {
#if defined(L512) && defined(__AVX512BF16__) && defined(__AVX512VNNI__)
    return "avx512_bf16";
#elif defined(L512) && defined(__AVX512VNNI__)
    return "avx512_vnni";
#elif defined(L512)
    return "avx512";
#elif defined(L256)
    return "avx2";
#else
    return "portable";
#endif
}

typedef float f8 __attribute__((vector_size(32)));
typedef int32_t i8x __attribute__((vector_size(32)));
typedef uint16_t h8 __attribute__((vector_size(16)));
static inline f8 load(const float* p) { f8 v; std::memcpy(&v, p, 32); return v; }
static inline float hsum(f8 v) { float s = 0.f; for (int i = 0; i < 8; i++) s += v[i]; return s; }
static inline float wone(float v) { return v; }
static inline float wone(uint16_t v) { return bf2f(v); }

// ---- float vectors of the level: V holds W floats; vload widens bf16 by a 16-bit shift ------------------------
#if defined(L512)
typedef __m512 V;
constexpr int W = 16, RM = 4, RN = 6;              // 24 sums + 4 of x + 1 of W in 32 registers
static inline V vload(const float* p) { return _mm512_loadu_ps(p); }
static inline V vload(const uint16_t* p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline V vfma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
static inline float vsum(V v) { return _mm512_reduce_add_ps(v); }
static inline V vzero() { return _mm512_setzero_ps(); }
#elif defined(L256)
typedef __m256 V;
constexpr int W = 8, RM = 3, RN = 4;               // 12 sums + 3 of x + 1 of W in 16 registers
static inline V vload(const float* p) { return _mm256_loadu_ps(p); }
static inline V vload(const uint16_t* p) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}
static inline V vfma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
static inline float vsum(V v) { return hsum((f8)v); }
static inline V vzero() { return _mm256_setzero_ps(); }
#else
typedef f8 V;
constexpr int W = 8, RM = 2, RN = 4;
static inline V vload(const float* p) { return load(p); }
static inline V vload(const uint16_t* p) {
    h8 h; std::memcpy(&h, p, 16);
    i8x u = __builtin_convertvector(h, i8x) << 16;
    f8 f; std::memcpy(&f, &u, 32); return f;
}
static inline V vfma(V a, V b, V c) { return a * b + c; }
static inline float vsum(V v) { return hsum(v); }
static inline V vzero() { return V{}; }
#endif

// Tiles: y[m0 + i, n0 + j] for i < R, j < C, through `tile<R, C>`; `tiles` runs a whole product over threads with
// the edge tiles of smaller R, C picked by a switch (every pair instantiated, 1..RM x 1..RN).
template <template <int, int> class Tile, int R>
struct ByCols {
    template <typename... A> static void run(int c, A... a) {
        switch (c) {
            case 1: Tile<R, 1>::run(a...); break;
            case 2: if constexpr (RN >= 2) Tile<R, 2>::run(a...); break;
            case 3: if constexpr (RN >= 3) Tile<R, 3>::run(a...); break;
            case 4: if constexpr (RN >= 4) Tile<R, 4>::run(a...); break;
            case 5: if constexpr (RN >= 5) Tile<R, 5>::run(a...); break;
            case 6: if constexpr (RN >= 6) Tile<R, 6>::run(a...); break;
        }
    }
};
template <template <int, int> class Tile, int TM, int TN, typename... A>
static void tiles(int64_t M, int64_t N, A... a) {
    const int64_t nt = (N + TN - 1) / TN, mt = (M + TM - 1) / TM;
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < nt * mt; t++) {
        const int64_t n0 = (t / mt) * TN, m0 = (t % mt) * TM;    // the rows of x inner: W's tile stays in cache
        const int r = int(std::min<int64_t>(TM, M - m0)), c = int(std::min<int64_t>(TN, N - n0));
        switch (r) {
            case 1: ByCols<Tile, 1>::run(c, m0, n0, a...); break;
            case 2: if constexpr (TM >= 2) ByCols<Tile, 2>::run(c, m0, n0, a...); break;
            case 3: if constexpr (TM >= 3) ByCols<Tile, 3>::run(c, m0, n0, a...); break;
            case 4: if constexpr (TM >= 4) ByCols<Tile, 4>::run(c, m0, n0, a...); break;
        }
    }
}

// ---- float32 and bfloat16 W, float32 x --------------------------------------------------------------------------
template <typename T>
struct FloatTile {
    template <int R, int C>
    struct At {
        static void run(int64_t m0, int64_t n0, const float* x, int64_t K, const T* w, int64_t N, float* y) {
            const int64_t Kv = K - K % W;
            V acc[R][C];
            for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) acc[i][j] = vzero();
            const float* xr = x + m0 * K;
            const T* wr = w + n0 * K;
            for (int64_t k = 0; k < Kv; k += W) {
                V xv[R];
                for (int i = 0; i < R; i++) xv[i] = vload(xr + i * K + k);
                for (int j = 0; j < C; j++) {
                    const V wv = vload(wr + j * K + k);
                    for (int i = 0; i < R; i++) acc[i][j] = vfma(xv[i], wv, acc[i][j]);
                }
            }
            for (int i = 0; i < R; i++)
                for (int j = 0; j < C; j++) {
                    float s = vsum(acc[i][j]);
                    for (int64_t k = Kv; k < K; k++) s += xr[i * K + k] * wone(wr[j * K + k]);
                    y[(m0 + i) * N + n0 + j] = s;
                }
        }
    };
};
template <int R, int C> using F32Tile = FloatTile<float>::At<R, C>;
template <int R, int C> using BF16Tile = FloatTile<uint16_t>::At<R, C>;

// fewer multiply-adds than this run on one thread: starting and joining the team costs about what they take (the
// team itself is OpenMP's, made once and kept: torch's own threads)
constexpr int64_t SMALL = 1 << 15;

// One row of x (decode): each thread streams its share of W's rows one row after another, 8 vectors a step into 8
// sums. A single stream per thread reads faster than a tile's 6 (whose rows, 4 KB apart at K = 2048 in bf16, share
// L1 sets) and needs no software prefetch (which slowed it: the hardware's stream prefetcher keeps ahead); measured
// on a Zen 4 at one thread, 0.85 against 0.72 of the read limit for the tile. `out(n, s)` stores row n's sum.
template <typename T, typename Out>
static void rows(const float* x, int64_t K, const T* w, int64_t N, Out out) {
    constexpr int U = 8;
    const int64_t Ku = K - K % (U * W), Kv = K - K % W;
#pragma omp parallel for schedule(static) if (N * K >= SMALL)
    for (int64_t n = 0; n < N; n++) {
        const T* r = w + n * K;
        V acc[U];
        for (int u = 0; u < U; u++) acc[u] = vzero();
        int64_t k = 0;
        for (; k < Ku; k += U * W)
            for (int u = 0; u < U; u++) acc[u] = vfma(vload(x + k + u * W), vload(r + k + u * W), acc[u]);
        for (; k < Kv; k += W) acc[0] = vfma(vload(x + k), vload(r + k), acc[0]);
        for (int u = 1; u < U; u++) acc[0] = acc[0] + acc[u];
        float s = vsum(acc[0]);
        for (; k < K; k++) s += x[k] * wone(r[k]);
        out(n, s);
    }
}

extern "C" void mv_f32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
    if (M == 1) return rows(x, K, w, N, [y](int64_t n, float s) { y[n] = s; });
    tiles<F32Tile, RM, RN>(M, N, x, K, w, N, y);
}

// the bf16 weights widened to float32 by a shift whatever the level (the loop the bf16 dot products are tested on)
extern "C" void mv_bf16_f32(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
    if (M == 1) return rows(x, K, w, N, [y](int64_t n, float s) { y[n] = s; });
    tiles<BF16Tile, RM, RN>(M, N, x, K, w, N, y);
}

#if defined(L512) && defined(__AVX512BF16__)
// bf16 x and W on CPUs with bf16 dot products (Cooper Lake, Zen 4 and later): vdpbf16ps multiplies 32 bf16 pairs a
// step into 16 float32 sums, so W streams with no conversion; the last partial step is a masked load of both.
template <int R, int C>
struct BF16DotTile {
    static void run(int64_t m0, int64_t n0, const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, float* y) {
        const int64_t K32 = K & ~int64_t(31);
        const __mmask32 tail = K > K32 ? __mmask32((1ull << (K - K32)) - 1) : 0;
        __m512 acc[R][C];
        for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) acc[i][j] = _mm512_setzero_ps();
        const uint16_t* xr = x + m0 * K;
        const uint16_t* wr = w + n0 * K;
        for (int64_t k = 0; k < K32; k += 32) {
            __m512bh xv[R];
            for (int i = 0; i < R; i++) xv[i] = (__m512bh)_mm512_loadu_si512(xr + i * K + k);
            for (int j = 0; j < C; j++) {
                const __m512bh wv = (__m512bh)_mm512_loadu_si512(wr + j * K + k);
                for (int i = 0; i < R; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
        if (tail) {
            __m512bh xv[R];
            for (int i = 0; i < R; i++) xv[i] = (__m512bh)_mm512_maskz_loadu_epi16(tail, xr + i * K + K32);
            for (int j = 0; j < C; j++) {
                const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(tail, wr + j * K + K32);
                for (int i = 0; i < R; i++) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv[i], wv);
            }
        }
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++) y[(m0 + i) * N + n0 + j] = _mm512_reduce_add_ps(acc[i][j]);
    }
};

// one row of bf16 x (decode), as `rows` above: 8 vectors of 32 bf16 pairs a step, then 32 a step, then a masked tail
template <typename Out>
static void bf16_dot_rows(const uint16_t* x, int64_t K, const uint16_t* w, int64_t N, Out out) {
    constexpr int U = 8;
    const int64_t Ku = K - K % (U * 32), K32 = K & ~int64_t(31);
    const __mmask32 tail = K > K32 ? __mmask32((1ull << (K - K32)) - 1) : 0;
#pragma omp parallel for schedule(static) if (N * K >= SMALL)
    for (int64_t n = 0; n < N; n++) {
        const uint16_t* r = w + n * K;
        __m512 acc[U];
        for (int u = 0; u < U; u++) acc[u] = _mm512_setzero_ps();
        int64_t k = 0;
        for (; k < Ku; k += U * 32)
            for (int u = 0; u < U; u++)
                acc[u] = _mm512_dpbf16_ps(acc[u], (__m512bh)_mm512_loadu_si512(x + k + u * 32),
                                          (__m512bh)_mm512_loadu_si512(r + k + u * 32));
        for (; k < K32; k += 32)
            acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_loadu_si512(x + k), (__m512bh)_mm512_loadu_si512(r + k));
        if (tail)
            acc[0] = _mm512_dpbf16_ps(acc[0], (__m512bh)_mm512_maskz_loadu_epi16(tail, x + K32),
                                      (__m512bh)_mm512_maskz_loadu_epi16(tail, r + K32));
        for (int u = 1; u < U; u++) acc[0] = _mm512_add_ps(acc[0], acc[u]);
        out(n, _mm512_reduce_add_ps(acc[0]));
    }
}
#endif

extern "C" int mv_bf16_dot() {
#if defined(L512) && defined(__AVX512BF16__)
    return 1;
#else
    return 0;
#endif
}

extern "C" void mv_bf16(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N, float* y) {
#if defined(L512) && defined(__AVX512BF16__)
    std::vector<uint16_t> xb(M * K);                 // x rounded to bf16 once (llama.cpp does the same)
    for (int64_t i = 0; i < M * K; i++) xb[i] = f2bf(x[i]);
    if (M == 1) return bf16_dot_rows(xb.data(), K, w, N, [y](int64_t n, float s) { y[n] = s; });
    tiles<BF16DotTile, RM, RN>(M, N, (const uint16_t*)xb.data(), K, w, N, y);
#else
    mv_bf16_f32(x, M, K, w, N, y);
#endif
}

// bf16 in, bf16 out (a bf16 model's step): the sums and the bias add in float32, y rounded to nearest even once
// (what y.float() + bias.float() -> .to(bf16) gives), so the caller converts nothing
extern "C" void mv_bf16_io(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                           const uint16_t* bias, uint16_t* y) {
    auto store = [bias](uint16_t* yr) {
        return [yr, bias](int64_t n, float s) { yr[n] = f2bf(s + (bias ? bf2f(bias[n]) : 0.f)); };
    };
#if defined(L512) && defined(__AVX512BF16__)
    if (M == 1) return bf16_dot_rows(x, K, w, N, store(y));
    std::vector<float> yf(M * N);
    tiles<BF16DotTile, RM, RN>(M, N, x, K, w, N, yf.data());
#else
    std::vector<float> xf(M * K);
    for (int64_t i = 0; i < M * K; i++) xf[i] = bf2f(x[i]);
    if (M == 1) return rows(xf.data(), K, w, N, store(y));
    std::vector<float> yf(M * N);
    mv_bf16_f32(xf.data(), M, K, w, N, yf.data());
#endif
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < N; n++) store(y + m * N)(n, yf[m * N + n]);
}

// ---- int8 W per channel: x rounded to int16 per row ---------------------------------------------------------------
// x ≈ xs[m] · xq[m, k] with |xq| <= 32767 (a relative error of 1.5e-5, far below the weight's rounding), so the
// products are integer multiply-adds of int16 pairs (vpmaddwd, or vpdpwssd with VNNI), exact in int32 over blocks of
// KB columns (|sum| <= KB · 32767 · 127 per lane stays below 2^31), then summed in float32.
// x [M, K] float -> xq [M, K] int16 and the row scales xs [M]
static void round_rows(const float* x, int64_t M, int64_t K, int16_t* xq, float* xs) {
    for (int64_t m = 0; m < M; m++) {
        const float* xm = x + m * K;
        float mx = 0.f;
        int64_t k = 0;
#if defined(L512)                                  // (vector max and rounding: a scalar pass is 6 us at K = 2048)
        __m512 vmx = _mm512_setzero_ps();
        for (; k + 16 <= K; k += 16) vmx = _mm512_max_ps(vmx, _mm512_abs_ps(_mm512_loadu_ps(xm + k)));
        mx = _mm512_reduce_max_ps(vmx);
#endif
        for (; k < K; k++) mx = std::fmax(mx, std::fabs(xm[k]));
        const float s = mx > 0.f ? mx / 32767.f : 1.f, inv = 1.f / s;
        k = 0;
#if defined(L512)
        const __m512 vi = _mm512_set1_ps(inv);
        for (; k + 16 <= K; k += 16) {
            const __m512 r = _mm512_roundscale_ps(_mm512_mul_ps(_mm512_loadu_ps(xm + k), vi),
                                                  _MM_FROUND_TO_NEAREST_INT);
            _mm256_storeu_si256((__m256i*)(xq + m * K + k), _mm512_cvtsepi32_epi16(_mm512_cvtps_epi32(r)));
        }
#endif
        for (; k < K; k++) xq[m * K + k] = int16_t(std::nearbyint(xm[k] * inv));
        xs[m] = s;
    }
}


constexpr int64_t KB = 4096;                       // int8: columns summed in int32 before a float32 add
#if defined(L512)
typedef __m512i IV;
constexpr int IW = 32, IM = 4, IN = 4;             // int16 lanes a step; a tile of 4 x 4 outputs
static inline IV ixload(const int16_t* p) { return _mm512_loadu_si512(p); }
static inline IV iwload(const int8_t* p) { return _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i*)p)); }
static inline IV imac(IV acc, IV x, IV w) {
#if defined(__AVX512VNNI__)
    return _mm512_dpwssd_epi32(acc, x, w);
#else
    return _mm512_add_epi32(acc, _mm512_madd_epi16(x, w));
#endif
}
static inline float isum(IV v) { return _mm512_reduce_add_ps(_mm512_cvtepi32_ps(v)); }
static inline IV izero() { return _mm512_setzero_si512(); }
#elif defined(L256)
typedef __m256i IV;
constexpr int IW = 16, IM = 2, IN = 4;
static inline IV ixload(const int16_t* p) { return _mm256_loadu_si256((const __m256i*)p); }
static inline IV iwload(const int8_t* p) { return _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)p)); }
static inline IV imac(IV acc, IV x, IV w) { return _mm256_add_epi32(acc, _mm256_madd_epi16(x, w)); }
static inline float isum(IV v) { return hsum((f8)_mm256_cvtepi32_ps(v)); }
static inline IV izero() { return _mm256_setzero_si256(); }
#else
constexpr int IW = 0, IM = 2, IN = 4;              // scalar sums (the compiler vectorises what it can)
#endif

template <int R, int C>
struct Int8Tile {
    static void run(int64_t m0, int64_t n0, const int16_t* x, const float* xs, int64_t K, const int8_t* q,
                    const float* scale, int64_t N, float* y) {
        float out[R][C] = {};
        const int16_t* xr = x + m0 * K;
        const int8_t* wr = q + n0 * K;
        int64_t k = 0;
#if defined(L512) || defined(L256)
        const int64_t Kv = K - K % IW;
        while (k < Kv) {
            const int64_t end = std::min(Kv, k + KB);
            IV acc[R][C];
            for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) acc[i][j] = izero();
            for (; k < end; k += IW) {
                IV xv[R];
                for (int i = 0; i < R; i++) xv[i] = ixload(xr + i * K + k);
                for (int j = 0; j < C; j++) {
                    const IV wv = iwload(wr + j * K + k);
                    for (int i = 0; i < R; i++) acc[i][j] = imac(acc[i][j], xv[i], wv);
                }
            }
            for (int i = 0; i < R; i++) for (int j = 0; j < C; j++) out[i][j] += isum(acc[i][j]);
        }
#endif
        for (int i = 0; i < R; i++)
            for (int j = 0; j < C; j++) {
                int64_t s = 0;
                for (int64_t kk = k; kk < K; kk++) s += int32_t(xr[i * K + kk]) * int32_t(wr[j * K + kk]);
                y[(m0 + i) * N + n0 + j] = (out[i][j] + float(s)) * xs[m0 + i] * scale[n0 + j];
            }
    }
};

// Fewer rows than a tile (decode): one weight row at a time with a prefetch far ahead, so more rows are in flight
// from memory than the tile's 4 streams give (measured: the 1.1B Llama's int8 decode 21 against 15 tok/s with tiles).
static void int8_rows(const int16_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* q, const float* scale,
                      int64_t N, float* y) {
#pragma omp parallel for schedule(static) if (M * N * K >= SMALL)
    for (int64_t n = 0; n < N; n++) {
        const int8_t* row = q + n * K;
        for (int64_t m = 0; m < M; m++) {
            const int16_t* xm = xq + m * K;
            float out = 0.f;
            int64_t k = 0;
#if defined(__AVX2__)
            for (; k + 16 <= K;) {                   // blocks of <= 256: |sum| <= 16 · 2 · 32767 · 127 per lane
                __m256i acc = _mm256_setzero_si256();
                for (const int64_t end = k + 256 <= K ? k + 256 : K & ~int64_t(15); k < end; k += 16) {
                    _mm_prefetch((const char*)(row + k + 2048), _MM_HINT_T0);
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

extern "C" void mv_int8(const float* x, int64_t M, int64_t K, const int8_t* q, const float* scale, int64_t N,
                        float* y) {
    std::vector<int16_t> xq(M * K);
    std::vector<float> xs(M);
    round_rows(x, M, K, xq.data(), xs.data());
    if (M < IM)
        int8_rows(xq.data(), xs.data(), M, K, q, scale, N, y);
    else
        tiles<Int8Tile, IM, IN>(M, N, (const int16_t*)xq.data(), (const float*)xs.data(), K, q, scale, N, y);
}

// ---- int4 W repacked (llama.cpp's Q4_0 x Q8_0 form, ggml-cpu/repack.cpp) ---------------------------------------
// The stored weight W[n, k] = (v - 8) scale[n, g] + zero[n, g] = v scale + min, v in 0..15, min = zero - 8 scale
// (Q4_1's form). Packed per tile of 8 rows (zero rows past N) and group: the 8 scales and 8 mins as float16, then
// the group's blocks of 32 columns, each 8 rows x 16 bytes, byte j of a row holding column j in its low nibble and
// column j + 16 in its high one (a vector of 4 rows x 16 bytes then takes both halves with an and and a shift).
// x is rounded per block of 32 columns to int8 (d = max |x| / 127, xq = round(x / d)) once per call, so
//   y[m, n] = sum_blocks scale[n, g] d[m, b] (sum_k v xq) + sum_groups min[n, g] (sum_k x over the group)
// with the integer sums exact (u8 x s8 products: vpdpbusd with VNNI, vpmaddubsw + vpmaddwd without). Four rows of
// x per tile reuse each load of W (AVX-512).
static inline uint16_t f_h(float f) {              // float -> float16, round to nearest even
    uint32_t x; std::memcpy(&x, &f, 4);
    const uint32_t sign = (x >> 16) & 0x8000u, a = x & 0x7fffffffu;
    if (a >= 0x7f800000u) return uint16_t(sign | 0x7c00u | (a > 0x7f800000u ? 0x200u : 0u));
    if (a >= 0x477ff000u) return uint16_t(sign | 0x7c00u);                   // past 65504: infinity
    if (a < 0x38800000u) {                                                   // below 2^-14: subnormal
        float v; std::memcpy(&v, &a, 4);
        return uint16_t(sign | uint32_t(std::nearbyint(v * 16777216.f)));
    }
    const uint32_t r = a - 0x38000000u;
    return uint16_t(sign | ((r + 0xfffu + ((r >> 13) & 1u)) >> 13));
}
static inline float h_f(uint16_t h) {
    const uint32_t e = (h >> 10) & 0x1f, m = h & 0x3ff;
    float v;
    if (e == 0) v = std::ldexp(float(m), -24);
    else { uint32_t u = (e == 31 ? 0x7f800000u | (m << 13) : ((e + 112) << 23) | (m << 13)); std::memcpy(&v, &u, 4); }
    return (h & 0x8000) ? -v : v;
}

static inline int64_t q4_group_bytes(int64_t Kp, int64_t G) { return 32 + Kp / G / 32 * 128; }

extern "C" int64_t q4_packed_bytes(int64_t N, int64_t Kp, int64_t G) {
    return (N + 7) / 8 * G * q4_group_bytes(Kp, G);
}

extern "C" void q4_pack(const uint8_t* q, const float* scale, const float* zero, int64_t N, int64_t Kp, int64_t G,
                        uint8_t* packed) {
    const int64_t group = Kp / G, gb = q4_group_bytes(Kp, G), T = (N + 7) / 8;
    auto nib = [&](int64_t n, int64_t c) { return n < N ? (q[n * (Kp / 2) + c / 2] >> (4 * (c & 1))) & 15 : 0; };
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < T; t++)
        for (int64_t g = 0; g < G; g++) {
            uint8_t* o = packed + (t * G + g) * gb;
            uint16_t h[16];
            for (int r = 0; r < 8; r++) {
                const int64_t n = t * 8 + r;
                const float s = n < N ? scale[n * G + g] : 0.f, z = n < N ? zero[n * G + g] : 0.f;
                h[r] = f_h(s);
                h[8 + r] = f_h(z - 8.f * s);
            }
            std::memcpy(o, h, 32);
            for (int64_t b = 0; b < group / 32; b++)
                for (int r = 0; r < 8; r++)
                    for (int j = 0; j < 16; j++) {
                        const int64_t c = g * group + b * 32 + j;
                        o[32 + b * 128 + r * 16 + j] = uint8_t(nib(t * 8 + r, c) | (nib(t * 8 + r, c + 16) << 4));
                    }
        }
}

// x [M, K] -> xq int8 [M, Kp], d [M, Kp / 32], the sums of x over each group xsum [M, G] (columns past K are zeros)
static void q8_rows(const float* x, int64_t M, int64_t K, int64_t Kp, int64_t G, int8_t* xq, float* d, float* xsum) {
    const int64_t nb = Kp / 32, group = Kp / G;
    for (int64_t m = 0; m < M; m++)
        for (int64_t b = 0; b < nb; b++) {
            const int64_t k0 = b * 32;
            float mx = 0.f, s = 0.f;
            int8_t* q = xq + m * Kp + k0;
#if defined(L512)                                  // a whole block in x: vector max and rounding
            if (k0 + 32 <= K) {
                const __m512 v0 = _mm512_loadu_ps(x + m * K + k0), v1 = _mm512_loadu_ps(x + m * K + k0 + 16);
                mx = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
                for (int j = 0; j < 32; j++) s += x[m * K + k0 + j];     // in column order, as the scalar loop
                const float db = mx / 127.f;
                if (db > 0.f) {
                    const __m512 dv = _mm512_set1_ps(db);
                    for (int h = 0; h < 2; h++) {
                        const __m512 r = _mm512_roundscale_ps(_mm512_div_ps(h ? v1 : v0, dv),
                                                              _MM_FROUND_TO_NEAREST_INT);
                        _mm_storeu_si128((__m128i*)(q + 16 * h), _mm512_cvtsepi32_epi8(_mm512_cvtps_epi32(r)));
                    }
                } else {
                    std::memset(q, 0, 32);
                }
                d[m * nb + b] = db;
                xsum[m * G + k0 / group] += s;
                continue;
            }
#endif
            float v[32];
            for (int j = 0; j < 32; j++) {
                const int64_t k = k0 + j;
                v[j] = k < K ? x[m * K + k] : 0.f;
                mx = std::fmax(mx, std::fabs(v[j]));
                s += v[j];
            }
            const float db = mx / 127.f;
            for (int j = 0; j < 32; j++) q[j] = db > 0.f ? int8_t(std::nearbyint(v[j] / db)) : 0;
            d[m * nb + b] = db;
            xsum[m * G + k0 / group] += s;
        }
}

#if defined(L512)
constexpr int QM = 4;
template <int R>
static void q4_tile(int64_t m0, int64_t t, const int8_t* xq, const float* xd, const float* xsum, int64_t Kp,
                    int64_t G, const uint8_t* packed, int64_t N, float* y) {
    const int64_t nb = Kp / G / 32, gb = q4_group_bytes(Kp, G), nblk = Kp / 32;
    const uint8_t* tile = packed + t * G * gb;
    __m512 acc0[R], acc1[R];
    __m256 macc[R];
    for (int i = 0; i < R; i++) acc0[i] = acc1[i] = _mm512_setzero_ps(), macc[i] = _mm256_setzero_ps();
    const __m512i low = _mm512_set1_epi8(15);
    const __m512i idx0 = _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    const __m512i idx1 = _mm512_add_epi32(idx0, _mm512_set1_epi32(4));
    auto dot = [&](__m512i lo, __m512i xl, __m512i hi, __m512i xh) {
#if defined(__AVX512VNNI__)
        return _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xl), hi, xh);
#else
        return _mm512_madd_epi16(_mm512_add_epi16(_mm512_maddubs_epi16(lo, xl), _mm512_maddubs_epi16(hi, xh)),
                                 _mm512_set1_epi16(1));
#endif
    };
    for (int64_t g = 0; g < G; g++) {
        const uint8_t* h = tile + g * gb;
        const __m512 sm = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)h));    // 8 scales, 8 mins
        const __m256 mn = _mm512_extractf32x8_ps(sm, 1);
        const __m512 sv0 = _mm512_permutexvar_ps(idx0, sm), sv1 = _mm512_permutexvar_ps(idx1, sm);
        for (int i = 0; i < R; i++) macc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[(m0 + i) * G + g]), macc[i]);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* blk = h + 32 + b * 128;
            const __m512i w0 = _mm512_loadu_si512(blk), w1 = _mm512_loadu_si512(blk + 64);
            const __m512i l0 = _mm512_and_si512(w0, low), h0 = _mm512_and_si512(_mm512_srli_epi16(w0, 4), low);
            const __m512i l1 = _mm512_and_si512(w1, low), h1 = _mm512_and_si512(_mm512_srli_epi16(w1, 4), low);
            const int64_t bi = g * nb + b;
            for (int i = 0; i < R; i++) {
                const int8_t* xb = xq + (m0 + i) * Kp + bi * 32;
                const __m512i xl = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)xb));
                const __m512i xh = _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i*)(xb + 16)));
                const __m512 dv = _mm512_set1_ps(xd[(m0 + i) * nblk + bi]);
                acc0[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(l0, xl, h0, xh)), _mm512_mul_ps(sv0, dv), acc0[i]);
                acc1[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot(l1, xl, h1, xh)), _mm512_mul_ps(sv1, dv), acc1[i]);
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float a[32], mm[8];
        _mm512_storeu_ps(a, acc0[i]);
        _mm512_storeu_ps(a + 16, acc1[i]);
        _mm256_storeu_ps(mm, macc[i]);
        for (int r = 0; r < 8 && t * 8 + r < N; r++)
            y[(m0 + i) * N + t * 8 + r] = ((a[4 * r] + a[4 * r + 1]) + (a[4 * r + 2] + a[4 * r + 3])) + mm[r];
    }
}
#elif defined(L256)
constexpr int QM = 2;
template <int R>
static void q4_tile(int64_t m0, int64_t t, const int8_t* xq, const float* xd, const float* xsum, int64_t Kp,
                    int64_t G, const uint8_t* packed, int64_t N, float* y) {
    const int64_t nb = Kp / G / 32, gb = q4_group_bytes(Kp, G), nblk = Kp / 32;
    const uint8_t* tile = packed + t * G * gb;
    __m256 acc[R][4], macc[R];
    for (int i = 0; i < R; i++) {
        macc[i] = _mm256_setzero_ps();
        for (int p = 0; p < 4; p++) acc[i][p] = _mm256_setzero_ps();
    }
    const __m256i low = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
    for (int64_t g = 0; g < G; g++) {
        const uint8_t* h = tile + g * gb;
        const __m256 s8 = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)h));
        const __m256 mn = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(h + 16)));
        __m256 sv[4];                                 // vector p holds rows 2p (lanes 0-3) and 2p + 1 (lanes 4-7)
        for (int p = 0; p < 4; p++)
            sv[p] = _mm256_permutevar8x32_ps(s8, _mm256_set_epi32(2 * p + 1, 2 * p + 1, 2 * p + 1, 2 * p + 1,
                                                                   2 * p, 2 * p, 2 * p, 2 * p));
        for (int i = 0; i < R; i++) macc[i] = _mm256_fmadd_ps(mn, _mm256_set1_ps(xsum[(m0 + i) * G + g]), macc[i]);
        for (int64_t b = 0; b < nb; b++) {
            const uint8_t* blk = h + 32 + b * 128;
            const int64_t bi = g * nb + b;
            __m256i xl[R], xh[R];
            __m256 dv[R];
            for (int i = 0; i < R; i++) {
                const int8_t* xb = xq + (m0 + i) * Kp + bi * 32;
                xl[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)xb));
                xh[i] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(xb + 16)));
                dv[i] = _mm256_set1_ps(xd[(m0 + i) * nblk + bi]);
            }
            for (int p = 0; p < 4; p++) {
                const __m256i w = _mm256_loadu_si256((const __m256i*)(blk + 32 * p));
                const __m256i lo = _mm256_and_si256(w, low), hi = _mm256_and_si256(_mm256_srli_epi16(w, 4), low);
                for (int i = 0; i < R; i++) {
                    const __m256i s = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(lo, xl[i]),
                                                                         _mm256_maddubs_epi16(hi, xh[i])), ones);
                    acc[i][p] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s), _mm256_mul_ps(sv[p], dv[i]), acc[i][p]);
                }
            }
        }
    }
    for (int i = 0; i < R; i++) {
        float a[32], mm[8];
        for (int p = 0; p < 4; p++) _mm256_storeu_ps(a + 8 * p, acc[i][p]);
        _mm256_storeu_ps(mm, macc[i]);
        for (int r = 0; r < 8 && t * 8 + r < N; r++)
            y[(m0 + i) * N + t * 8 + r] = ((a[4 * r] + a[4 * r + 1]) + (a[4 * r + 2] + a[4 * r + 3])) + mm[r];
    }
}
#else
constexpr int QM = 1;
template <int R>
static void q4_tile(int64_t m0, int64_t t, const int8_t* xq, const float* xd, const float* xsum, int64_t Kp,
                    int64_t G, const uint8_t* packed, int64_t N, float* y) {
    const int64_t nb = Kp / G / 32, gb = q4_group_bytes(Kp, G), nblk = Kp / 32;
    const uint8_t* tile = packed + t * G * gb;
    for (int i = 0; i < R; i++)
        for (int r = 0; r < 8 && t * 8 + r < N; r++) {
            float out = 0.f;
            for (int64_t g = 0; g < G; g++) {
                const uint8_t* h = tile + g * gb;
                uint16_t sh, mh;
                std::memcpy(&sh, h + 2 * r, 2);
                std::memcpy(&mh, h + 16 + 2 * r, 2);
                const float s = h_f(sh);
                for (int64_t b = 0; b < nb; b++) {
                    const uint8_t* row = h + 32 + b * 128 + r * 16;
                    const int8_t* xb = xq + (m0 + i) * Kp + (g * nb + b) * 32;
                    int32_t acc = 0;
                    for (int j = 0; j < 16; j++) acc += (row[j] & 15) * xb[j] + (row[j] >> 4) * xb[j + 16];
                    out += float(acc) * (s * xd[(m0 + i) * nblk + g * nb + b]);
                }
                out += h_f(mh) * xsum[(m0 + i) * G + g];
            }
            y[(m0 + i) * N + t * 8 + r] = out;
        }
}
#endif

extern "C" void q4_linear(const float* x, int64_t M, int64_t K, const uint8_t* packed, int64_t N, int64_t Kp,
                          int64_t G, float* y) {
    const int64_t nblk = Kp / 32, T = (N + 7) / 8, mt = (M + QM - 1) / QM;
    std::vector<int8_t> xq(M * Kp);
    std::vector<float> xd(M * nblk), xsum(M * G, 0.f);
    q8_rows(x, M, K, Kp, G, xq.data(), xd.data(), xsum.data());
#pragma omp parallel for schedule(static) if (M * N * Kp >= SMALL)
    for (int64_t u = 0; u < T * mt; u++) {
        const int64_t t = u / mt, m0 = (u % mt) * QM;
        switch (std::min<int64_t>(QM, M - m0)) {
            case 1: q4_tile<1>(m0, t, xq.data(), xd.data(), xsum.data(), Kp, G, packed, N, y); break;
            case 2: if constexpr (QM >= 2) q4_tile<2>(m0, t, xq.data(), xd.data(), xsum.data(), Kp, G, packed, N, y);
                    break;
            case 3: if constexpr (QM >= 3) q4_tile<3>(m0, t, xq.data(), xd.data(), xsum.data(), Kp, G, packed, N, y);
                    break;
            case 4: if constexpr (QM >= 4) q4_tile<4>(m0, t, xq.data(), xd.data(), xsum.data(), Kp, G, packed, N, y);
                    break;
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
            if (bf) for (int64_t k = 0; k < group; k++) ((uint16_t*)out)[k0 + k] = f2bf(w[k]);
            else std::memcpy((float*)out + k0, w, group * 4);
        }
    }
}

extern "C" void dq_int8(const int8_t* q, const float* scale, int64_t N, int64_t K, void* out, int bf) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++)
        for (int64_t k = 0; k < K; k++) {
            const float w = float(q[n * K + k]) * scale[n];
            if (bf) ((uint16_t*)out)[n * K + k] = f2bf(w);
            else ((float*)out)[n * K + k] = w;
        }
}
