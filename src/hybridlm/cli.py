"""The `hybridlm` command: a thin dispatcher over one module per command.

Each command module has `add_arguments(parser)` and `main(args) -> int`; only the chosen command's module is
imported. Errors on bad input print one line `hybridlm: error: <message>` to stderr and exit with status 2;
progress bars go to stderr, results to stdout.
"""
import argparse
import importlib
import os
import sys

# command modules and users import these from here too
from .runtime import allocator_policy, command_line, set_allocator, tune_allocator  # noqa: F401

# name -> (module, one-line help). A new command is a module with add_arguments/main and one row here.
COMMANDS = {
    "train": ("hybridlm.commands.train", "train a model (built-in corpus or your text)"),
    "generate": ("hybridlm.commands.generate", "stream text from a checkpoint"),
    "eval": ("hybridlm.commands.eval", "validation loss and perplexity of a checkpoint"),
    "info": ("hybridlm.commands.info", "layout, parameter count and inference cache size"),
    "demo": ("hybridlm.commands.demo", "train a small hybrid on Python sources in a few minutes, then sample"),
    "data": ("hybridlm.commands.data", "data prepare: tokenise a corpus into shards that training streams from disk"),
    "bench": ("hybridlm.commands.bench", "throughput, latency, memory and MFU measurements"),
    "consolidate": ("hybridlm.commands.consolidate", "one model.safetensors from an FSDP checkpoint's DCP shards"),
    "tokenizer": ("hybridlm.commands.tokenizer", "train a byte-level BPE tokenizer and save it (transformers-loadable)"),
    "convert": ("hybridlm.commands.convert", "transformers checkpoint directory <-> hybridlm checkpoint"),
    "ablate": ("hybridlm.commands.ablate", "a paper's ablation table at small scale from a recipe (--list)"),
    "report": ("hybridlm.commands.report", "docs/results.md from the outputs of ablate, mqar and bench"),
    "mqar": ("hybridlm.commands.mqar", "multi-query associative recall accuracy over layouts, widths and lengths"),
    "plot": ("hybridlm.commands.plot", "training and validation curves of several runs on one PNG"),
    "serve": ("hybridlm.commands.serve", "OpenAI-compatible HTTP server with continuous batching and a prefix cache"),
}


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The full parser; with `argv`, only the command named first gets its arguments (and module import)."""
    parser = argparse.ArgumentParser(prog="hybridlm", description="Efficient hybrid language models: build, "
                                     "train, evaluate, generate and measure.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if argv is None or name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(func=mod.main)
    return parser


def _error(msg: str, code: int) -> int:
    lines = str(msg).strip().splitlines() or ["unknown error"]
    print(f"hybridlm: error: {lines[0]}", file=sys.stderr, flush=True)
    return code


def main(argv: list[str] | None = None) -> int:
    from .errors import HybridLMError
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv).parse_args(argv)
    set_allocator(allocator_policy(getattr(args, "parallel", None)))   # before the command allocates anything
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
