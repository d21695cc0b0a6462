// One-token decode ops on a CPU, each a single call in place of the many small PyTorch ops of its reference form
// (ops/ssd.ssd_step, ops/gla.gla_step, ops/delta_rule.delta_rule_step, ops/conv.causal_conv1d_step,
// ops/attention.decode_attention, ops/norm.rms_norm / gated_rms_norm): at batch 1 each of those ops costs a few
// microseconds of dispatch for a few microseconds of work, and a layer ran 30-80 of them. Compiled with matvec.cpp
// into one library by ops/cpu_kernels.py; ops/cpu_decode.py calls them and tests hold each to its reference.
//
// Recurrent states are float32 [B, H, K, V] and are updated in place (a decode cache owns its state); the small
// inputs are float32 (the wrappers convert, a no-op for most); attention reads the KV cache as stored (float32 or
// bf16, `bf` = 1) through its strides; every sum is in float32. Threads (OpenMP, torch's) split batch x heads.
#include <cstdint>
#include <cmath>
#include <cstring>
#include <vector>

#include "decode_common.h"

// a row of n values -> float32 (bf16: the bits widened in an integer loop the compiler vectorises)
static inline void row_f32(const float* p, int64_t n, float* out, uint32_t*) { std::memcpy(out, p, n * 4); }
static inline void row_f32(const uint16_t* p, int64_t n, float* out, uint32_t* bits) {
    for (int64_t i = 0; i < n; i++) bits[i] = uint32_t(p[i]) << 16;
    std::memcpy(out, bits, n * 4);
}
// exp(x) for x <= 0 (softmax after the max is taken off) in plain arithmetic the compiler vectorises (std::exp is a
// scalar call, and a long context's softmax spent most of its time there): 2^n · p(r), x = n ln2 + r, |r| <= ln2/2,
// p the degree-6 Taylor polynomial (relative error < 2e-7); below -87 it is 0
static inline float exp_neg(float x) {
    x = x < -87.f ? -87.f : x;
    const float n = std::nearbyint(x * 1.44269504f);
    const float r = x - n * 0.693145752f - n * 1.42860677e-6f;
    float p = 1.f / 720.f;
    p = p * r + 1.f / 120.f;
    p = p * r + 1.f / 24.f;
    p = p * r + 1.f / 6.f;
    p = p * r + 0.5f;
    p = p * r + 1.f;
    p = p * r + 1.f;
    const int32_t e = (int32_t(n) + 127) << 23;
    float scale;
    std::memcpy(&scale, &e, 4);
    return p * scale;
}
// SSD (Mamba-2) step: x [B, H, P], dt [B, H], A [H], Bm, Cm [B, G, N], state [B, H, P, N] ->
// state = exp(dt A) state + dt x Bᵀ, y [B, H, P] = state C (heads h of group h / (H / G))
extern "C" void dec_ssd_step(const float* x, const float* dt, const float* A, const float* Bm, const float* Cm,
                             float* state, float* y, int64_t Bn, int64_t H, int64_t P, int64_t G, int64_t N) {
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * H; bh++) {
        const int64_t b = bh / H, h = bh % H, g = h / (H / G);
        const float d = dt[bh], decay = std::exp(d * A[h]);
        const float* Bv = Bm + (b * G + g) * N;
        const float* Cv = Cm + (b * G + g) * N;
        for (int64_t p = 0; p < P; p++) {
            float* s = state + (bh * P + p) * N;
            const float xd = x[bh * P + p] * d;
            float acc = 0.f;
#pragma omp simd reduction(+ : acc)
            for (int64_t n = 0; n < N; n++) {
                const float v = s[n] * decay + xd * Bv[n];
                s[n] = v;
                acc += v * Cv[n];
            }
            y[bh * P + p] = acc;
        }
    }
}

// Mamba-2's step from the layer's raw inputs: dt = clamp(softplus(dt_raw + dt_bias), lo, hi), A = -exp(A_log),
// the SSD step above, then y += D x. x [B, H, P], dt_raw [B, H], dt_bias, A_log, D [H], Bm, Cm [B, G, N]
extern "C" void dec_ssd_gated(const float* x, const float* dt_raw, const float* dt_bias, const float* A_log,
                              const float* D, float lo, float hi, const float* Bm, const float* Cm, float* state,
                              float* y, int64_t Bn, int64_t H, int64_t P, int64_t G, int64_t N) {
    std::vector<float> dt(Bn * H), A(H);
    for (int64_t h = 0; h < H; h++) A[h] = -std::exp(A_log[h]);
    for (int64_t i = 0; i < Bn * H; i++) {
        const float d = softplus(dt_raw[i] + dt_bias[i % H]);
        dt[i] = d < lo ? lo : d > hi ? hi : d;
    }
    dec_ssd_step(x, dt.data(), A.data(), Bm, Cm, state, y, Bn, H, P, G, N);
    for (int64_t i = 0; i < Bn * H * P; i++) y[i] += D[(i / P) % H] * x[i];
}

// GLA step (Rodimus): q, k, log_decay [B, H, K], v [B, H, V], state [B, H, K, V] ->
// state = exp(log_decay)[:, None] state + k vᵀ, o [B, H, V] = (scale q)ᵀ state
extern "C" void dec_gla_step(const float* q, const float* k, const float* v, const float* logd, float* state,
                             float* o, int64_t Bn, int64_t H, int64_t K, int64_t V, float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * H; bh++) {
        float* out = o + bh * V;
        const float* vv = v + bh * V;
        for (int64_t j = 0; j < V; j++) out[j] = 0.f;
        for (int64_t i = 0; i < K; i++) {
            float* s = state + (bh * K + i) * V;
            const float a = std::exp(logd[bh * K + i]), kk = k[bh * K + i], qq = q[bh * K + i] * scale;
            for (int64_t j = 0; j < V; j++) {
                const float t = a * s[j] + kk * vv[j];
                s[j] = t;
                out[j] += qq * t;
            }
        }
    }
}

// delta rule on one head: q, k [K], v [V], beta, log decay (one, or one per key channel when `per_key`), the head's
// state [K, V] -> S = a S; u = beta (v - Sᵀk); S += k uᵀ; out [V] = (scale q)ᵀ S
static void delta_head(const float* q, const float* k, const float* v, float beta, const float* logd, int per_key,
                       float* state, float* out, int64_t K, int64_t V, float scale) {
    std::vector<float> u(V, 0.f);
    for (int64_t i = 0; i < K; i++) {                   // decay, and Sᵀk of the decayed state
        float* s = state + i * V;
        const float a = std::exp(per_key ? logd[i] : logd[0]), kk = k[i];
        for (int64_t j = 0; j < V; j++) {
            s[j] *= a;
            u[j] += kk * s[j];
        }
    }
    for (int64_t j = 0; j < V; j++) {
        u[j] = beta * (v[j] - u[j]);
        out[j] = 0.f;
    }
    for (int64_t i = 0; i < K; i++) {
        float* s = state + i * V;
        const float kk = k[i], qq = q[i] * scale;
        for (int64_t j = 0; j < V; j++) {
            const float t = s[j] + kk * u[j];
            s[j] = t;
            out[j] += qq * t;
        }
    }
}

// delta-rule step (Gated DeltaNet, KDA): q, k [B, H, K], v [B, H, V], beta [B, H], log_decay [B, H] (per head,
// `per_key` 0) or [B, H, K] (per key channel, 1), state [B, H, K, V] -> o [B, H, V]
extern "C" void dec_delta_step(const float* q, const float* k, const float* v, const float* beta, const float* logd,
                               int per_key, float* state, float* o, int64_t Bn, int64_t H, int64_t K, int64_t V,
                               float scale) {
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * H; bh++)
        delta_head(q + bh * K, k + bh * K, v + bh * V, beta[bh], logd + (per_key ? bh * K : bh), per_key,
                   state + bh * K * V, o + bh * V, K, V, scale);
}

// the delta-rule step with the gates computed from the layer's raw inputs (Gated DeltaNet and KDA decode):
// qkv [B, 2 Hk K + H V] = [q | k | v] after the conv, q and k L2-normalised here (x / sqrt(Σx² + eps)), key head
// h / (H / Hk) serving value head h; beta = sigmoid(b [B, H]); log decay = -exp(A_log[h]) · softplus(a + dt_bias),
// a [B, H] and dt_bias [H] (per head), or a [B, H, K] and dt_bias [H, K] (`per_key`, KDA) -> o [B, H, V]
extern "C" void dec_delta_gated(const float* qkv, const float* b, const float* a, const float* A_log,
                                const float* dt_bias, int per_key, float* state, float* o, int64_t Bn, int64_t H,
                                int64_t Hk, int64_t K, int64_t V, float scale, float eps) {
    const int64_t row = 2 * Hk * K + H * V;
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * H; bh++) {
        const int64_t bi = bh / H, h = bh % H, hk = h / (H / Hk);
        const float* qr = qkv + bi * row + hk * K;
        const float* kr = qr + Hk * K;
        const float* vr = qkv + bi * row + 2 * Hk * K + h * V;
        std::vector<float> qn(K), kn(K), ld(per_key ? K : 1);
        float sq = 0.f, sk = 0.f;
        for (int64_t i = 0; i < K; i++) { sq += qr[i] * qr[i]; sk += kr[i] * kr[i]; }
        const float iq = 1.f / std::sqrt(sq + eps), ik = 1.f / std::sqrt(sk + eps);
        for (int64_t i = 0; i < K; i++) { qn[i] = qr[i] * iq; kn[i] = kr[i] * ik; }
        const float A = -std::exp(A_log[h]);
        if (per_key) for (int64_t i = 0; i < K; i++) ld[i] = A * softplus(a[bh * K + i] + dt_bias[h * K + i]);
        else ld[0] = A * softplus(a[bh] + dt_bias[h]);
        const float beta = 1.f / (1.f + std::exp(-b[bh]));
        delta_head(qn.data(), kn.data(), vr, beta, ld.data(), per_key, state + bh * K * V, o + bh * V, K, V, scale);
    }
}

// causal depthwise conv step: x [B, C], state [B, W-1, C] (the last W-1 inputs, shifted in place), weight [C, W],
// bias [C] or null -> y [B, C] = sum_j weight[:, j] window[j] (+ bias), SiLU'd when `silu`. T: x, state, y, weight.
template <typename T>
static void conv_step(const T* x, T* state, const T* w, const T* bias, T* y, int64_t Bn, int64_t C, int64_t W,
                      int silu) {
    for (int64_t b = 0; b < Bn; b++) {
        T* s = state + b * (W - 1) * C;
        for (int64_t c = 0; c < C; c++) {
            const float xc = ld(x, b * C + c);
            float acc = bias ? ld(bias, c) : 0.f;
            for (int64_t j = 0; j < W - 1; j++) acc += ld(w, c * W + j) * ld(s, j * C + c);
            acc += ld(w, c * W + W - 1) * xc;
            for (int64_t j = 0; j + 1 < W - 1; j++) s[j * C + c] = s[(j + 1) * C + c];
            if (W > 1) st(s, (W - 2) * C + c, xc);
            if (silu) acc = acc / (1.f + std::exp(-acc));
            st(y, b * C + c, acc);
        }
    }
}

extern "C" void dec_conv_step(const void* x, void* state, const void* w, const void* bias, void* y, int64_t Bn,
                              int64_t C, int64_t W, int silu, int bf) {
    if (bf) conv_step((const uint16_t*)x, (uint16_t*)state, (const uint16_t*)w, (const uint16_t*)bias, (uint16_t*)y,
                      Bn, C, W, silu);
    else conv_step((const float*)x, (float*)state, (const float*)w, (const float*)bias, (float*)y, Bn, C, W, silu);
}

// one query over every cached key: q [B, Hq, D]; k, v as stored in the cache, element strides (batch, time, head:
// the cache is head-major) and each head's row contiguous; Hk and Hv divide Hq -> o [B, Hq, Dv] =
// softmax(scale q kᵀ) v.
// By key head, then by value head: each cached row is read and converted once for all the query heads it serves.
template <typename T>
static void attend(const T* q, const T* k, const T* v, T* o, int64_t Bn, int64_t S, int64_t Hq, int64_t Hk,
                   int64_t Hv, int64_t D, int64_t Dv, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb,
                   int64_t vss, int64_t vsh, float scale) {
    const int64_t gk = Hq / Hk, gv = Hq / Hv;
    std::vector<float> P(Bn * Hq * S);
#pragma omp parallel for schedule(static)
    for (int64_t bk = 0; bk < Bn * Hk; bk++) {
        const int64_t b = bk / Hk, hk = bk % Hk;
        std::vector<float> qf(gk * D), kf(D);
        std::vector<uint32_t> bits(D);
        for (int64_t j = 0; j < gk; j++)
            for (int64_t d = 0; d < D; d++) qf[j * D + d] = ld(q, (b * Hq + hk * gk + j) * D + d) * scale;
        for (int64_t s = 0; s < S; s++) {
            const T* kr = k + b * ksb + s * kss + hk * ksh;
            row_f32(kr, D, kf.data(), bits.data());
            for (int64_t j = 0; j < gk; j++) {
                const float* qj = qf.data() + j * D;
                float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                for (int64_t d = 0; d < D; d++) dot += qj[d] * kf[d];
                P[(b * Hq + hk * gk + j) * S + s] = dot;
            }
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * Hq; bh++) {
        float* p = P.data() + bh * S;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t s = 0; s < S; s++) mx = p[s] > mx ? p[s] : mx;
#pragma omp simd reduction(+ : sum)
        for (int64_t s = 0; s < S; s++) { p[s] = exp_neg(p[s] - mx); sum += p[s]; }
        const float inv = 1.f / sum;
        for (int64_t s = 0; s < S; s++) p[s] *= inv;
    }
#pragma omp parallel for schedule(static)
    for (int64_t bv = 0; bv < Bn * Hv; bv++) {
        const int64_t b = bv / Hv, hv = bv % Hv;
        std::vector<float> acc(gv * Dv, 0.f), vf(Dv);
        std::vector<uint32_t> bits(Dv);
        for (int64_t s = 0; s < S; s++) {
            const T* vr = v + b * vsb + s * vss + hv * vsh;
            row_f32(vr, Dv, vf.data(), bits.data());
            for (int64_t j = 0; j < gv; j++) {
                const float w = P[(b * Hq + hv * gv + j) * S + s];
                float* a = acc.data() + j * Dv;
                for (int64_t d = 0; d < Dv; d++) a[d] += w * vf[d];
            }
        }
        for (int64_t j = 0; j < gv; j++)
            for (int64_t d = 0; d < Dv; d++) st(o, (b * Hq + hv * gv + j) * Dv + d, acc[j * Dv + d]);
    }
}

extern "C" void dec_attention(const void* q, const void* k, const void* v, void* o, int64_t Bn, int64_t S,
                              int64_t Hq, int64_t Hk, int64_t Hv, int64_t D, int64_t Dv, int64_t ksb, int64_t kss,
                              int64_t ksh, int64_t vsb, int64_t vss, int64_t vsh, float scale, int bf) {
    if (bf) attend((const uint16_t*)q, (const uint16_t*)k, (const uint16_t*)v, (uint16_t*)o, Bn, S, Hq, Hk, Hv, D, Dv,
                   ksb, kss, ksh, vsb, vss, vsh, scale);
    else attend((const float*)q, (const float*)k, (const float*)v, (float*)o, Bn, S, Hq, Hk, Hv, D, Dv, ksb, kss, ksh,
                vsb, vss, vsh, scale);
}

// (gated) RMSNorm of rows: x [R, d] -> y [R, d] = norm(x') · weight (float32 [d] or null), the mean of squares per group of `group`
// channels; x' = x, or with a gate z [R, d]: x · silu(z) (`mode` 1), or the gate after the norm (mode 2:
// norm(x) · weight · silu(z); mode 3: · sigmoid(z)). `res` (optional, [R, d]): x += res first, written back (the residual stream's add
// fused with the next norm).
template <typename T>
static void rms_rows(T* x, const T* res, const T* z, const float* w, T* y, int64_t R, int64_t d, int64_t group,
                     int mode, float eps) {
    std::vector<float> xf(d);
    for (int64_t r = 0; r < R; r++) {
        for (int64_t c = 0; c < d; c++) {
            float v = ld(x, r * d + c);
            if (res) { v += ld(res, r * d + c); st(x, r * d + c, v); v = ld(x, r * d + c); }
            if (mode == 1) { const float g = ld(z, r * d + c); v *= g / (1.f + std::exp(-g)); }
            xf[c] = v;
        }
        for (int64_t g0 = 0; g0 < d; g0 += group) {
            float ss = 0.f;
            for (int64_t c = g0; c < g0 + group; c++) ss += xf[c] * xf[c];
            const float inv = 1.f / std::sqrt(ss / float(group) + eps);
            for (int64_t c = g0; c < g0 + group; c++) {
                float v = xf[c] * inv * (w ? w[c] : 1.f);
                if (mode == 2) { const float g = ld(z, r * d + c); v *= g / (1.f + std::exp(-g)); }
                if (mode == 3) v /= 1.f + std::exp(-ld(z, r * d + c));
                st(y, r * d + c, v);
            }
        }
    }
}

extern "C" void dec_rms_norm(void* x, const void* res, const void* z, const void* w, void* y, int64_t R, int64_t d,
                             int64_t group, int mode, float eps, int bf) {
    if (bf) rms_rows((uint16_t*)x, (const uint16_t*)res, (const uint16_t*)z, (const float*)w, (uint16_t*)y, R, d,
                     group, mode, eps);
    else rms_rows((float*)x, (const float*)res, (const float*)z, (const float*)w, (float*)y, R, d, group, mode, eps);
}
