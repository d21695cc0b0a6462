"""Wonderful Matrices speed checks (issue 3), CPU forward+backward, interleaved in one run:

* `bench_cdmoe_layer` - our CDMoE layer (layers/cdmoe.py, Doge form: 16384 experts, 64 per token, d_model 256)
  against a gated MLP with the same active parameter count (target: CDMoE >= 0.5x the MLP's tokens/s).
* `bench_doge_vs_hf` - the `doge` preset's model against transformers' DogeForCausalLM with is_moe=True, same
  config and weights (converted by hybridlm.hf.from_transformers) (target: ours >= 2x).

    hybridlm bench --suite wm [--quick]          python -m hybridlm.bench.wm_speed [--quick]
"""
import math
import sys

import torch

from . import throughput as tp
from ..layers.cdmoe import CDMoE
from ..layers.init import initialised
from ..layers.mlp import MLP
from ..ops.moe import expert_neurons


def bench_cdmoe_layer(d_model: int = 256, num_experts: int = 16384, top_k: int = 64, shared_hidden: int | None = None,
                      tokens: int = 2048, repeats: int = 5, breakdown: bool = False) -> dict:
    """tokens/s of CDMoE vs gated MLPs with the same active parameter count on x [tokens, d_model], forward +
    backward. Active parameters: CDMoE 3·d·shared_hidden + 2·d·top_k (+ the router's 2·√N·d, which every
    token also multiplies); MLP 3·d·hidden. `ratio` compares with the MLP matching the count without the
    router (the stricter figure), `ratio_router_counted` with the one matching every weight a token uses,
    router included (how MoE "activated parameters" are usually counted).
    `breakdown` also times the layer's parts in the same interleaved rounds (medians, ms): the shared MLP,
    the routing (router, product-key top-k, softmax gates) and the expert neurons (on fixed ids and gates)."""
    shared_hidden = shared_hidden or 2 * d_model               # Doge's intermediate_size = 2 × hidden_size
    active = 3 * d_model * shared_hidden + 2 * d_model * top_k
    router = 2 * math.isqrt(num_experts) * d_model
    hidden, hidden_r = round(active / (3 * d_model)), round((active + router) / (3 * d_model))
    torch.manual_seed(0)
    moe = initialised(CDMoE(d_model, shared_hidden, num_experts=num_experts, top_k=top_k, form="doge"))
    for emb in (moe.down_embed, moe.up_embed):
        torch.nn.init.normal_(emb.weight, std=0.02)
    mlp, mlp_r = MLP(d_model, hidden), MLP(d_model, hidden_r)
    x = torch.randn(1, tokens, d_model, requires_grad=True)
    gy = torch.randn(1, tokens, d_model)
    xf, gyf = x.view(tokens, d_model), gy.view(tokens, d_model)
    with torch.no_grad():                                      # fixed routing for timing the experts alone
        scores, ids = moe.retrieve(xf)
        gates = torch.softmax(scores.float(), dim=-1).flatten(1).requires_grad_()

    def step(module, fn=None):
        leaves = list(module.parameters())
        fn = fn or (lambda: module(x).backward(gy))

        def run():
            fn()
            for p in leaves + [x, gates]:
                p.grad = None
        return run

    fns = {"cdmoe": step(moe), "mlp": step(mlp), "mlp_r": step(mlp_r)}
    if breakdown:
        g_gates = torch.randn_like(gates)
        fns["shared"] = step(moe, lambda: moe.shared(xf).backward(gyf))
        fns["routing"] = step(moe, lambda: torch.softmax(moe.retrieve(xf)[0].float(), -1).flatten(1).backward(g_gates))
        fns["experts"] = step(moe, lambda: expert_neurons(xf, moe.down_embed.weight, moe.up_embed.weight, ids.flatten(1),
                                                          gates, act=moe.act).backward(gyf))
    times = tp.interleaved(fns, repeats)
    c, m, mr = (tp.summary(times[n], tokens)["per_s"] for n in ("cdmoe", "mlp", "mlp_r"))
    out = dict(d_model=d_model, num_experts=num_experts, top_k=top_k, tokens=tokens, shared_hidden=shared_hidden,
               active_params_cdmoe=active, router_params=router, mlp_hidden=hidden, mlp_hidden_router_counted=hidden_r,
               cdmoe_tokens_per_s=c, mlp_tokens_per_s=m, mlp_router_counted_tokens_per_s=mr, ratio=c / m,
               ratio_router_counted=c / mr, target=0.5, met=c / m >= 0.5, threads=torch.get_num_threads())
    if breakdown:
        out.update({f"{n}_ms": tp.median(times[n]) * 1e3 for n in fns})
    return out


def bench_doge_vs_hf(d_model: int = 256, n_layers: int = 4, vocab_size: int = 8192, batch: int = 4, seq_len: int = 512,
                     num_experts: int = 16384, top_k: int = 64, n_heads: int = 4, repeats: int = 3) -> dict:
    """Training-step tokens/s (forward with labels + backward) of ours vs transformers' Doge with CDMoE.
    Both are built at the same config with the same weights; their CDMoE routing differs only by
    transformers' token-mixing view (REFERENCES.md), which does not change the work done."""
    import transformers

    from ..hf import from_transformers
    hcfg = transformers.DogeConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=2 * d_model,
                                   num_hidden_layers=n_layers, num_attention_heads=n_heads,
                                   max_position_embeddings=max(2048, seq_len), is_moe=True,
                                   num_experts=num_experts, num_experts_per_tok=top_k, pad_token_id=None,
                                   bos_token_id=None, eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.DogeForCausalLM(hcfg).train()
    ours = from_transformers(hf).train()
    ids = torch.randint(0, vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    times = tp.interleaved({"ours": tp.train_step(ours, ids), "hf": tp.train_step(hf, ids)}, repeats)
    o, h = tp.summary(times["ours"], batch * seq_len), tp.summary(times["hf"], batch * seq_len)
    return dict(d_model=d_model, n_layers=n_layers, vocab_size=vocab_size, batch=batch, seq_len=seq_len,
                num_experts=num_experts, top_k=top_k, n_heads=n_heads, parameters=ours.num_parameters(),
                ours_tokens_per_s=o["per_s"], hf_tokens_per_s=h["per_s"], ratio=o["per_s"] / h["per_s"],
                attn_implementation=hf.config._attn_implementation, target=2.0, met=o["per_s"] / h["per_s"] >= 2.0,
                threads=torch.get_num_threads())


def run_suite(quick: bool = False, log=print) -> dict:
    """Both measurements; `quick` shrinks them to a smoke test of a few seconds."""
    if quick:
        cd = bench_cdmoe_layer(d_model=64, num_experts=1024, top_k=16, tokens=256, repeats=2)
        dg = bench_doge_vs_hf(d_model=64, n_layers=2, vocab_size=512, batch=2, seq_len=64, num_experts=1024,
                              top_k=16, repeats=2)
    else:
        cd = bench_cdmoe_layer()
        dg = bench_doge_vs_hf()
        from .. import presets
        width = presets.get("doge", d_model=256).mlp_hidden_size            # the doge preset's shared MLP
        cw = bench_cdmoe_layer(shared_hidden=width)
        log(f"CDMoE with the doge preset's shared width {width}: ratio {cw['ratio']:.2f} "
            f"(router counted: {cw['ratio_router_counted']:.2f})")
    log(f"CDMoE {cd['num_experts']} experts, {cd['top_k']}/token, d_model {cd['d_model']}, {cd['tokens']} tokens: "
        f"{cd['cdmoe_tokens_per_s']:.0f} tok/s vs gated MLP (hidden {cd['mlp_hidden']}, same active params) "
        f"{cd['mlp_tokens_per_s']:.0f} tok/s: ratio {cd['ratio']:.2f} "
        f"(target >= 0.5: {'met' if cd['met'] else 'MISSED'}); "
        f"router counted as active (MLP hidden {cd['mlp_hidden_router_counted']}): {cd['ratio_router_counted']:.2f}")
    log(f"doge vs transformers DogeForCausalLM (is_moe, {dg['attn_implementation']}), d_model {dg['d_model']}, "
        f"{dg['n_layers']} layers, {dg['batch']}x{dg['seq_len']}: ours {dg['ours_tokens_per_s']:.0f} tok/s, "
        f"hf {dg['hf_tokens_per_s']:.0f} tok/s: ratio {dg['ratio']:.2f} "
        f"(target >= 2: {'met' if dg['met'] else 'MISSED'})")
    out = {"cdmoe_vs_mlp": cd, "doge_vs_hf": dg}
    if not quick:
        out["cdmoe_vs_mlp_doge_width"] = cw
    return out


if __name__ == "__main__":
    import json
    print(json.dumps(run_suite(quick="--quick" in sys.argv), indent=2))
