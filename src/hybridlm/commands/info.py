"""`hybridlm info`: layout, parameter count and inference-cache size of a preset or checkpoint."""
from ..models.sizing import cache_bytes
from .common import add_model_args, count, human, layout_summary, model_config, out


def main(args) -> int:
    from ..models import presets
    from ..errors import InputError
    from ..models import CausalLM
    if args.list:
        for name in presets.names():
            out(f"{name:<20} {presets.PRESETS[name].doc}")
        return 0
    if args.checkpoint:
        from ..checkpoint import load_config
        cfg, name = load_config(args.checkpoint), args.checkpoint
    elif args.preset:
        cfg, name = model_config(args, args.vocab_size), args.preset
    else:
        raise InputError("info needs --preset NAME or --checkpoint DIR (or --list)")
    contexts = sorted(set(args.context))
    if not contexts or contexts[0] < 1:
        raise InputError("--context lengths must be >= 1")
    import torch
    with torch.device("meta"):   # sizes only
        model = CausalLM(cfg)
    out(f"model        {name}")
    out(f"layout       {layout_summary(cfg)}")
    out(f"parameters   {model.num_parameters():,} ({count(model.num_parameters(exclude_embeddings=True))} "
         f"without embeddings)")
    out(f"sizes        d_model {cfg.d_model}, vocab {cfg.vocab_size}, max_seq_len {cfg.max_seq_len}")
    del model
    nbytes = cache_bytes(cfg, contexts, args.batch_size)
    out(f"\ninference cache (batch {args.batch_size}, float32 state):")
    out(f"{'context':>9}  {'bytes':>14}  {'size':>10}")
    for n, b in zip(contexts, nbytes):
        out(f"{n:>9,}  {b:>14,}  {human(b):>10}")
    if len(contexts) > 1:
        per_tok = (nbytes[-1] - nbytes[0]) / (contexts[-1] - contexts[0])
        const = nbytes[-1] - per_tok * contexts[-1]
        kind = "grows with context (attention K/V)" if per_tok > 0 else "constant in context (recurrent state only)"
        out(f"per token    {per_tok:,.0f} bytes/token; fixed state {human(max(const, 0))}; the cache {kind}")
    return 0


def add_arguments(p):
    add_model_args(p, preset_default=None)
    p.add_argument("--checkpoint", help="describe a saved model instead of a preset")
    p.add_argument("--vocab-size", type=int, default=257, help="vocabulary for --preset (default 257: bytes + eos)")
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096], help="prefill lengths to measure")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--list", action="store_true", help="list the presets")
