"""`hybridlm serve`: an OpenAI-compatible HTTP server over a checkpoint (serve/: engine, scheduler, API)."""
import argparse
import os
import tempfile

from ..dtypes import CHOICES as DTYPES
from .common import add_quantize_args, add_tokenizer_arg
from .generate import add_speculative_args

API_KEY_ENV = "HYBRIDLM_API_KEY"


def build(args):
    """(app, scheduler) for the parsed arguments: the model loaded as `generate` loads it."""
    import torch
    from ..dtypes import resolve_device
    from ..errors import InputError
    from ..serve import Engine, Scheduler
    from ..serve.api import create_app
    from .common import human, out
    from .generate import load_for_inference, load_speculative
    require_serve_extra()
    for flag in ("max_slots", "prefix_block", "max_queue"):
        if getattr(args, flag) < 1:
            raise InputError(f"--{flag.replace('_', '-')} must be >= 1")
    if args.prefix_cache_mb < 0 or (args.memory_mb is not None and args.memory_mb <= 0):
        raise InputError("--prefix-cache-mb must be >= 0 and --memory-mb > 0")
    device = resolve_device(args.device)
    with tempfile.TemporaryDirectory(prefix="hybridlm-serve-") as tmp:    # a converted checkpoint, while it loads
        model, tok = load_for_inference(argparse.Namespace(**{**vars(args), "checkpoint": hybridlm_checkpoint(
            args.checkpoint, tmp)}), str(device))
    drafter = load_speculative(args, str(device))
    mb = 1 << 20
    with torch.no_grad():        # the engine's own calls run under inference_mode in its thread
        engine = Engine(model, eos_id=tok.eos_id, block=args.prefix_block,
                        prefix_cache_bytes=int(args.prefix_cache_mb * mb), max_slots=args.max_slots,
                        memory_bytes=int(args.memory_mb * mb) if args.memory_mb else None, speculative=drafter)
    if args.chat_template:
        tok.chat_template = read_template(args.chat_template)
    names = model_names(args.checkpoint, args.served_model_name)
    cfg = model.config
    out(f"model      {' | '.join(names)}: {cfg.layout}, {model.num_parameters() / 1e6:.1f}M parameters, "
        f"{next(model.parameters()).dtype}, {device}")
    out(f"state      {human(engine.fixed_bytes)} fixed + {engine.token_bytes:,} bytes/token per request "
        f"({human(engine.slot_bytes(cfg.max_seq_len))} at the full context of {cfg.max_seq_len})")
    budget = ""
    if engine.memory_bytes:
        fit = engine.memory_bytes // engine.slot_bytes(cfg.max_seq_len)
        budget = f", memory budget {human(engine.memory_bytes)} ({fit} requests at the full context)"
    out(f"slots      {args.max_slots}{budget}"
        + f"; prefix cache {args.prefix_cache_mb} MiB in blocks of {args.prefix_block} tokens")
    if drafter is not None:
        what = "prompt lookup" if args.speculative.startswith("ngram") else f"draft model {args.draft_checkpoint}"
        out(f"speculate  {what}, {drafter.k} drafts checked per step")
    scheduler = Scheduler(engine, max_queue=args.max_queue)
    key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = create_app(scheduler, tok, names, api_key=key, max_body_bytes=int(args.max_body_mb * mb))
    return app, scheduler


def model_names(checkpoint: str, extra: list[str] | None) -> list[str]:
    """The ids the served model answers to: `--served-model-name`s first (the first is the one responses name),
    then `--checkpoint` as typed (`runs/m2a`: what lm-eval's `model=RUN` sends) and its directory's name."""
    return list(dict.fromkeys([*(extra or []), checkpoint, os.path.basename(os.path.normpath(checkpoint))]))


def read_template(path: str) -> str:
    """A jinja chat template file's text (one clear error when it cannot be read)."""
    from ..errors import InputError
    try:
        with open(path) as f:
            return f.read()
    except OSError as e:
        raise InputError(f"--chat-template {path}: {e.strerror}") from None


def require_serve_extra():
    """One clear error when the serve extra (starlette, uvicorn) is not installed."""
    from ..errors import InputError
    try:
        import prometheus_client  # noqa: F401
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise InputError("serving needs the serve extra: pip install 'hybridlm[serve]'") from None


def hybridlm_checkpoint(path: str, tmp: str) -> str:
    """`path` itself, or, for a transformers directory of a family the converters read (a released Rodimus
    directory among them), the hybridlm checkpoint `convert --from-hf` makes of it, under `tmp`."""
    import json
    config = os.path.join(path, "config.json")
    if not os.path.isfile(config):
        return path                              # a run directory, or a path load_checkpoint explains
    with open(config) as f:
        model_type = json.load(f).get("model_type")
    if model_type in (None, "hybridlm"):        # a hybridlm checkpoint (a bare ModelConfig or transformers' layout)
        return path
    from ..hf.directory import convert_from_hf
    from .common import out
    out(f"converting {path} ({model_type}) to a hybridlm checkpoint on load")
    return convert_from_hf(path, os.path.join(tmp, "checkpoint"))


def listen(host: str, port: int):
    """A socket bound to host:port (one clear error when it cannot be)."""
    import socket
    from ..errors import InputError
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        sock = socket.socket(infos[0][0], socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
    except OSError as e:
        raise InputError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    return sock


def main(args) -> int:
    import signal
    from .common import out
    require_serve_extra()
    import uvicorn
    if not 0 <= args.port <= 65535:
        from ..errors import InputError
        raise InputError(f"--port must be in 0..65535, got {args.port}")
    sock = listen(args.host, args.port)      # before loading: a busy port fails fast
    app, _ = build(args)
    # uvicorn turns SIGTERM/SIGINT into a graceful shutdown (stop accepting, let open responses finish, then our
    # lifespan drains the engine) and then re-raises the signal to the handler it found: make that one harmless,
    # so a stop by signal exits 0
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: None)
    out(f"serving    http://{args.host}:{sock.getsockname()[1]}/v1  (POST /v1/completions, /v1/chat/completions; "
        "GET /v1/models, /health, /metrics)")
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=args.shutdown_timeout,
                            access_log=args.log_level == "debug")
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def add_arguments(p):
    p.add_argument("--checkpoint", required=True,
                   help="checkpoint directory (or the run directory holding one), or a transformers directory of a "
                        "family `convert --from-hf` reads (converted on load)")
    add_tokenizer_arg(p)
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="more ids clients may send as `model` (the first names the responses); the model always "
                        "answers to --checkpoint as typed and to its directory's name")
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a jinja chat template for /v1/chat/completions (for a tokenizer that has none, or to replace "
                        "its own); it renders `tools` as transformers' apply_chat_template(tools=...) does")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on every route but /health "
                   f"(default: ${API_KEY_ENV} if set)")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="cast the weights to this dtype; auto (default): bfloat16 on CPUs with AMX-BF16 or "
                        "AVX512-BF16 and on GPUs, else float32")
    add_quantize_args(p)
    add_speculative_args(p)
    p.add_argument("--max-slots", type=int, default=16, help="requests decoded together at most (default 16)")
    p.add_argument("--memory-mb", type=float, default=None,
                   help="budget for the inference state of all requests in flight: a request is admitted when its "
                        "state at prompt + max_tokens fits (recurrent: fixed; attention: grows with its tokens)")
    p.add_argument("--prefix-block", type=int, default=256,
                   help="prefill chunk and prefix-cache block, in tokens (default 256)")
    p.add_argument("--prefix-cache-mb", type=float, default=512,
                   help="byte budget of the prefix cache (state snapshots at block boundaries; 0: off; default 512)")
    p.add_argument("--max-queue", type=int, default=256, help="waiting requests at most; beyond, 429 (default 256)")
    p.add_argument("--max-body-mb", type=float, default=4, help="largest request body; beyond, 413 (default 4)")
    p.add_argument("--shutdown-timeout", type=float, default=30,
                   help="seconds open streams may take to finish after SIGTERM before they are ended (default 30)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
