// One-token decode ops on a CPU, each a single call in place of the many small PyTorch ops of its reference form
// (ops/ssd.ssd_step, ops/gla.gla_step, ops/delta_rule.delta_rule_step, ops/conv.causal_conv1d_step,
// ops/attention.decode_attention, ops/norm.rms_norm / gated_rms_norm): at batch 1 each of those ops costs a few
// microseconds of dispatch for a few microseconds of work, and a layer ran 30-80 of them. Compiled with gemm.cpp
// into one library by ops/cpu_kernels.py; ops/cpu_decode.py calls them and tests hold each to its reference.
//
// Recurrent states are float32 [B, H, K, V] and are updated in place (a decode cache owns its state); the small
// inputs are float32 (the wrappers convert, a no-op for most); attention reads the KV cache as stored (float32 or
// bf16, `bf` = 1) through its strides; every sum is in float32. Threads (OpenMP, torch's) split batch x heads (and
// attention's keys).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
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

// One query per row over its own cached keys (flash decoding): q [B, Hq, D]; k, v as stored in the cache, element
// strides (batch, time, head; a KV cache is head-major), each head's row contiguous; Hk and Hv divide Hq ->
// o [B, Hq, Dv] = softmax(scale q kᵀ) v over row b's keys. Row b reads key slots [lo[b], len[b]) (lo null: 0); with
// `ring` = W > 0 the cache is a sliding-window ring (row b's token t in slot t % W): it reads slots
// [0, min(len[b], W)), the slot s holding token len[b] - 1 - ((len[b] - 1 - s) mod W), skipped below lo[b].
// Only a row's own keys are read: never the buffer's capacity, never another row's length.
// Work items are (row, key head, run of keys): a long cache or a single key head (shared keys, MLA's latent) still
// splits over the threads; each item walks its keys in tiles with an online softmax (running max and sum), reading
// each key and value row once for every query head it serves; the items' partial sums are merged at the end.
template <typename T>
static void attend(const T* q, const T* k, const T* v, T* o, int64_t Bn, int64_t Hq, int64_t Hk, int64_t Hv,
                   int64_t D, int64_t Dv, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb, int64_t vss,
                   int64_t vsh, const int64_t* lo, const int64_t* len, int64_t ring, float scale) {
    constexpr int64_t TILE = 32;
    const int64_t gk = Hq / Hk, gv = Hq / Hv;
    int64_t span = 0;                                      // the most key slots a row reads
    for (int64_t b = 0; b < Bn; b++) {
        const int64_t n = ring ? std::min(len[b], ring) : len[b] - (lo ? lo[b] : 0);
        span = std::max(span, n);
    }
    // runs of keys: enough items for the threads (twice over), none under 256 keys
    const int64_t threads = omp_get_max_threads(), heads = Bn * Hk;
    const int64_t want = std::max<int64_t>(1, (2 * threads + heads - 1) / heads);
    const int64_t run = std::max<int64_t>(256, (span + want - 1) / want);
    const int64_t runs = std::max<int64_t>(1, (span + run - 1) / run);
    const int64_t part = 2 + Dv;                           // per query head of an item: max, sum, Σ p v
    const bool wide = gk >= 8;                             // scores as vectors across the query heads of a key head
    std::vector<float> parts(heads * runs * gk * part);
#pragma omp parallel for schedule(dynamic)
    for (int64_t it = 0; it < heads * runs; it++) {
        const int64_t b = it / (Hk * runs), hk = (it / runs) % Hk, c = it % runs;
        const int64_t first = ring ? 0 : (lo ? lo[b] : 0), last = ring ? std::min(len[b], ring) : len[b];
        const int64_t s0 = first + c * run, s1 = std::min(last, s0 + run);
        float* mine = parts.data() + it * gk * part;
        std::vector<float> qf(gk * D), qt(wide ? D * gk : 0), dots(4 * gk), sc(gk * TILE), m(gk, -INFINITY), l(gk, 0.f),
            acc(gk * Dv, 0.f), kf(4 * D), vf(Dv);
        for (int64_t j = 0; j < gk; j++)
            for (int64_t d = 0; d < D; d++) qf[j * D + d] = ld(q, (b * Hq + hk * gk + j) * D + d) * scale;
        if (wide)
            for (int64_t j = 0; j < gk; j++)
                for (int64_t d = 0; d < D; d++) qt[d * gk + j] = qf[j * D + d];
        const int64_t hv0 = hk * gk / gv, hv1 = (hk * gk + gk - 1) / gv;      // the value heads these queries read
        for (int64_t t0 = s0; t0 < s1; t0 += TILE) {
            const int64_t nt = std::min(TILE, s1 - t0);
            for (int64_t i0 = 0; i0 < nt; i0 += 4) {            // scores of 4 keys at a time: independent sums
                const int64_t nu = std::min<int64_t>(4, nt - i0);
                const T* kr[4];
                for (int64_t u = 0; u < 4; u++) kr[u] = k + b * ksb + (t0 + i0 + std::min(u, nu - 1)) * kss + hk * ksh;
                if (wide) {                                    // many query heads: vectors across the heads
                    std::fill(dots.begin(), dots.end(), 0.f);
                    for (int64_t d = 0; d < D; d++) {
                        const float k0 = ld(kr[0], d), k1 = ld(kr[1], d), k2 = ld(kr[2], d), k3 = ld(kr[3], d);
                        const float* qd = qt.data() + d * gk;
                        float *s0 = dots.data(), *s1 = s0 + gk, *s2 = s1 + gk, *s3 = s2 + gk;
#pragma omp simd
                        for (int64_t j = 0; j < gk; j++) {
                            s0[j] += qd[j] * k0;
                            s1[j] += qd[j] * k1;
                            s2[j] += qd[j] * k2;
                            s3[j] += qd[j] * k3;
                        }
                    }
                    for (int64_t u = 0; u < nu; u++)
                        for (int64_t j = 0; j < gk; j++) sc[j * TILE + i0 + u] = dots[u * gk + j];
                } else {                                       // few: along the channels, each row converted once
                    for (int64_t u = 0; u < 4; u++)
                        for (int64_t d = 0; d < D; d++) kf[u * D + d] = ld(kr[u], d);
                    const float *f0 = kf.data(), *f1 = f0 + D, *f2 = f1 + D, *f3 = f2 + D;
                    for (int64_t j = 0; j < gk; j++) {
                        const float* qj = qf.data() + j * D;
                        float a0 = 0.f, a1 = 0.f, a2 = 0.f, a3 = 0.f;
#pragma omp simd reduction(+ : a0, a1, a2, a3)
                        for (int64_t d = 0; d < D; d++) {
                            a0 += qj[d] * f0[d];
                            a1 += qj[d] * f1[d];
                            a2 += qj[d] * f2[d];
                            a3 += qj[d] * f3[d];
                        }
                        const float got[4] = {a0, a1, a2, a3};
                        for (int64_t u = 0; u < nu; u++) sc[j * TILE + i0 + u] = got[u];
                    }
                }
                if (ring && lo && lo[b] > 0)                   // a padded row's ring: its pads' slots skipped
                    for (int64_t u = 0; u < nu; u++) {
                        const int64_t s = t0 + i0 + u;
                        if (len[b] - 1 - (len[b] - 1 - s) % ring < lo[b])
                            for (int64_t j = 0; j < gk; j++) sc[j * TILE + i0 + u] = -INFINITY;
                    }
            }
            for (int64_t j = 0; j < gk; j++) {                 // the online softmax: new max, rescale, weights
                float* p = sc.data() + j * TILE;
                float mx = m[j];
                for (int64_t i = 0; i < nt; i++) mx = p[i] > mx ? p[i] : mx;
                if (mx == -INFINITY) {
                    for (int64_t i = 0; i < nt; i++) p[i] = 0.f;
                    continue;
                }
                const float r = m[j] == -INFINITY ? 0.f : exp_neg(m[j] - mx);
                float sum = 0.f;
#pragma omp simd reduction(+ : sum)
                for (int64_t i = 0; i < nt; i++) { p[i] = p[i] == -INFINITY ? 0.f : exp_neg(p[i] - mx); sum += p[i]; }
                l[j] = l[j] * r + sum;
                m[j] = mx;
                if (r != 1.f)
                    for (int64_t d = 0; d < Dv; d++) acc[j * Dv + d] *= r;
            }
            // Σ p v, each value row read once, in the order the cache lies in: by head over a head-major buffer
            // (a KV cache), by key over a time-major one (a window's ring)
            const bool by_key = vss < vsh;
            for (int64_t outer = 0; outer < (by_key ? nt : hv1 - hv0 + 1); outer++)
                for (int64_t inner = 0; inner < (by_key ? hv1 - hv0 + 1 : nt); inner++) {
                    const int64_t i = by_key ? outer : inner, hv = hv0 + (by_key ? inner : outer);
                    const int64_t j0 = std::max<int64_t>(0, hv * gv - hk * gk);
                    const int64_t j1 = std::min(gk, (hv + 1) * gv - hk * gk);     // its query heads
                    const T* vr = v + b * vsb + (t0 + i) * vss + hv * vsh;
                    for (int64_t d = 0; d < Dv; d++) vf[d] = ld(vr, d);
                    for (int64_t j = j0; j < j1; j++) {
                        const float w = sc[j * TILE + i];
                        float* a = acc.data() + j * Dv;
#pragma omp simd
                        for (int64_t d = 0; d < Dv; d++) a[d] += w * vf[d];
                    }
                }
        }
        for (int64_t j = 0; j < gk; j++) {
            mine[j * part] = m[j];
            mine[j * part + 1] = l[j];
            std::memcpy(mine + j * part + 2, acc.data() + j * Dv, Dv * 4);
        }
    }
#pragma omp parallel for schedule(static)
    for (int64_t bh = 0; bh < Bn * Hq; bh++) {              // merge the runs of each query head
        const int64_t b = bh / Hq, h = bh % Hq, hk = h / gk, j = h % gk;
        const float* p0 = parts.data() + ((b * Hk + hk) * runs * gk + j) * part;
        float mx = -INFINITY, sum = 0.f;
        for (int64_t c = 0; c < runs; c++) mx = std::max(mx, p0[c * gk * part]);
        std::vector<float> out(Dv, 0.f);
        for (int64_t c = 0; c < runs; c++) {
            const float* pc = p0 + c * gk * part;
            if (pc[0] == -INFINITY) continue;
            const float r = exp_neg(pc[0] - mx);
            sum += pc[1] * r;
            for (int64_t d = 0; d < Dv; d++) out[d] += pc[2 + d] * r;
        }
        const float inv = sum > 0.f ? 1.f / sum : 0.f;       // a row without keys: zeros
        for (int64_t d = 0; d < Dv; d++) st(o, bh * Dv + d, out[d] * inv);
    }
}

extern "C" void dec_attention(const void* q, const void* k, const void* v, void* o, int64_t Bn, int64_t Hq, int64_t Hk,
                              int64_t Hv, int64_t D, int64_t Dv, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb,
                              int64_t vss, int64_t vsh, const int64_t* lo, const int64_t* len, int64_t ring,
                              float scale, int bf) {
    if (bf) attend((const uint16_t*)q, (const uint16_t*)k, (const uint16_t*)v, (uint16_t*)o, Bn, Hq, Hk, Hv, D, Dv,
                   ksb, kss, ksh, vsb, vss, vsh, lo, len, ring, scale);
    else attend((const float*)q, (const float*)k, (const float*)v, (float*)o, Bn, Hq, Hk, Hv, D, Dv, ksb, kss, ksh,
                vsb, vss, vsh, lo, len, ring, scale);
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
