"""The `hybridlm` command: train | generate | eval | info | demo | bench.

Errors on bad input print one line `hybridlm: error: <message>` to stderr and exit with status 2;
progress bars go to stderr, results to stdout.
"""
import argparse
import importlib.util
import json
import os
import sys
import time

DEMO_PROMPT = "def _check_arg(self, name, value):\n"


# --- shared helpers ------------------------------------------------------------------------------------------
def _is_main_rank() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def _out(*parts):
    if _is_main_rank():
        print(*parts, flush=True)


def _parse_sets(items: list[str]) -> dict:
    """["layout=(AM)*2", "n_heads=4"] -> {"layout": "(AM)*2", "n_heads": 4} (values JSON-parsed if possible)."""
    from .errors import InputError
    out = {}
    for item in items or []:
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise InputError(f"--set expects field=value, got {item!r}")
        try:
            out[key.strip().replace("-", "_")] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip().replace("-", "_")] = value
    return out


def _model_config(args, vocab_size: int, seq_len: int | None = None):
    """The preset with --n-layers/--d-model/--set applied; max_seq_len grows to cover seq_len."""
    from . import presets
    over = _parse_sets(args.set)
    if args.n_layers is not None:
        over["n_layers"] = args.n_layers
    if args.d_model is not None:
        over["d_model"] = args.d_model
    over.setdefault("vocab_size", vocab_size)
    cfg = presets.get(args.preset, **over)
    if seq_len is not None and cfg.max_seq_len < seq_len and "max_seq_len" not in over:
        cfg = cfg.replace(max_seq_len=seq_len)
    return cfg


def _add_model_args(p, preset_default: str | None = "mamba2-attention"):
    p.add_argument("--preset", default=preset_default,
                   help=f"named model configuration (default: {preset_default}); see `hybridlm info --list`")
    p.add_argument("--n-layers", type=int, help="depth in units of the preset's repeating block")
    p.add_argument("--d-model", type=int, help="model width")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                   help="override any ModelConfig field; VALUE is JSON-parsed (repeatable), e.g. --set layout='(AM)*2'")


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def _count(n: int) -> str:
    return f"{n / 1e6:.2f}M" if n >= 1e6 else f"{n / 1e3:.1f}K" if n >= 1e3 else str(n)


def _layout_summary(cfg) -> str:
    from .models.layout import flatten, parse_layout
    from .models.registry import LETTERS
    letters = flatten(parse_layout(cfg.layout, LETTERS.keys()))
    counts = ", ".join(f"{letters.count(c)} {c}" for c in sorted(set(letters)))
    return f"{cfg.layout}  ({len(letters)} layers: {counts})"


# --- train -------------------------------------------------------------------------------------------------
def _train_config(args):
    from .train import TrainConfig
    return TrainConfig(steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
                       min_lr=args.min_lr, warmup=args.warmup, schedule=args.schedule,
                       weight_decay=args.weight_decay, grad_clip=args.grad_clip, grad_accum=args.grad_accum,
                       eval_every=args.eval_every, eval_batches=args.eval_batches, save_every=args.save_every,
                       seed=args.seed, dtype=args.dtype, compile=args.compile,
                       grad_checkpointing=args.grad_checkpointing, log_every=args.log_every, device=args.device)


def cmd_train(args) -> int:
    from .data.corpus import load_corpus
    from .data.loader import TokenData
    from .data.tokenizer import load_tokenizer, tokenizer_from_dir
    from .train import train
    from .train.checkpoint import find_checkpoint, load_config
    tcfg = _train_config(args)
    corpus = load_corpus(args.data, max_bytes=args.max_bytes or None)
    if args.resume:
        ckpt = find_checkpoint(args.out)
        tok, model_cfg = tokenizer_from_dir(ckpt), load_config(ckpt)
    else:
        tok = load_tokenizer(args.tokenizer, texts=corpus.train)
        model_cfg = _model_config(args, tok.vocab_size, args.seq_len)
    data = TokenData.from_corpus(corpus, tok)
    from .models import CausalLM
    _out(f"model   {args.preset if not args.resume else 'resumed'}: {_layout_summary(model_cfg)}, "
         f"d_model {model_cfg.d_model}, {_count(CausalLM(model_cfg).num_parameters())} parameters")
    _out(f"data    {corpus.source}: {len(data.tokens('train')):,} train / {len(data.tokens('val')):,} val tokens "
         f"({tok.kind} tokenizer, vocab {tok.vocab_size})")
    s = train(model_cfg, tcfg, data, args.out, resume=args.resume, progress=not args.no_progress)
    if not _is_main_rank():
        return 0
    if s["loss"] is not None:
        _out(f"done    step {s['steps']}: train loss {s['loss']:.4f}, val loss {s['val_loss']:.4f}, "
             f"val ppl {s['val_ppl']:.2f}, {s['tokens_per_s']:,.0f} tokens/s; checkpoint {s['checkpoint']}")
    else:
        _out(f"nothing to do: the checkpoint in {args.out} is already at step {s['steps']}")
    return 0


def add_train_args(p):
    _add_model_args(p)
    p.add_argument("--out", default=None, help="run directory for checkpoint and metrics.jsonl (default runs/PRESET)")
    p.add_argument("--data", default=None,
                   help="text file, folder, .jsonl or .parquet (default: the Python standard library sources)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="cap on corpus size in bytes (0 = no cap)")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe:N (train a BPE of N ids) | tokenizer.json path")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--min-lr", type=float, default=None, help="final learning rate (default lr/10)")
    p.add_argument("--warmup", type=int, default=100)
    p.add_argument("--schedule", default="cosine", choices=["cosine", "wsd", "constant"])
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--grad-accum", type=int, default=1)
    p.add_argument("--eval-every", type=int, default=200)
    p.add_argument("--eval-batches", type=int, default=20)
    p.add_argument("--save-every", type=int, default=500)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--compile", action="store_true", help="torch.compile the model")
    p.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in backward")
    p.add_argument("--resume", action="store_true", help="continue from OUT/checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


# --- generate ------------------------------------------------------------------------------------------------
def stream_text(model, tok, prompt: str, max_new_tokens: int, *, temperature=0.8, top_k=None, top_p=None,
                seed: int = 0, out=None, compile: bool = False) -> str:
    """Write prompt + continuation to `out` (default stdout) as tokens arrive; returns the continuation."""
    import torch
    out = out or sys.stdout
    ids = tok.encode(prompt) or [tok.eos_id]
    gen = torch.Generator().manual_seed(seed)
    steps = model.stream(torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_token_id=tok.eos_id, generator=gen, compile=compile)
    new, shown = [], 0
    for i, nxt in enumerate(steps):
        if i == 0:  # the prompt passed the model's checks: show it
            out.write(prompt)
        t = int(nxt[0])
        if t == tok.eos_id:
            break
        new.append(t)
        text = tok.decode(new)
        if not text.endswith("\ufffd"):  # hold back an incomplete UTF-8 sequence
            out.write(text[shown:])
            out.flush()
            shown = len(text)
    text = tok.decode(new)
    out.write(text[shown:] + "\n")
    out.flush()
    return text


def cmd_generate(args) -> int:
    import torch
    from .train import load_pretrained
    model, tok = load_pretrained(args.checkpoint)
    torch.manual_seed(args.seed)
    stream_text(model, tok, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, compile=args.compile)
    return 0


def add_generate_args(p):
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or the run directory holding one)")
    p.add_argument("--prompt", default="", help="text to continue (default: start of a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the one-token decode step (pays off for long outputs; needs a C++ compiler)")


# --- eval ----------------------------------------------------------------------------------------------------
def cmd_eval(args) -> int:
    from .data.corpus import load_corpus
    from .data.loader import encode_documents
    from .data.tokenizer import tokenizer_from_dir
    from .eval.perplexity import perplexity
    from .train.checkpoint import load_checkpoint
    model, state = load_checkpoint(args.checkpoint)
    tok = tokenizer_from_dir(state["checkpoint_dir"])
    source = args.data or state.get("data") or None
    if source not in (None, "stdlib") and not os.path.exists(source) and args.data is None:
        source = None  # the training data moved: fall back to the built-in corpus
    corpus = load_corpus(source, max_bytes=args.max_bytes or None)
    seq_len = args.seq_len or state.get("train_config", {}).get("seq_len", 256)
    arr = encode_documents(corpus.val, tok)
    r = perplexity(model, arr, tok, seq_len=seq_len, batch_size=args.batch_size, max_tokens=args.max_tokens or None)
    _out(f"val loss {r['loss']:.4f}  ppl {r['ppl']:.2f}  ({r['tokens']:,} tokens of the {corpus.source} "
         f"validation split, seq_len {seq_len})")
    return 0


def add_eval_args(p):
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or the run directory holding one)")
    p.add_argument("--data", default=None,
                   help="text data to evaluate on (default: the training data's validation split)")
    p.add_argument("--max-bytes", type=int, default=8_000_000, help="corpus cap in bytes, as in training (0 = none)")
    p.add_argument("--seq-len", type=int, default=None, help="window length (default: the training seq_len)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=100_000, help="evaluate at most this many tokens (0 = all)")


# --- info ----------------------------------------------------------------------------------------------------
def cache_bytes(cfg, contexts: list[int], batch_size: int = 1, chunk: int = 512, seed: int = 0) -> list[int]:
    """Inference cache nbytes after prefilling each context length with random ids (a real cache)."""
    import torch
    from .models import CausalLM
    cfg = cfg.replace(max_seq_len=max(cfg.max_seq_len, max(contexts)))
    torch.manual_seed(seed)
    model = CausalLM(cfg).eval()
    g = torch.Generator().manual_seed(seed)
    out = []
    with torch.inference_mode():
        for n in contexts:
            cache = model.make_cache(batch_size)
            ids = torch.randint(0, cfg.vocab_size, (batch_size, n), generator=g)
            for i in range(0, n, chunk):
                model(ids[:, i: i + chunk], cache=cache, logits_to_keep=1)
            out.append(cache.nbytes)
    return out


def cmd_info(args) -> int:
    from . import presets
    from .errors import InputError
    from .models import CausalLM
    if args.list:
        for name in presets.names():
            _out(f"{name:<20} {presets.PRESETS[name].doc}")
        return 0
    if args.checkpoint:
        from .train.checkpoint import load_config
        cfg, name = load_config(args.checkpoint), args.checkpoint
    elif args.preset:
        cfg, name = _model_config(args, args.vocab_size), args.preset
    else:
        raise InputError("info needs --preset NAME or --checkpoint DIR (or --list)")
    contexts = sorted(set(args.context))
    if not contexts or contexts[0] < 1:
        raise InputError("--context lengths must be >= 1")
    model = CausalLM(cfg)
    _out(f"model        {name}")
    _out(f"layout       {_layout_summary(cfg)}")
    _out(f"parameters   {model.num_parameters():,} ({_count(model.num_parameters(exclude_embeddings=True))} "
         f"without embeddings)")
    _out(f"sizes        d_model {cfg.d_model}, vocab {cfg.vocab_size}, max_seq_len {cfg.max_seq_len}")
    del model
    nbytes = cache_bytes(cfg, contexts, args.batch_size)
    _out(f"\ninference cache (batch {args.batch_size}, float32 state):")
    _out(f"{'context':>9}  {'bytes':>14}  {'size':>10}")
    for n, b in zip(contexts, nbytes):
        _out(f"{n:>9,}  {b:>14,}  {_human(b):>10}")
    if len(contexts) > 1:
        per_tok = (nbytes[-1] - nbytes[0]) / (contexts[-1] - contexts[0])
        const = nbytes[-1] - per_tok * contexts[-1]
        kind = "grows with context (attention K/V)" if per_tok > 0 else "constant in context (recurrent state only)"
        _out(f"per token    {per_tok:,.0f} bytes/token; fixed state {_human(max(const, 0))}; the cache {kind}")
    return 0


def add_info_args(p):
    _add_model_args(p, preset_default=None)
    p.add_argument("--checkpoint", help="describe a saved model instead of a preset")
    p.add_argument("--vocab-size", type=int, default=257, help="vocabulary for --preset (default 257: bytes + eos)")
    p.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096], help="prefill lengths to measure")
    p.add_argument("--batch-size", type=int, default=1)
    p.add_argument("--list", action="store_true", help="list the presets")


# --- demo ----------------------------------------------------------------------------------------------------
def _calibrate(cfg, tcfg, data) -> tuple[int, float]:
    """(CPU threads, seconds per training step): times a few steps with torch's default thread count and
    with one thread, keeping the faster (one thread wins by far on an oversubscribed machine)."""
    import torch
    from .data.loader import batch_generator
    from .models import CausalLM
    from .train.optim import make_optimizer
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


def cmd_demo(args) -> int:
    from . import presets
    from .data.corpus import load_corpus
    from .data.loader import TokenData
    from .data.tokenizer import ByteTokenizer
    from .models import CausalLM
    from .train import TrainConfig, load_pretrained, train
    t0 = time.perf_counter()
    tok = ByteTokenizer()
    corpus = load_corpus(None, max_bytes=args.max_bytes)
    data = TokenData.from_corpus(corpus, tok)
    cfg = presets.get("mamba2-attention", n_layers=4, d_model=256, vocab_size=tok.vocab_size,
                      max_seq_len=1024, ssd_d_state=32, ssd_headdim=32, n_heads=4)
    _out(f"hybridlm demo: a {_count(CausalLM(cfg).num_parameters())}-parameter Mamba-2 + attention hybrid, "
         f"layout {cfg.layout!r} (S = SSD/Mamba-2 block, A = attention), d_model {cfg.d_model}")
    _out(f"data: {corpus.nbytes / 1e6:.1f} MB of this Python's standard library sources, byte-level "
         f"({len(data.tokens('train')):,} train / {len(data.tokens('val')):,} validation tokens)")
    steps = args.steps
    base = dict(batch_size=16, seq_len=128, lr=3e-3, min_lr=3e-4, warmup=20, eval_batches=8, save_every=0,
                log_every=5, seed=args.seed)
    if steps is None:  # fit the run to the time budget on this machine
        threads, sps = _calibrate(cfg, TrainConfig(steps=1, **base), data)
        left = args.minutes * 60 - (time.perf_counter() - t0) - 15  # keep ~15 s for the sample
        steps = max(100, int(left / (1.1 * sps)) // 20 * 20)
        _out(f"measured {sps:.2f} s per step with {threads} thread(s) -> {steps} steps for a ~{args.minutes:g} "
             f"minute demo (set --steps to choose)")
    tcfg = TrainConfig(steps=steps, eval_every=max(1, -(-steps // 4)), **base)
    _out(f"training {steps} steps of {tcfg.batch_size}x{tcfg.seq_len} bytes into {args.out}/ ...\n")
    s = train(cfg, tcfg, data, args.out, progress=not args.no_progress)
    with open(os.path.join(args.out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    _out(f"{'step':>6}  {'train loss':>10}  {'val loss':>9}  {'val ppl':>8}")
    for r in rows:
        if r["step"] == 1 or r["val_loss"] is not None:
            v = f"{r['val_loss']:>9.4f}  {r['val_ppl']:>8.2f}" if r["val_loss"] is not None else f"{'':>9}  {'':>8}"
            _out(f"{r['step']:>6}  {r['loss']:>10.4f}  {v}")
    _out(f"\ntrain loss {s['first_loss']:.2f} -> {s['loss']:.2f} nats/byte; validation perplexity "
         f"{s['val_ppl']:.2f} per byte; {s['tokens_per_s']:,.0f} tokens/s")
    model, tok = load_pretrained(args.out)
    _out(f"\nsample (temperature {args.temperature}) continuing {args.prompt!r}:\n" + "-" * 60)
    stream_text(model, tok, args.prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                seed=args.seed)
    _out("-" * 60)
    _out(f"demo took {time.perf_counter() - t0:.0f} s. Next: hybridlm generate --checkpoint {args.out} "
         f"--prompt 'import '   |   hybridlm eval --checkpoint {args.out}")
    return 0


def add_demo_args(p):
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


# --- parser and entry point -----------------------------------------------------------------------------
def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hybridlm", description="Efficient hybrid language models: build, "
                                     "train, evaluate, generate and measure.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, help_, add, fn in [
        ("train", "train a model (built-in corpus or your text)", add_train_args, cmd_train),
        ("generate", "stream text from a checkpoint", add_generate_args, cmd_generate),
        ("eval", "validation perplexity of a checkpoint", add_eval_args, cmd_eval),
        ("info", "layout, parameter count and inference cache size", add_info_args, cmd_info),
        ("demo", "train a small hybrid on Python sources in a few minutes, then sample", add_demo_args, cmd_demo),
    ]:
        p = sub.add_parser(name, help=help_, description=help_)
        add(p)
        p.set_defaults(func=fn)
    if importlib.util.find_spec("hybridlm.bench.run") is not None:
        p = sub.add_parser("bench", help="throughput, latency, memory and MFU measurements",
                           description="throughput, latency, memory and MFU measurements")
        if argv and argv[0] == "bench":  # import the benchmark module only when it is used
            from .bench import run as bench_run
            bench_run.add_arguments(p)
            p.set_defaults(func=bench_run.main)
    return parser


def _error(msg: str, code: int) -> int:
    lines = str(msg).strip().splitlines() or ["unknown error"]
    print(f"hybridlm: error: {lines[0]}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    from .errors import HybridLMError
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    if args.command == "train" and args.out is None:
        args.out = os.path.join("runs", args.preset)
    try:
        return args.func(args) or 0
    except HybridLMError as e:
        return _error(e, 2)
    except FileNotFoundError as e:
        return _error(f"{e.strerror}: {e.filename}" if e.filename else e, 2)
    except FloatingPointError as e:
        return _error(e, 1)
    except KeyboardInterrupt:
        return _error("interrupted", 130)
    except BrokenPipeError:  # e.g. `hybridlm generate ... | head`
        sys.stdout = open(os.devnull, "w")
        return 0
