// Whole-mixer decode steps on a CPU: one call per mixer for a decode step of B rows, from the block's normed input to
// the mixer's output (projections through the linear kernels of gemm.cpp, the conv tail, gates, norms and the
// recurrent update or the attention over the cache), in place of the 10-40 PyTorch calls of the layer's own decode.
// layers/cpu_steps.py describes each layer's weights (a `Lin` per linear: its stored format and pointers, no copy)
// and holds each step to the layer's PyTorch decode (tests/test_cpu_decode.py).
//
// Activations x, y [B, d] are in the model's dtype (`bf` = 1: bf16 as uint16_t); sums are float32, and every value
// the PyTorch decode rounds to bf16 (a projection's output, the conv's, an activation's) is rounded here at the same
// place, so the two agree to float32 rounding in a float32 model and to bf16 rounding noise in a bf16 one.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "decode_common.h"
#include "linear.h"

// one linear layer's stored weight (ops/cpu_kernels.py's `Lin`): W [N, K] float32 (fmt 0) or bf16 (1), int8 with
// scale [N] (2), int4 repacked by q4_pack (3; K the padded K', G groups); bias float32 [N] or null. A stack of
// experts: expert e's W starts w_step bytes, its scales s_step floats after expert e - 1's.
struct Lin {
    int64_t fmt, N, K, G;
    const void* w;
    const float* scale;
    const float* zero;
    const float* bias;
    int64_t w_step, s_step;
};

static inline float rb(float v, int bf) { return bf ? bf2f(f2bf(v)) : v; }   // a bf16 model's rounding
static inline float sigm(float v) { return 1.f / (1.f + std::exp(-v)); }
static inline float silu(float v) { return v / (1.f + std::exp(-v)); }

// y [M, N] = x [M, K] Wᵀ (+ bias) of expert e (0 for a plain layer), rounded as the layer's output in a bf16 model
static void linear(const Lin& L, int64_t e, const float* x, int64_t M, int64_t K, float* y, int bf) {
    const char* w = (const char*)L.w + e * L.w_step;
    const float* s = L.scale ? L.scale + e * L.s_step : nullptr;
    switch (L.fmt) {
    case 0: mv_f32(x, M, K, (const float*)w, L.N, y); break;
    case 1: mv_bf16(x, M, K, (const uint16_t*)w, L.N, y); break;
    case 2: mv_int8(x, M, K, (const int8_t*)w, s, L.N, y); break;
    default: q4_linear(x, M, K, (const uint8_t*)w, L.N, L.K, L.G, y);   // (the padding columns count as zeros)
    }
    for (int64_t m = 0; m < M; m++)
        for (int64_t n = 0; n < L.N; n++) y[m * L.N + n] = rb(y[m * L.N + n] + (L.bias ? L.bias[n] : 0.f), bf);
}

template <typename T> static void load_rows(const void* x, int64_t n, float* out) {
    for (int64_t i = 0; i < n; i++) out[i] = ld((const T*)x, i);
}
static void load(const void* x, int64_t n, float* out, int bf) {
    bf ? load_rows<uint16_t>(x, n, out) : load_rows<float>(x, n, out);
}
static void store(const float* v, int64_t n, void* out, int bf) {
    for (int64_t i = 0; i < n; i++) bf ? st((uint16_t*)out, i, v[i]) : st((float*)out, i, v[i]);
}

// ShortConv's step (then the SiLU after it with `act`), in place on x [B, C]: the tail [B, W-1, C] (in the model's
// dtype) shifted; weight float32 [C, W] and bias [C] or null (the layer's, in the model's dtype first)
template <typename T>
static void conv(float* x, T* tail, const float* w, const float* bias, int64_t Bn, int64_t C, int64_t W, int act,
                 int bf) {
    for (int64_t b = 0; b < Bn; b++) {
        T* s = tail + b * (W - 1) * C;
        for (int64_t c = 0; c < C; c++) {
            const float xc = x[b * C + c];
            float acc = bias ? bias[c] : 0.f;
            for (int64_t j = 0; j < W - 1; j++) acc += w[c * W + j] * ld(s, j * C + c);
            acc += w[c * W + W - 1] * xc;
            for (int64_t j = 0; j + 1 < W - 1; j++) s[j * C + c] = s[(j + 1) * C + c];
            if (W > 1) st(s, (W - 2) * C + c, xc);
            x[b * C + c] = act ? rb(silu(rb(acc, bf)), bf) : rb(acc, bf);
        }
    }
}

static void conv(float* x, void* tail, const float* w, const float* bias, int64_t Bn, int64_t C, int64_t W, int act,
                 int bf) {
    bf ? conv(x, (uint16_t*)tail, w, bias, Bn, C, W, act, bf) : conv(x, (float*)tail, w, bias, Bn, C, W, act, bf);
}

// Gated DeltaNet (layers/gated_deltanet.py, letter G): x [B, d] -> y [B, d]. qkvz [B, hk (2 dk + 2 r dv)] and
// ba [B, 2 hv] in Qwen3-Next's per-key-head layout; conv + SiLU over [q | k | v]; the gated delta rule
// (dec_delta_gated) on `state` [B, hv, dk, dv]; RMSNorm(o) · weight · silu(z) per value head; out.
extern "C" void mix_gated_deltanet(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* qkvz,
                                   const Lin* ba, const float* conv_w, void* tail, int64_t W, const float* A_log,
                                   const float* dt_bias, const float* norm_w, float norm_eps, float* state,
                                   const Lin* out, int64_t hk, int64_t hv, int64_t dk, int64_t dv) {
    const int64_t r = hv / hk, per = 2 * dk + 2 * r * dv, C = 2 * hk * dk + hv * dv;
    std::vector<float> xf(Bn * d), t(Bn * hk * per), u(Bn * 2 * hv), qkv(Bn * C), z(Bn * hv * dv), bb(Bn * hv),
        aa(Bn * hv), o(Bn * hv * dv), yf(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    linear(*qkvz, 0, xf.data(), Bn, d, t.data(), bf);
    linear(*ba, 0, xf.data(), Bn, d, u.data(), bf);
    for (int64_t b = 0; b < Bn; b++)
        for (int64_t h = 0; h < hk; h++) {
            const float* src = t.data() + (b * hk + h) * per;
            float* row = qkv.data() + b * C;
            std::copy(src, src + dk, row + h * dk);
            std::copy(src + dk, src + 2 * dk, row + hk * dk + h * dk);
            std::copy(src + 2 * dk, src + 2 * dk + r * dv, row + 2 * hk * dk + h * r * dv);
            std::copy(src + 2 * dk + r * dv, src + per, z.data() + (b * hv + h * r) * dv);
            const float* g = u.data() + (b * hk + h) * 2 * r;
            std::copy(g, g + r, bb.data() + b * hv + h * r);
            std::copy(g + r, g + 2 * r, aa.data() + b * hv + h * r);
        }
    conv(qkv.data(), tail, conv_w, nullptr, Bn, C, W, 1, bf);
    dec_delta_gated(qkv.data(), bb.data(), aa.data(), A_log, dt_bias, 0, state, o.data(), Bn, hv, hk, dk, dv,
                    1.f / std::sqrt(float(dk)), 1e-6f);
    for (auto& v : o) v = rb(v, bf);
    dec_rms_norm(o.data(), nullptr, z.data(), norm_w, o.data(), Bn * hv, dv, dv, 2, norm_eps, 0);
    for (auto& v : o) v = rb(v, bf);
    linear(*out, 0, o.data(), Bn, hv * dv, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// KDA (layers/kda.py, letter K): x [B, d] -> y [B, d]. qkv [B, 3 H D] -> conv + SiLU; per-channel decay from
// f_b(f_a(x)), beta from b_proj(x); the delta rule on `state` [B, H, D, D]; per head
// RMSNorm(o) · weight · sigmoid(g_b(g_a(x))); o_proj
extern "C" void mix_kda(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* qkv_p, const float* conv_w,
                        void* tail, int64_t W, const Lin* f_a, const Lin* f_b, const Lin* b_proj, const float* A_log,
                        const float* dt_bias, const Lin* g_a, const Lin* g_b, const float* norm_w, float norm_eps,
                        float* state, const Lin* o_proj, int64_t H, int64_t D) {
    const int64_t rank = f_a->N;
    std::vector<float> xf(Bn * d), qkv(Bn * 3 * H * D), lo(Bn * rank), f(Bn * H * D), beta(Bn * H), g(Bn * H * D),
        o(Bn * H * D), yf(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    linear(*qkv_p, 0, xf.data(), Bn, d, qkv.data(), bf);
    conv(qkv.data(), tail, conv_w, nullptr, Bn, 3 * H * D, W, 1, bf);
    linear(*f_a, 0, xf.data(), Bn, d, lo.data(), bf);
    linear(*f_b, 0, lo.data(), Bn, rank, f.data(), bf);
    linear(*b_proj, 0, xf.data(), Bn, d, beta.data(), bf);
    dec_delta_gated(qkv.data(), beta.data(), f.data(), A_log, dt_bias, 1, state, o.data(), Bn, H, H, D, D,
                    1.f / std::sqrt(float(D)), 1e-6f);
    for (auto& v : o) v = rb(v, bf);
    linear(*g_a, 0, xf.data(), Bn, d, lo.data(), bf);
    linear(*g_b, 0, lo.data(), Bn, g_a->N, g.data(), bf);
    dec_rms_norm(o.data(), nullptr, g.data(), norm_w, o.data(), Bn * H, D, D, 3, norm_eps, 0);
    for (auto& v : o) v = rb(v, bf);
    linear(*o_proj, 0, o.data(), Bn, H * D, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// layers/mlp.ACTIVATIONS by number: silu, gelu, gelu_tanh, relu, relu2 (each rounded as its PyTorch op)
static float act(float v, int kind, int bf) {
    switch (kind) {
    case 0: return rb(silu(v), bf);
    case 1: return rb(0.5f * v * (1.f + std::erf(v * 0.70710678f)), bf);
    case 2: return rb(0.5f * v * (1.f + std::tanh(0.79788456f * (v + 0.044715f * v * v * v))), bf);
    case 3: return v > 0.f ? v : 0.f;
    default: { const float p = v > 0.f ? v : 0.f; return rb(p * p, bf); }
    }
}

// a gated (`gate` non-null: down(act(gate x) · up x)) or plain (down(act(up x))) MLP of expert e on M rows x [M, d]
// -> out [M, d]; h [M, f] and hg [M, f] are scratch
static void mlp(const Lin* gate, const Lin* up, const Lin* down, int64_t e, const float* x, int64_t M, int64_t d,
                int kind, float* h, float* hg, float* out, int bf) {
    const int64_t f = up->N;
    linear(*up, e, x, M, d, h, bf);
    if (gate) {
        linear(*gate, e, x, M, d, hg, bf);
        for (int64_t i = 0; i < M * f; i++) h[i] = rb(act(hg[i], kind, bf) * h[i], bf);
    } else {
        for (int64_t i = 0; i < M * f; i++) h[i] = act(h[i], kind, bf);
    }
    linear(*down, e, h, M, f, out, bf);
}

// layers/mlp.MLP on rows x [M, d] -> out [M, d]: w_in [(2) f, d] (holding [gate | up] when `gated`), the activation,
// w_out; h [M, w_in.N] is scratch
static void dense_mlp(const Lin& w_in, const Lin& w_out, int gated, int kind, const float* x, int64_t M, int64_t d,
                      float* h, float* out, int bf) {
    const int64_t n = w_in.N, f = gated ? n / 2 : n;
    linear(w_in, 0, x, M, d, h, bf);
    for (int64_t b = 0; b < M; b++) {
        float* hb = h + b * n;
        for (int64_t i = 0; i < f; i++) hb[i] = gated ? rb(act(hb[i], kind, bf) * hb[f + i], bf) : act(hb[i], kind, bf);
        if (f != n) std::memmove(h + b * f, hb, f * 4);         // rows of f, in place (row b lands at or before it)
    }
    linear(w_out, 0, h, M, f, out, bf);
}

// MLP (layers/mlp.py: letter M, the channel mixer of most presets): x [B, d] -> y [B, d] in one call
extern "C" void mix_mlp(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* w_in, const Lin* w_out,
                        int gated, int kind) {
    std::vector<float> xf(Bn * d), h(Bn * w_in->N), out(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    dense_mlp(*w_in, *w_out, gated, kind, xf.data(), Bn, d, h.data(), out.data(), bf);
    store(out.data(), Bn * d, y, bf);
}

// a group-limited choice (DeepSeek-V3): only the experts of the topk_group groups (of n_group) whose two best
// choice scores sum highest stay choosable; the rest of `choice` [E] becomes -inf (ops/moe.route_topk)
static void group_limit(float* choice, int64_t E, int64_t n_group, int64_t topk_group) {
    const int64_t per = E / n_group;
    std::vector<float> best(n_group);
    for (int64_t gi = 0; gi < n_group; gi++) {
        float a = -INFINITY, b = -INFINITY;                // the two largest of the group
        for (int64_t e = gi * per; e < (gi + 1) * per; e++) {
            const float c = choice[e];
            if (c > a) { b = a; a = c; } else if (c > b) b = c;
        }
        best[gi] = per > 1 ? a + b : a;
    }
    std::vector<int64_t> order(n_group);
    for (int64_t gi = 0; gi < n_group; gi++) order[gi] = gi;
    std::partial_sort(order.begin(), order.begin() + topk_group, order.end(), [&](int64_t i, int64_t j) {
        return best[i] > best[j] || (best[i] == best[j] && i < j);
    });
    std::vector<char> keep(n_group, 0);
    for (int64_t i = 0; i < topk_group; i++) keep[order[i]] = 1;
    for (int64_t e = 0; e < E; e++)
        if (!keep[e / per]) choice[e] = -INFINITY;
}

// Routed experts (layers/routed_moe.py, letter O's experts): x [B, d] -> y [B, d]. The router (`route` 1: softmax or
// sigmoid scores (`sigmoid`), plus `rbias` [E] to choose, group-limited when n_group > 1, the top k, renormalised
// (`norm_topk`), times `scale`); or the choice made by the caller (`route` 0: ids [B, k] int64, weights float32 [B, k]). Then only the k chosen
// experts' gated (gate non-null) or plain MLPs, Σ weight · expert(x) in float32; plus the shared expert (sh_in
// non-null: an MLP whose w_in holds [gate | up] when `sh_gated`) scaled by sigmoid(sh_gate x) when sh_gate is given.
extern "C" void mix_moe(const void* x, void* y, int64_t Bn, int64_t d, int bf, int route, const Lin* router,
                        const float* rbias, int sigmoid, int norm_topk, float scale, int64_t n_group,
                        int64_t topk_group, int64_t k, int64_t* ids,
                        float* weights, const Lin* gate, const Lin* up, const Lin* down, int kind, const Lin* sh_in,
                        const Lin* sh_out, int sh_gated, const Lin* sh_gate) {
    const int64_t E = route ? router->N : 0, f = up->N, sf = sh_in ? sh_in->N / (sh_gated ? 2 : 1) : 0;
    std::vector<float> xf(Bn * d), logits(Bn * E);
    load(x, Bn * d, xf.data(), bf);
    if (route) linear(*router, 0, xf.data(), Bn, d, logits.data(), bf);
    for (int64_t b = 0; b < Bn && route; b++) {
        int64_t* id = ids + b * k;
        float* w = weights + b * k;
        {
            const float* lg = logits.data() + b * E;
            std::vector<float> sc(E), choice(E);
            if (sigmoid) {
                for (int64_t e = 0; e < E; e++) sc[e] = sigm(lg[e]);
            } else {
                float mx = -INFINITY, sum = 0.f;
                for (int64_t e = 0; e < E; e++) mx = std::max(mx, lg[e]);
                for (int64_t e = 0; e < E; e++) sum += sc[e] = std::exp(lg[e] - mx);
                for (int64_t e = 0; e < E; e++) sc[e] /= sum;
            }
            for (int64_t e = 0; e < E; e++) choice[e] = sc[e] + (rbias ? rbias[e] : 0.f);
            if (n_group > 1) group_limit(choice.data(), E, n_group, topk_group);
            std::vector<int64_t> order(E);
            for (int64_t e = 0; e < E; e++) order[e] = e;
            std::partial_sort(order.begin(), order.begin() + k, order.end(), [&](int64_t i, int64_t j) {
                return choice[i] > choice[j] || (choice[i] == choice[j] && i < j);
            });
            float total = 0.f;
            for (int64_t i = 0; i < k; i++) { id[i] = order[i]; w[i] = sc[order[i]]; total += w[i]; }
            for (int64_t i = 0; i < k; i++) {
                if (norm_topk) w[i] = w[i] / (total + (sigmoid ? 1e-20f : 0.f));
                w[i] = rb(w[i] * scale, bf);
            }
        }
    }
    // each chosen expert once, on every row that chose it (its weights read once a step); pair (b, i)'s output kept
    // apart, then summed per row in slot order (as one row's step sums them)
    std::vector<int64_t> order(Bn * k);
    for (int64_t p = 0; p < Bn * k; p++) order[p] = p;
    std::stable_sort(order.begin(), order.end(), [ids](int64_t p, int64_t q) { return ids[p] < ids[q]; });
    std::vector<float> xe(Bn * d), h(Bn * std::max(f, 2 * sf)), hg(Bn * f), oe(Bn * d), outs(Bn * k * d);
    for (int64_t s0 = 0, s1; s0 < Bn * k; s0 = s1) {
        for (s1 = s0; s1 < Bn * k && ids[order[s1]] == ids[order[s0]]; s1++)
            std::copy(xf.data() + order[s1] / k * d, xf.data() + (order[s1] / k + 1) * d, xe.data() + (s1 - s0) * d);
        mlp(gate, up, down, ids[order[s0]], xe.data(), s1 - s0, d, kind, h.data(), hg.data(), oe.data(), bf);
        for (int64_t j = s0; j < s1; j++)
            std::copy(oe.data() + (j - s0) * d, oe.data() + (j - s0 + 1) * d, outs.data() + order[j] * d);
    }
    std::vector<float> acc(Bn * d, 0.f), s(Bn * d), gl(Bn);
    for (int64_t b = 0; b < Bn; b++)
        for (int64_t i = 0; i < k; i++)
            for (int64_t c = 0; c < d; c++) acc[b * d + c] += outs[(b * k + i) * d + c] * weights[b * k + i];
    for (auto& v : acc) v = rb(v, bf);
    if (sh_in) {                                     // the shared expert: all rows in one product
        dense_mlp(*sh_in, *sh_out, sh_gated, kind, xf.data(), Bn, d, h.data(), s.data(), bf);
        if (sh_gate) linear(*sh_gate, 0, xf.data(), Bn, d, gl.data(), bf);
        for (int64_t b = 0; b < Bn; b++) {
            const float g = sh_gate ? rb(sigm(gl[b]), bf) : 1.f;
            for (int64_t c = 0; c < d; c++)
                acc[b * d + c] = rb(acc[b * d + c] + (sh_gate ? rb(g * s[b * d + c], bf) : s[b * d + c]), bf);
        }
    }
    store(acc.data(), Bn * d, y, bf);
}

// RMSNorm of each of the n vectors of D channels of v (in place) with weight w [D], rounded as the norm's output
static void head_norm(float* v, int64_t n, int64_t D, const float* w, float eps, int bf) {
    for (int64_t i = 0; i < n; i++) {
        float* h = v + i * D;
        float ss = 0.f;
        for (int64_t c = 0; c < D; c++) ss += h[c] * h[c];
        const float inv = 1.f / std::sqrt(ss / float(D) + eps);
        for (int64_t c = 0; c < D; c++) h[c] = rb(h[c] * inv * w[c], bf);
    }
}

// RoPE on the first r channels of each of the n heads of D channels of v (in place): cos, sin [r/2] for this row;
// halves rotated (x1 c - x2 s, x1 s + x2 c), or neighbouring pairs when `interleaved` (ops/rope.apply_rope)
static void rope(float* v, int64_t n, int64_t D, int64_t r, const float* cs, const float* sn, int inter, int bf) {
    const int64_t h2 = r / 2;
    for (int64_t i = 0; i < n; i++) {
        float* h = v + i * D;
        for (int64_t j = 0; j < h2; j++) {
            float* a = inter ? h + 2 * j : h + j;
            float* b = inter ? h + 2 * j + 1 : h + j + h2;
            const float x1 = *a, x2 = *b;
            *a = rb(x1 * cs[j] - x2 * sn[j], bf);
            *b = rb(x1 * sn[j] + x2 * cs[j], bf);
        }
    }
}

// Attention (layers/attention.py, letters A and W) at decode: x [B, d] -> y [B, d]. qkv (rows: q [H D], or per head
// [query D | gate D] with `gated` (Qwen3-Next's output gate); then k [Hk D], v [Hv D]); the per-head q/k RMSNorm
// (qn, kn: weights [D], or null); RoPE on the first r channels (cos, sin [B, r/2]); row b's k and v written into the
// cache (kc, vc: buffers in the model's dtype, element strides of batch, time, head: ks*, vs*) at its own length
// pos[b] (slot pos[b] % W of a sliding window's ring, `ring` = W > 0); softmax(scale q kᵀ) v over row b's keys
// (dec_attention: tokens lo[b] (null: 0, else the first real token of a left-padded row) to pos[b]); · sigmoid(gate);
// out
extern "C" void mix_attention(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* qkv_p, const Lin* out,
                              int64_t H, int64_t Hk, int64_t Hv, int64_t D, int gated, const float* qn,
                              const float* kn, float eps, int64_t r, int inter, const float* cs, const float* sn,
                              void* kc, void* vc, int64_t ksb, int64_t kss, int64_t ksh, int64_t vsb, int64_t vss,
                              int64_t vsh, const int64_t* pos, const int64_t* lo, int64_t ring, float scale) {
    const int64_t nq = (1 + gated) * H * D, row = nq + (Hk + Hv) * D;
    std::vector<float> xf(Bn * d), t(Bn * row), q(Bn * H * D), g(gated ? Bn * H * D : 0), o(Bn * H * D), yf(Bn * d);
    std::vector<int64_t> len(Bn);
    load(x, Bn * d, xf.data(), bf);
    linear(*qkv_p, 0, xf.data(), Bn, d, t.data(), bf);
    for (int64_t b = 0; b < Bn; b++) {
        float* tb = t.data() + b * row;
        float* qb = q.data() + b * H * D;
        for (int64_t h = 0; h < H; h++) {
            const float* src = tb + h * (1 + gated) * D;
            std::copy(src, src + D, qb + h * D);
            if (gated) std::copy(src + D, src + 2 * D, g.data() + (b * H + h) * D);
        }
        float* kb = tb + nq;
        if (qn) { head_norm(qb, H, D, qn, eps, bf); head_norm(kb, Hk, D, kn, eps, bf); }
        if (r) {
            rope(qb, H, D, r, cs + b * r / 2, sn + b * r / 2, inter, bf);
            rope(kb, Hk, D, r, cs + b * r / 2, sn + b * r / 2, inter, bf);
        }
        const int64_t es = bf ? 2 : 4, at = ring ? pos[b] % ring : pos[b];     // the cache's element size, the slot
        for (int64_t h = 0; h < Hk; h++) store(kb + h * D, D, (char*)kc + (b * ksb + at * kss + h * ksh) * es, bf);
        for (int64_t h = 0; h < Hv; h++)
            store(kb + (Hk + h) * D, D, (char*)vc + (b * vsb + at * vss + h * vsh) * es, bf);
        len[b] = pos[b] + 1;
    }
    std::vector<uint16_t> qh(bf ? Bn * H * D : 0), oh(bf ? Bn * H * D : 0);   // q and o in the cache's dtype
    if (bf) store(q.data(), Bn * H * D, qh.data(), 1);
    dec_attention(bf ? (void*)qh.data() : (void*)q.data(), kc, vc, bf ? (void*)oh.data() : (void*)o.data(), Bn, H, Hk,
                  Hv, D, D, ksb, kss, ksh, vsb, vss, vsh, lo, len.data(), ring, scale, bf);
    if (bf) load(oh.data(), Bn * H * D, o.data(), 1);
    if (gated)
        for (int64_t i = 0; i < Bn * H * D; i++) o[i] = rb(o[i] * rb(sigm(g[i]), bf), bf);
    linear(*out, 0, o.data(), Bn, H * D, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// MLA (layers/mla.py, letter L) at decode, absorbed (the layer's own decode path): x [B, d] -> y [B, d]. The query
// q_b(RMSNorm(q_a x)) (q_a null: q_proj x, passed as q_b) [H, nope + rope]; [c | k_rope] = kv_a x, c RMSNorm'd
// (kv_norm [R]); RoPE (`rotate`) on each head's rope part and on k_rope; [c | k_rope] written into the latent cache
// (kc: [B, S, R + rope] in the model's dtype, element strides ksb, kss) at row b's own length pos[b]; W_uk folded
// into the query (kv_b's weight wkv [H, nope + v, R], float32 or bf16 (`wbf`)), softmax over the one shared head
// [c | k_rope] with values c (dec_attention: tokens lo[b] to pos[b]), W_uv folded into the output; out
extern "C" void mix_mla(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* q_a, const float* qn_w,
                        const Lin* q_b, const Lin* kv_a, const float* kvn_w, float eps, const void* wkv, int wbf,
                        const Lin* out, int64_t H, int64_t R, int64_t nope, int64_t rdim, int64_t vdim, int rotate,
                        int inter, const float* cs, const float* sn, void* kc, int64_t ksb, int64_t kss,
                        const int64_t* pos, const int64_t* lo, float scale) {
    const int64_t dq = nope + rdim, L = R + rdim, rank = q_a ? q_a->N : 0;
    std::vector<float> xf(Bn * d), ql(Bn * rank), q(Bn * H * dq), kv(Bn * L), qf(Bn * H * L), ol(Bn * H * R),
        o(Bn * H * vdim), yf(Bn * d);
    std::vector<int64_t> len(Bn);
    std::vector<float> wr(R);
    auto w = [&](int64_t row) {                           // row `row` of kv_b's weight, in float32
        wbf ? load_rows<uint16_t>((const uint16_t*)wkv + row * R, R, wr.data())
            : load_rows<float>((const float*)wkv + row * R, R, wr.data());
        return wr.data();
    };
    load(x, Bn * d, xf.data(), bf);
    if (q_a) {
        linear(*q_a, 0, xf.data(), Bn, d, ql.data(), bf);
        head_norm(ql.data(), Bn, rank, qn_w, eps, bf);
        linear(*q_b, 0, ql.data(), Bn, rank, q.data(), bf);
    } else {
        linear(*q_b, 0, xf.data(), Bn, d, q.data(), bf);
    }
    linear(*kv_a, 0, xf.data(), Bn, d, kv.data(), bf);
    const int64_t es = bf ? 2 : 4;
    for (int64_t b = 0; b < Bn; b++) {
        float* qb = q.data() + b * H * dq;
        float* kb = kv.data() + b * L;
        head_norm(kb, 1, R, kvn_w, eps, bf);
        if (rotate) {
            rope(qb + nope, H, dq, rdim, cs + b * rdim / 2, sn + b * rdim / 2, inter, bf);
            rope(kb + R, 1, L, rdim, cs + b * rdim / 2, sn + b * rdim / 2, inter, bf);
        }
        store(kb, L, (char*)kc + (b * ksb + pos[b] * kss) * es, bf);
        len[b] = pos[b] + 1;
        for (int64_t h = 0; h < H; h++) {                  // q_lat = W_ukᵀ q_nope, then the roped part
            float* qh = qf.data() + (b * H + h) * L;
            std::fill(qh, qh + R, 0.f);
            for (int64_t n = 0; n < nope; n++) {
                const float c = qb[h * dq + n], *wn = w(h * (nope + vdim) + n);
                for (int64_t r = 0; r < R; r++) qh[r] += c * wn[r];
            }
            for (int64_t r = 0; r < R; r++) qh[r] = rb(qh[r], bf);
            std::copy(qb + h * dq + nope, qb + (h + 1) * dq, qh + R);
        }
    }
    std::vector<uint16_t> qh(bf ? Bn * H * L : 0), oh(bf ? Bn * H * R : 0);    // q and o in the cache's dtype
    if (bf) store(qf.data(), Bn * H * L, qh.data(), 1);
    dec_attention(bf ? (void*)qh.data() : (void*)qf.data(), kc, kc, bf ? (void*)oh.data() : (void*)ol.data(), Bn, H,
                  1, 1, L, R, ksb, kss, 0, ksb, kss, 0, lo, len.data(), 0, scale, bf);
    if (bf) load(oh.data(), Bn * H * R, ol.data(), 1);
    for (int64_t b = 0; b < Bn; b++)                       // o = W_uv o_lat per head
        for (int64_t h = 0; h < H; h++) {
            const float* a = ol.data() + (b * H + h) * R;
            for (int64_t j = 0; j < vdim; j++) {
                const float* wj = w(h * (nope + vdim) + nope + j);
                float s = 0.f;
                for (int64_t r = 0; r < R; r++) s += a[r] * wj[r];
                o[(b * H + h) * vdim + j] = rb(s, bf);
            }
        }
    linear(*out, 0, o.data(), Bn, H * vdim, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// Mamba-2 (layers/mamba2.py, letter S): x [B, d] -> y [B, d]. in_proj -> [z (di) | xBC (di + 2 g n) | dt (h)];
// conv (+ bias) + SiLU over xBC; dt, A, the SSD update of `state` [B, h, p, n] and the D skip (dec_ssd_gated);
// then the gate: y · silu(z) (`norm` 0), RMSNorm(y · silu(z)) · weight (1) or RMSNorm(y) · weight · silu(z) (2),
// the norm per group of di / g channels; out_proj
extern "C" void mix_mamba2(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* in_proj,
                           const float* conv_w, const float* conv_b, void* tail, int64_t W, const float* dt_bias,
                           const float* A_log, const float* D, float lo, float hi, int norm, const float* norm_w,
                           float eps, float* state, const Lin* out, int64_t h, int64_t p, int64_t g, int64_t n) {
    const int64_t di = h * p, C = di + 2 * g * n, row = di + C + h;
    std::vector<float> xf(Bn * d), t(Bn * row), xbc(Bn * C), z(Bn * di), dt(Bn * h), xs(Bn * di), Bm(Bn * g * n),
        Cm(Bn * g * n), o(Bn * di), yf(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    linear(*in_proj, 0, xf.data(), Bn, d, t.data(), bf);
    for (int64_t b = 0; b < Bn; b++) {
        const float* tb = t.data() + b * row;
        std::copy(tb, tb + di, z.data() + b * di);
        std::copy(tb + di, tb + di + C, xbc.data() + b * C);
        std::copy(tb + di + C, tb + row, dt.data() + b * h);
    }
    conv(xbc.data(), tail, conv_w, conv_b, Bn, C, W, 1, bf);
    for (int64_t b = 0; b < Bn; b++) {
        const float* r = xbc.data() + b * C;
        std::copy(r, r + di, xs.data() + b * di);
        std::copy(r + di, r + di + g * n, Bm.data() + b * g * n);
        std::copy(r + di + g * n, r + C, Cm.data() + b * g * n);
    }
    dec_ssd_gated(xs.data(), dt.data(), dt_bias, A_log, D, lo, hi, Bm.data(), Cm.data(), state, o.data(), Bn, h, p,
                  g, n);
    for (auto& v : o) v = rb(v, bf);
    if (norm == 0)
        for (int64_t i = 0; i < Bn * di; i++) o[i] = rb(o[i] * silu(z[i]), bf);
    else {
        dec_rms_norm(o.data(), nullptr, z.data(), norm_w, o.data(), Bn, di, di / g, norm, eps, 0);
        for (auto& v : o) v = rb(v, bf);
    }
    linear(*out, 0, o.data(), Bn, di, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// LFM2's gated short conv (layers/gated_conv.py, letter C): x [B, d] -> y [B, d] = out_proj(c · conv(b · h)),
// [b | c | h] = in_proj(x); the conv's tail [B, W-1, d] shifted in place
extern "C" void mix_gated_conv(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* in_proj,
                               const float* conv_w, const float* conv_b, void* tail, int64_t W, const Lin* out) {
    std::vector<float> xf(Bn * d), t(Bn * 3 * d), u(Bn * d), yf(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    linear(*in_proj, 0, xf.data(), Bn, d, t.data(), bf);
    for (int64_t b = 0; b < Bn; b++)
        for (int64_t c = 0; c < d; c++) u[b * d + c] = rb(t[b * 3 * d + c] * t[b * 3 * d + 2 * d + c], bf);
    conv(u.data(), tail, conv_w, conv_b, Bn, d, W, 0, bf);
    for (int64_t b = 0; b < Bn; b++)
        for (int64_t c = 0; c < d; c++) u[b * d + c] = rb(t[b * 3 * d + d + c] * u[b * d + c], bf);
    linear(*out, 0, u.data(), Bn, d, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}

// Rodimus (layers/rodimus.py, letter R) without the product decay: x [B, d] -> y [B, d]. [xi | z] = fc(x); x' =
// silu(conv(xi)); [q | k] = qk_proj(x'); raw = gate_proj(x') (null: no g and no τ); g = softplus(raw[:n] + g_bias)
// (`use_g`; else softplus(g_bias)), τ = sigmoid(raw[-n:] + tau_bias) (tau_bias null: τ = 1); log α = -g τ, the key
// k / max(|k|, 1e-12) · g^τ; the value u = sigmoid(beta_up(beta_down(xi))) · xi (beta_down null: xi); the GLA step
// of `state` [B, 1, n, m]; o + x' · residual_weight; RMSNorm(o · silu(z)) · norm_weight; out_proj
extern "C" void mix_rodimus(const void* x, void* y, int64_t Bn, int64_t d, int bf, const Lin* fc,
                            const float* conv_w, const float* conv_b, void* tail, int64_t W, const Lin* qk_proj,
                            const Lin* gate_proj, int use_g, const float* g_bias, const float* tau_bias,
                            const Lin* beta_down, const Lin* beta_up, const float* res_w, const float* norm_w,
                            float eps, float* state, const Lin* out, int64_t m, int64_t n) {
    const int64_t ng = gate_proj ? gate_proj->N : 0, rank = beta_down ? beta_down->N : 0;
    std::vector<float> xf(Bn * d), t(Bn * 2 * m), xi(Bn * m), z(Bn * m), xc(Bn * m), qk(Bn * 2 * n), raw(Bn * ng),
        q(Bn * n), k(Bn * n), la(Bn * n), u(Bn * m), lo(Bn * rank), logit(Bn * m), o(Bn * m), yf(Bn * d);
    load(x, Bn * d, xf.data(), bf);
    linear(*fc, 0, xf.data(), Bn, d, t.data(), bf);
    for (int64_t b = 0; b < Bn; b++) {
        std::copy(t.begin() + b * 2 * m, t.begin() + b * 2 * m + m, xi.begin() + b * m);
        std::copy(t.begin() + b * 2 * m + m, t.begin() + (b + 1) * 2 * m, z.begin() + b * m);
    }
    xc = xi;
    conv(xc.data(), tail, conv_w, conv_b, Bn, m, W, 1, bf);
    linear(*qk_proj, 0, xc.data(), Bn, m, qk.data(), bf);
    if (gate_proj) linear(*gate_proj, 0, xc.data(), Bn, m, raw.data(), bf);
    if (beta_down) {
        linear(*beta_down, 0, xi.data(), Bn, m, lo.data(), bf);
        linear(*beta_up, 0, lo.data(), Bn, rank, logit.data(), bf);
        for (int64_t i = 0; i < Bn * m; i++) u[i] = rb(rb(sigm(logit[i]), bf) * xi[i], bf);
    } else {
        u = xi;
    }
    for (int64_t b = 0; b < Bn; b++) {
        const float* kr = qk.data() + b * 2 * n + n;
        float ss = 0.f;
        for (int64_t i = 0; i < n; i++) ss += kr[i] * kr[i];
        const float inv = 1.f / std::max(std::sqrt(ss), 1e-12f);
        for (int64_t i = 0; i < n; i++) {
            const float g = softplus((use_g ? raw[b * ng + i] : 0.f) + g_bias[i]);
            const float tau = tau_bias ? sigm(raw[b * ng + ng - n + i] + tau_bias[i]) : 1.f;
            la[b * n + i] = -g * tau;
            const float gate = tau_bias ? std::pow(std::max(g, 1.17549435e-38f), tau) : g;
            k[b * n + i] = kr[i] * inv * gate;
            q[b * n + i] = qk[b * 2 * n + i];
        }
    }
    dec_gla_step(q.data(), k.data(), u.data(), la.data(), state, o.data(), Bn, 1, n, m, 1.f / std::sqrt(float(n)));
    for (int64_t i = 0; i < Bn * m; i++)
        o[i] = rb(rb(o[i], bf) + rb(xc[i] * rb(res_w[i % m], bf), bf), bf);
    dec_rms_norm(o.data(), nullptr, z.data(), norm_w, o.data(), Bn, m, m, 1, eps, 0);
    for (auto& v : o) v = rb(v, bf);
    linear(*out, 0, o.data(), Bn, m, yf.data(), bf);
    store(yf.data(), Bn * d, y, bf);
}
