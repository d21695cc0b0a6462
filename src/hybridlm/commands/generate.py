"""`hybridlm generate`: stream text from a checkpoint."""
import sys

from ..dtypes import CHOICES as DTYPES
from .common import add_quantize_args, add_tokenizer_arg


def stream_text(model, tok, prompt: str, max_new_tokens: int, *, temperature=0.8, top_k=None, top_p=None,
                seed: int = 0, out=None, compile: bool = False, speculative=None, **constraint) -> str:
    """Write prompt + continuation to `out` (default stdout) as tokens arrive; returns the continuation.
    `constraint`: json_schema= / regex= / grammar= (CausalLM.stream's constrained decoding)."""
    import torch
    out = out or sys.stdout
    ids = tok.encode(prompt) or [tok.eos_id]
    gen = torch.Generator().manual_seed(seed)
    steps = model.stream(torch.tensor([ids]), max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                         eos_token_id=tok.eos_id, generator=gen, compile=compile, speculative=speculative,
                         tokenizer=tok, **constraint)
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


def load_for_inference(args, device: str = "cpu"):
    """(model, tokenizer) as --checkpoint/--tokenizer/--quantize/--dtype ask, ready to decode: quantized from the
    saved weights (before a cast to bf16), cast, on `device`, decode's matrix-vector products through the project's
    CPU kernels. Shared by `generate` and `serve`."""
    import torch
    from ..dtypes import resolve_dtype
    from ..train import load_checkpoint, load_pretrained
    from .common import other_tokenizer, quantized
    if args.tokenizer:            # the checkpoint need not carry one (e.g. converted without a tokenizer.json)
        model = load_checkpoint(args.checkpoint)[0].eval()
        tok = other_tokenizer(args.tokenizer, model.config.vocab_size)
    else:
        model, tok = load_pretrained(args.checkpoint)
    model = quantized(model, args)     # from the saved weights, before a cast to bf16
    model = model.to(device=device, dtype=getattr(torch, resolve_dtype(args.dtype, device)[0]))
    from ..models.quantize import use_cpu_kernels_
    use_cpu_kernels_(model)            # decode's matrix-vector products through the project's CPU kernels
    return model, tok


def add_speculative_args(p):
    """--speculative / --draft-checkpoint (generate and serve)."""
    p.add_argument("--speculative", default=None, metavar="ngram[:K]|draft[:K]",
                   help="speculative decoding: check K drafted tokens per step in one forward (default K 4); ngram: "
                        "prompt lookup, draft: a small model (--draft-checkpoint); the output is unchanged")
    p.add_argument("--draft-checkpoint", default=None, metavar="RUN",
                   help="the draft model of --speculative draft: a checkpoint with the same tokenizer")


def load_speculative(args, device: str = "cpu"):
    """The drafter --speculative / --draft-checkpoint ask for (None: off), its draft model loaded as the model is."""
    import argparse
    from ..errors import InputError
    from ..models.speculative import parse_speculative
    spec, run = args.speculative, args.draft_checkpoint
    if spec is None:
        if run:
            raise InputError("--draft-checkpoint goes with --speculative draft[:K]")
        return None
    draft = None
    if spec.partition(":")[0] == "draft":
        if not run:
            raise InputError("--speculative draft needs --draft-checkpoint RUN (a small model with the same tokenizer)")
        draft = load_for_inference(argparse.Namespace(**{**vars(args), "checkpoint": run}), device)[0]
    elif run:
        raise InputError("--draft-checkpoint goes with --speculative draft[:K]")
    return parse_speculative(spec, draft)


def main(args) -> int:
    import torch
    model, tok = load_for_inference(args)   # no header: stdout is the text
    speculative = load_speculative(args)
    prompt = args.prompt
    if args.chat:  # the tokenizer's chat template around one user turn, ending where the assistant speaks
        from ..data.tokenizer import apply_chat_template
        prompt = apply_chat_template(tok, [{"role": "user", "content": args.prompt}])
    torch.manual_seed(args.seed)
    stream_text(model, tok, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, seed=args.seed, compile=args.compile, speculative=speculative,
                **constraint_args(args))
    return 0


def constraint_args(args) -> dict:
    """--json-schema FILE / --regex TEXT / --grammar FILE as generate's keyword arguments (one clear error for a
    file that cannot be read)."""
    from ..errors import InputError
    out = {}
    for flag, key in (("json_schema", "json_schema"), ("grammar", "grammar")):
        path = getattr(args, flag)
        if path:
            try:
                with open(path) as f:
                    out[key] = f.read()
            except OSError as e:
                raise InputError(f"--{flag.replace('_', '-')} {path}: {e.strerror}") from None
    if args.regex:
        out["regex"] = args.regex
    return out


def add_arguments(p):
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (or the run directory holding one)")
    add_tokenizer_arg(p)
    p.add_argument("--prompt", default="", help="text to continue (default: start of a new document)")
    p.add_argument("--max-new-tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--seed", type=int, default=0)
    add_speculative_args(p)
    p.add_argument("--chat", action="store_true", help="wrap --prompt in the tokenizer's chat template (a user turn)")
    p.add_argument("--dtype", choices=DTYPES, default="auto",
                   help="cast the weights to this dtype; auto (default): bfloat16 on CPUs with AMX-BF16 or "
                        "AVX512-BF16, else float32")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the one-token decode step (pays off for long outputs; needs a C++ compiler)")
    p.add_argument("--json-schema", default=None, metavar="FILE",
                   help="constrain the output to this JSON schema (xgrammar; the serve extra)")
    p.add_argument("--regex", default=None, help="constrain the output to this regular expression")
    p.add_argument("--grammar", default=None, metavar="FILE", help="constrain the output to this EBNF / GBNF grammar")
    add_quantize_args(p)
