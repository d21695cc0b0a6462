"""`hybridlm demo`: train a small SSD/attention hybrid on Python sources in a few minutes, then sample."""
import json
import os
import time

from .common import count, out
from .generate import stream_text

DEMO_PROMPT = "def _check_arg(self, name, value):\n"


def _calibrate(cfg, tcfg, data) -> tuple[int, float]:
    """(CPU threads, seconds per training step): times a few steps with torch's default thread count and
    with one thread, keeping the faster (one thread wins by far on an oversubscribed machine)."""
    import torch
    from ..data.loader import batch_generator
    from ..models import CausalLM
    from ..optim import make_optimizer
    model = CausalLM(cfg)
    opt = make_optimizer(model, tcfg.lr)
    ids, resets = data.get_batch("train", tcfg.batch_size, tcfg.seq_len, batch_generator(12345, 0))
    best = None
    for n in sorted({torch.get_num_threads(), 1}, reverse=True):
        torch.set_num_threads(n)
        times = []
        for _ in range(5):
            t = time.perf_counter()
            model(ids, labels=ids, resets=resets).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            times.append(time.perf_counter() - t)
        if best is None or min(times[2:]) < best[1]:  # after two warm-up steps
            best = (n, min(times[2:]))
    torch.set_num_threads(best[0])
    return best


def main(args) -> int:
    from ..models import presets
    from ..data.corpus import load_corpus
    from ..data.loader import TokenData
    from ..data.tokenizer import ByteTokenizer
    from ..models.sizing import count_parameters
    from ..train import TrainConfig, load_pretrained, train
    t0 = time.perf_counter()
    tok = ByteTokenizer()
    corpus = load_corpus(None, max_bytes=args.max_bytes)
    data = TokenData.from_corpus(corpus, tok)
    cfg = presets.get("mamba2-attention", n_layers=4, d_model=256, vocab_size=tok.vocab_size,
                      max_seq_len=1024, ssd_d_state=32, ssd_headdim=32, n_heads=4)
    out(f"hybridlm demo: a {count(count_parameters(cfg))}-parameter Mamba-2 + attention hybrid, "
         f"layout {cfg.layout!r} (S = SSD/Mamba-2 block, A = attention), d_model {cfg.d_model}")
    out(f"data: {corpus.nbytes / 1e6:.1f} MB of this Python's standard library sources, byte-level "
         f"({len(data.tokens('train')):,} train / {len(data.tokens('val')):,} validation tokens)")
    steps = args.steps
    base = dict(batch_size=16, seq_len=128, lr=3e-3, min_lr=3e-4, warmup=20, eval_tokens=50_000, save_every=0,
                log_every=5, seed=args.seed)
    if steps is None:  # fit the run to the time budget on this machine
        threads, sps = _calibrate(cfg, TrainConfig(steps=1, **base), data)
        left = args.minutes * 60 - (time.perf_counter() - t0) - 15  # keep ~15 s for the sample
        steps = max(100, int(left / (1.1 * sps)) // 20 * 20)
        out(f"measured {sps:.2f} s per step with {threads} thread(s) -> {steps} steps for a ~{args.minutes:g} "
             f"minute demo (set --steps to choose)")
    tcfg = TrainConfig(steps=steps, eval_every=max(1, -(-steps // 4)), **base)
    out(f"training {steps} steps of {tcfg.batch_size}x{tcfg.seq_len} bytes into {args.out}/ ...\n")
    s = train(cfg, tcfg, data, args.out, progress=not args.no_progress)
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    out(f"{'step':>6}  {'train loss':>10}  {'val loss':>9}  {'val ppl':>8}")
    for r in rows:
        if r["step"] == 1 or r["val_loss"] is not None:
            v = f"{r['val_loss']:>9.4f}  {r['val_ppl']:>8.2f}" if r["val_loss"] is not None else f"{'':>9}  {'':>8}"
            out(f"{r['step']:>6}  {r['loss']:>10.4f}  {v}")
    out(f"\ntrain loss {s['first_loss']:.2f} -> {s['loss']:.2f} nats/byte; validation perplexity "
         f"{s['val_ppl']:.2f} per byte; {s['tokens_per_s']:,.0f} tokens/s")
    model, tok = load_pretrained(args.out)
    out(f"\nsample (temperature {args.temperature}) continuing {args.prompt!r}:\n" + "-" * 60)
    stream_text(model, tok, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                seed=args.seed)
    out("-" * 60)
    out(f"demo took {time.perf_counter() - t0:.0f} s. Next: hybridlm generate --checkpoint {args.out} "
         f"--prompt 'import '   |   hybridlm eval --checkpoint {args.out}")
    return 0


def add_arguments(p):
    p.add_argument("--steps", type=int, default=None,
                   help="training steps (default: as many as fit in --minutes on this machine)")
    p.add_argument("--minutes", type=float, default=3.5, help="time budget when --steps is not given (default 3.5)")
    p.add_argument("--out", default=os.path.join("runs", "demo"), help="run directory (default runs/demo)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus size cap in bytes")
    p.add_argument("--prompt", default=DEMO_PROMPT)
    p.add_argument("--max-new-tokens", type=int, default=300)
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-progress", action="store_true")
