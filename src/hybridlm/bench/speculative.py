"""`hybridlm bench --suite speculative`: batch-1 greedy decoding with and without speculative decoding, tokens/s,
on a prompt that repeats itself ("rewrite this file with one change", the file a module of the Python standard
library), for the 1.1B Llama (TinyLlama's shape) and a hybrid.

A random-weight model does not copy its prompt, so prompt lookup is rarely accepted on it. The suite therefore
measures what acceptance buys separately from how often a drafter earns it: `forced r/K` runs the real check loop
(the model's forward over K + 1 tokens, rollback, replay) with a drafter that proposes the model's own greedy
continuation (known from the plain run) with r of every K drafts right and the rest wrong, so each check keeps
exactly r. Each row gives tokens/s, the speed-up over plain decoding, the tokens per check and the cost of a check
in plain steps; speed-up = tokens per check / check cost. The `ngram:K` row is the real prompt-lookup run on the
same model; on a trained model (`--checkpoint RUN`) it shows the acceptance a copying model gives.
"""
import os

import torch

from .measure import clock, median

# TinyLlama-1.1B's shape (the model the llama.cpp and serve benches use)
TINYLLAMA = dict(d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_hidden=5632, vocab_size=32000)
TASK = ("Rewrite this Python file with one change: rename the class TextWrapper to LineWrapper. Output the whole "
        "file.\n\n")


def code_prompt(tokenize, n_tokens: int) -> list[int]:
    """The task line and the start of textwrap.py (standard library), `n_tokens` tokens."""
    import textwrap
    with open(textwrap.__file__) as f:
        src = f.read()
    ids = tokenize(TASK + src)
    return ids[:n_tokens]


class ForcedDrafter:
    """Proposes the continuation `reference` (prompt + the model's greedy output) with `right` of each K drafts
    correct and the rest off by one id, so every check keeps exactly `right` drafts (greedy speculative decoding
    reproduces the greedy output, so what it has generated is always a prefix of `reference`)."""

    def __init__(self, reference: list[int], k: int, right: int, vocab: int):
        self.reference, self.k, self.right, self.vocab = reference, k, right, vocab

    def propose(self, tokens: list[int], k: int) -> list[int]:
        ref = self.reference[len(tokens):len(tokens) + k]
        return ref[:self.right] + [(t + 1) % self.vocab for t in ref[self.right:]]


def _model(spec: str, context: int, vocab: int, dtype):
    """(name, model, tokenize) for "llama" (TinyLlama's shape), "PRESET:PARAMS" (random weights, the prompt's bytes
    as ids) or a checkpoint directory (a trained model and its tokenizer)."""
    from ..models import CausalLM, presets
    from ..models.sizing import fit_params, parse_count
    if os.path.isdir(spec):
        from ..train import load_pretrained
        model, tok = load_pretrained(spec)
        return os.path.basename(os.path.normpath(spec)), model.eval().to(dtype), tok.encode
    preset, _, params = spec.partition(":")
    over = dict(max_seq_len=context, vocab_size=vocab)
    if preset == "llama" and not params:
        cfg = presets.get("llama", **{**TINYLLAMA, **over})
    else:
        cfg, _ = fit_params(lambda d: presets.get(preset, **over, d_model=d), parse_count(params or "125M"),
                            range(64, 16385, 64), tolerance=0.5, what="d_model")
    torch.manual_seed(0)
    return spec, CausalLM(cfg).eval().to(dtype), lambda text: [b % vocab for b in text.encode()]


def speculative_suite(s: dict, log=print) -> dict:
    """Settings (registry.py): models, prompt_tokens, new_tokens, k, repeats, vocab, dtype."""
    from ..dtypes import resolve_dtype
    from ..errors import ConfigError
    from ..models.speculative import NgramDrafter, SpecStats, decode
    if s["k"] < 1 or s["new_tokens"] < 2 or s["prompt_tokens"] < 8:
        raise ConfigError("--k must be >= 1, --new-tokens >= 2 and --prompt-tokens >= 8")
    dtype = getattr(torch, resolve_dtype(s["dtype"], "cpu")[0])
    K, new = s["k"], s["new_tokens"]
    out = {"settings": {k: s[k] for k in ("models", "prompt_tokens", "new_tokens", "k", "repeats", "dtype")},
           "models": {}}
    for spec in s["models"].split(","):
        name, model, tokenize = _model(spec, s["prompt_tokens"] + new + K + 8, s["vocab"], dtype)
        vocab = model.config.vocab_size
        ids = torch.tensor([code_prompt(tokenize, s["prompt_tokens"])])
        with torch.inference_mode():
            ref = model.generate(ids, new, temperature=0)[0].tolist()
        drafters = {f"ngram:{K}": NgramDrafter(K)}
        for right in sorted({0, K // 2, K}):
            drafters[f"forced {right}/{K}"] = ForcedDrafter(ref, K, right, vocab)
        stats = {n: SpecStats() for n in drafters}

        def run(d, st):
            def f():
                with torch.inference_mode():
                    got = [t for toks in decode(model, ids, new, d, temperature=0, stats=st) for t in toks]
                assert torch.cat(got).tolist() == ref[ids.shape[1]:], "speculative output differs from greedy"
            return f
        fns = {"plain": lambda: model.generate(ids, new, temperature=0)}
        fns.update({n: run(d, stats[n]) for n, d in drafters.items()})
        times = clock(fns, repeats=s["repeats"], warmup=1)
        plain = median(times["plain"])
        rows = {"plain": {"tokens_per_s": round(new / plain, 2)}}
        log(f"{name:<28} plain          {new / plain:8.2f} tok/s")
        for n in drafters:
            t, st = median(times[n]), stats[n]
            runs = s["repeats"] + 1
            checks = st.checks / runs
            row = {"tokens_per_s": round(new / t, 2), "speedup": round(plain / t, 3),
                   "tokens_per_check": round(st.tokens_per_check, 3), "acceptance": round(st.acceptance, 3),
                   "checks": round(checks, 1),
                   # forced rows check at every step; a lookup that finds nothing runs plain steps in between
                   "check_cost_in_plain_steps": round((t / checks) / (plain / new), 3)
                   if checks and n.startswith("forced") else None}
            rows[n] = row
            log(f"{name:<28} {n:<14} {row['tokens_per_s']:8.2f} tok/s  {row['speedup']:.2f}x  "
                f"{row['tokens_per_check']:.2f} tokens/check  acceptance {row['acceptance']:.2f}  "
                f"check = {row['check_cost_in_plain_steps']} plain steps")
        out["models"][name] = {"parameters": model.num_parameters(), "layout": model.config.layout, "rows": rows}
    out["markdown"] = _table(out)
    return out


def _table(res: dict) -> str:
    lines = ["| model | decoding | tok/s | speed-up | tokens/check | acceptance | check cost (plain steps) |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for name, m in res["models"].items():
        for case, r in m["rows"].items():
            lines.append(f"| {name} | {case} | {r['tokens_per_s']} | {r.get('speedup', 1.0)} | "
                         f"{r.get('tokens_per_check', 1.0)} | {r.get('acceptance', '')} | "
                         f"{r.get('check_cost_in_plain_steps', 1.0)} |")
    return "\n".join(lines) + "\n"
