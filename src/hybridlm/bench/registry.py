"""The registry of bench suites: `hybridlm bench --suite NAME [--quick] [--FLAG VALUE ...]`.

Every suite is declared the same way, by one `Suite` row in SUITES:

    "decode": Suite("decode ms/token, growing vs static step vs CUDA graph", "suites:decode_suite",
                    defaults=dict(presets="transformer++,mamba2", context=512, steps=256),
                    quick=dict(context=16, steps=8)),

`run` names the function ("module:function" under hybridlm.bench, imported only when the suite runs); it is called
as `function(settings, log) -> dict` and returns what goes into the JSON file (a "markdown" entry is written beside
it as NAME.md; "ok": False makes the command exit 1). `settings` is the one settings type: a plain dict of the
suite's `defaults` (updated by `quick` under --quick, then by the flags given) plus "quick" and "out" (the JSON
path). Each key of `defaults` is a flag `--key-with-dashes` whose type is the default's (int, float, str, a bool
switch, a tuple of ints or of BATCHxLEN shapes as comma lists; `types` gives it where the default is None) and
whose help is `help[key]` or the defaults. A flag shared by several suites (or the preset instrument) is one flag;
one given to a suite that does not declare it is an error.

Adding a suite is one place: write the function (in a module of its own, or in suites.py for a small one) and add
its row here; its flags, its --help line, its JSON and markdown come from the row. Module entry points such as
`python -m hybridlm.bench.parallel` call `main(NAME)`, which parses the same flags.
"""
import argparse
import dataclasses
import importlib
import os

from . import decode_profile
from .measure import write_results


@dataclasses.dataclass(frozen=True)
class Suite:
    what: str                                                   # one line for --help
    run: str                                                    # "module:function" under hybridlm.bench
    defaults: dict = dataclasses.field(default_factory=dict)    # settings: each key a flag
    quick: dict = dataclasses.field(default_factory=dict)       # the settings --quick changes
    types: dict = dataclasses.field(default_factory=dict)       # flag types for defaults that are None
    help: dict = dataclasses.field(default_factory=dict)        # flag help beyond the default
    out: str | None = None                                      # default JSON path (runs/bench/NAME.json)

    def function(self):
        module, name = self.run.split(":")
        return getattr(importlib.import_module(f"{__package__}.{module}"), name)


# --- the suites ----------------------------------------------------------------------------------------------------
DECODE = dict(presets="transformer++,mamba2,rodimus++,cheems,deepseek-mla", d_model=768, n_layers=12,
              vocab_size=32000, context=512, steps=256, repeats=3)
QUANTIZE = dict(presets="llama,rodimus++", d_model=2048, n_layers=22, n_heads=32, n_kv_heads=4, mlp_hidden=5632,
                vocab_size=32000, context=128, steps=32, repeats=3, group_size=64)
TINY = dict(d_model=128, n_layers=2, n_heads=4, n_kv_heads=2, mlp_hidden=256, vocab_size=512)

SUITES = {
    "wm": Suite("CDMoE vs gated MLP, doge vs transformers Doge-MoE", "suites:wm_suite"),
    "moe": Suite("CDMoE layer vs gated MLP with a breakdown of its time", "suites:moe_suite"),
    "mla": Suite("MLA latent cache size, absorbed vs expanded decode", "suites:mla_suite"),
    "rodimus": Suite("GLA op speed, Rodimus cache and latency vs context and vs Mamba-2", "suites:rodimus_suite"),
    "gla": Suite("gated linear attention, chunked vs token loop", "suites:gla_suite"),
    "delta": Suite("gated delta rule, chunked WY form vs token loop", "suites:delta_suite"),
    "attention": Suite("peak memory of explicit softmax attention vs flash_attention", "suites:attention_suite"),
    "decode": Suite("decode ms/token, growing vs static step vs CUDA graph", "suites:decode_suite", DECODE,
                    quick=dict(presets="transformer++,mamba2", d_model=64, n_layers=2, vocab_size=512, context=16,
                               steps=8, repeats=2)),
    "hf": Suite("transformers generate() through HybridLMForCausalLM vs ours", "suites:hf_suite"),
    "twins": Suite("every public-hybrid preset vs its transformers twin, training", "suites:twins_suite",
                   dict(presets="", d_model=256, n_layers=4, vocab_size=8192, shapes=((4, 512),), repeats=5),
                   quick=dict(d_model=64, n_layers=2, vocab_size=256, shapes=((1, 32),), repeats=1),
                   help=dict(presets="comma-separated presets (default: every preset with a transformers twin)")),
    "kernels": Suite("our Triton SSD / GLA / CDMoE kernels vs mamba_ssm / FLA, forward and forward+backward (CUDA)",
                     "kernels:kernels_suite", dict(shapes=None, repeats=10), quick=dict(repeats=3),
                     types=dict(shapes="shapes"),
                     help=dict(shapes="batch shapes BATCHxLEN,... (default 8x2048,8x8192,8x16384; quick 8x2048)")),
    "gpu": Suite("the GPU check: correctness, kernels vs FLA, training MFU, decode, memory (--dry-run: on CPU)",
                 "gpu:gpu_suite", dict(dry_run=False, parts="", time_limit=None), types=dict(time_limit=float),
                 out=os.path.join("runs", "gpu", "gpu-check.json"),
                 help=dict(dry_run="run every part on the CPU at tiny sizes under Triton's interpreter (~1 minute)",
                           parts="only these parts (correctness, kernels, training, decode, memory, steps)",
                           time_limit="scale the parts' time budgets to add up to this many seconds (default ~400)")),
    "decode-profile": Suite("where one CPU decode step's time goes: each part's and kernel's ms, bytes and GB/s "
                            "against the read limit, per family shape and stored format",
                            "decode_profile:decode_profile_suite", decode_profile.DEFAULTS, quick=decode_profile.QUICK,
                            help=dict(formats="stored formats, a comma list of bf16, f32, int8, int4",
                                      run="profile this checkpoint instead of the families' shapes",
                                      check="also time one large bf16 matrix against the read limit",
                                      read_mb="MB the read limit's float32 sum reads")),
    "quantize": Suite("float vs int8 vs int4 weights: prefill and decode tokens/s, a profile of one step",
                      "quantized:quantize_suite", QUANTIZE,
                      quick=dict(TINY, context=16, steps=4, repeats=1, group_size=32)),
    "llamacpp": Suite("llama.cpp beside hybridlm on the same Llama / Mamba-2 weights (needs llama-cpp-python)",
                      "llamacpp:llamacpp_suite",
                      dict(models="llama,mamba2", families="", prompt=128, new=64, rounds=2,
                           runtimes="f32,bf16,q8_0,q4_0", dir=os.path.join("runs", "llamacpp"), llamacpp_src=""),
                      quick=dict(prompt=16, new=8, rounds=1, dir=os.path.join("runs", "llamacpp-quick")),
                      help=dict(dir="where the checkpoints, transformers exports and GGUFs are made (reused)",
                                families="instead of --models: hybrid families built by transformers' own classes "
                                         "at ~1B (all, or a comma list of qwen3-next, kimi-linear, nemotron-h, "
                                         "granite-4, falcon-h1, lfm2, jamba, bamba, llama, mamba2); runtimes "
                                         "bf16,q8_0,q4_0 (f32 too if asked)",
                                llamacpp_src="the llama.cpp source tree llama-cpp-python was built from (its "
                                             "sdist's vendor/llama.cpp), for convert_hf_to_gguf.py")),
    "serve": Suite("hybridlm serve under HTTP load: tokens/s, TTFT and TPOT per concurrency, state per slot, "
                   "prefix-hit TTFT (and llama-server beside it with --llama-server)", "serve:serve_suite",
                   dict(presets="transformer++,mamba2,rodimus++,mamba2-attention", concurrency=(1, 4, 16, 64),
                        params="125M", d_model=None, n_layers=None, prompt_len=64, max_tokens=48, requests=None,
                        time_limit=120.0, prefix_len=2048, context=4096, memory_budget_mb=1024.0, burst=16,
                        burst_min=64, burst_max=2048, dtype="auto", quantize="", url="", llama_server="",
                        llamacpp_src="", schema="", schema_tokenizer="", schema_steps=64, decode_steps=0,
                        decode_only=False, speculative="", dir=os.path.join("runs", "serve")),
                   quick=dict(presets="mamba2", concurrency=(1, 2), params="", d_model=64, n_layers=2,
                              prompt_len=8, max_tokens=4, prefix_len=0, context=256, time_limit=30.0, burst=4,
                              burst_min=8, burst_max=64, schema_steps=4, decode_steps=2),
                   types=dict(d_model=int, n_layers=int, requests=int),
                   help=dict(concurrency="concurrent requests per level, a comma list",
                             params="size every preset to about this many parameters ('' with --d-model)",
                             requests="requests per level (default 2 x concurrency, at least 8)",
                             time_limit="seconds per level after which no request starts",
                             prefix_len="prompt of the prefix-cache figure (0: skip)",
                             burst="requests sent at once with prompts from --burst-min to --burst-max tokens: "
                                   "TTFT p50/p99 and RSS against the memory budget (0: skip)",
                             url="load a server already running there instead (any OpenAI-compatible one)",
                             llama_server="llama.cpp's llama-server binary: serve a TinyLlama-shaped Llama from "
                                          "the same weights with both (needs --llamacpp-src)",
                             quantize="int8 or int4 weights",
                             schema="a JSON schema file, or 'builtin' (three): instead of HTTP load, the grammar "
                                    "mask's cost per decode step beside the step at each --concurrency, and compile "
                                    "times (bench/structured.py)",
                             schema_tokenizer="the tokenizer the schema compiles against: byte (default), bpe:N "
                                              "(trained on hybridlm's own sources), a tokenizer.json or a run; its "
                                              "vocabulary sets the mask's cost",
                             schema_steps="decode steps timed per batch size (--schema)",
                             decode_steps="also the decode figures, in process: ms per decode step of 1 stream, "
                                          "--burst streams, --burst streams of --burst-min to --burst-max tokens "
                                          "and of their mean; steps per timed call (0: skip)",
                             decode_only="only the decode figures (no server, no HTTP load)",
                             speculative="serve with --speculative ngram[:K]: each level also reports the drafts "
                                         "accepted and the tokens per step (/metrics)")),
    "speculative": Suite("batch-1 greedy decoding with and without speculative decoding on a prompt that repeats "
                         "itself (a code file to rewrite): tokens/s, speed-up, tokens per check, check cost; forced "
                         "acceptance rows beside prompt lookup", "speculative:speculative_suite",
                         dict(models="llama,mamba2-attention:125M", prompt_tokens=1024, new_tokens=128, k=4,
                              repeats=3, vocab=32000, dtype="auto"),
                         quick=dict(models="llama:2M,mamba2-attention:2M", prompt_tokens=64, new_tokens=12, k=3,
                                    repeats=1, vocab=256, dtype="float32"),
                         help=dict(models="comma list: llama (TinyLlama's 1.1B shape), PRESET:PARAMS (random "
                                          "weights), or a checkpoint directory (a trained model)",
                                   k="drafts per check", vocab="vocabulary of the random-weight models")),
    "release": Suite("a released-size Rodimus+ checkpoint: convert, then decode float / int8 / int4 beside a "
                     "Transformer++ (CPU)", "rodimus_release:release_suite",
                     dict(dir=os.path.join("runs", "rodimus-release"), contexts=(128, 4096), steps=16,
                          skip_write=False, weights="float,int8,int4", dtype="auto"),
                     help=dict(dir="scratch directory (several GB at the full size)",
                               skip_write="reuse the release directory already in --dir",
                               weights="weights to decode with (int4: groups of 64)")),
    "parallel": Suite("training tokens/s and peak memory per rank under DDP / FSDP2 / context parallel (torchrun)",
                      "parallel:parallel_suite",
                      dict(preset="mamba2-attention", d_model=256, n_layers=4, vocab_size=8192, batch=4, seq_len=512,
                           steps=6, warmup_steps=2, parallel="auto", dtype="float32", compile=False,
                           grad_checkpointing=False, context_parallel=False),
                      quick=dict(d_model=64, n_layers=2, vocab_size=512, batch=2, seq_len=64, steps=2, warmup_steps=1),
                      help=dict(batch="global batch, split over the ranks",
                                parallel="auto, ddp or fsdp",
                                context_parallel="split each sequence over all ranks instead of splitting the batch")),
}


# --- flags -----------------------------------------------------------------------------------------------------------
def shapes(text: str) -> tuple[tuple[int, int], ...]:
    """"4x512,1x2048" -> ((4, 512), (1, 2048))."""
    try:
        return tuple((int(b), int(t)) for b, t in (item.lower().split("x") for item in text.split(",")))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shapes are BATCHxLEN[,BATCHxLEN...], got {text!r}") from None


def ints(text: str) -> tuple[int, ...]:
    """"128,4096" -> (128, 4096)."""
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def flag_type(suite: Suite, key: str):
    """The argparse type of a settings key: that of its default, or `types[key]` ("shapes", a type)."""
    kind = suite.types.get(key, suite.defaults[key])
    if kind == "shapes" or (isinstance(kind, tuple) and kind and isinstance(kind[0], tuple)):
        return shapes
    if isinstance(kind, tuple):
        return ints
    if isinstance(kind, type):
        return kind
    return type(kind)


def flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def suite_keys() -> dict[str, list[str]]:
    """Every settings key -> the suites that take it."""
    keys = {}
    for name, suite in SUITES.items():
        for key in suite.defaults:
            keys.setdefault(key, []).append(name)
    return keys


def add_flags(parser: argparse.ArgumentParser, names=None) -> None:
    """The flags of the suites `names` (default all); a flag the parser has already (the instrument's --presets,
    --d-model, ...) is kept as it is: it must default to None so that "given" can be told."""
    for key, users in suite_keys().items():
        users = [n for n in users if names is None or n in names]
        if not users:
            continue
        suite = SUITES[users[0]]
        kind = flag_type(suite, key)
        helps = [SUITES[n].help[key] for n in users if key in SUITES[n].help]
        text = (helps[0] + "; " if helps else "") + "--suite " + ", ".join(
            f"{n}" + ("" if SUITES[n].defaults[key] in (None, False, "") else f" (default {_show(SUITES[n], key)})")
            for n in users)
        try:
            if kind is bool:
                parser.add_argument(flag(key), dest=key, action="store_true", default=None, help=text)
            else:
                parser.add_argument(flag(key), dest=key, type=kind, default=None, help=text)
        except argparse.ArgumentError:          # already the instrument's flag, with the same dest
            pass


def _show(suite: Suite, key: str) -> str:
    """A default as its flag would read it ("4x512", "128,4096", "3; quick 1")."""
    v = suite.defaults[key]
    if isinstance(v, tuple):
        return ",".join("x".join(map(str, x)) if isinstance(x, tuple) else str(x) for x in v)
    return str(v) + (f"; quick {suite.quick[key]}" if key in suite.quick else "")


# --- settings and the run --------------------------------------------------------------------------------------------
def given(args) -> dict:
    """The suite flags given on the command line (those not None), from a namespace or a dict."""
    values = vars(args) if isinstance(args, argparse.Namespace) else dict(args)
    return {k: values[k] for k in suite_keys() if values.get(k) is not None}


def settings(name: str, *, quick: bool = False, out: str | None = None, **flags) -> dict:
    """The suite's settings: its defaults, then its quick ones under `quick`, then `flags` (each one it declares)."""
    from ..errors import ConfigError
    if name not in SUITES:
        raise ConfigError(f"unknown suite {name!r}: choose from {', '.join(sorted(SUITES))}")
    suite = SUITES[name]
    bad = [k for k in flags if k not in suite.defaults]
    if bad:
        raise ConfigError(f"--suite {name} does not take {', '.join(flag(k) for k in bad)}")
    return {**suite.defaults, **(suite.quick if quick else {}), **flags, "quick": quick,
            "out": out or suite.out or os.path.join("runs", "bench", f"{name}.json")}


# the CPU flags a result records: the vector instruction sets the kernels (ours, llama.cpp's, PyTorch's) choose by
SIMD_FLAGS = ("sse4", "avx", "fma", "f16c", "amx", "asimd", "neon", "sve")


def cpu_kernel_path() -> str:
    """Which path hybridlm's CPU linears and decode steps take on this machine: the project's C++ kernels at the
    instruction-set level the run-time dispatch chose (`ops.cpu_kernels.level()`), or PyTorch's where the kernels
    are off or could not be built."""
    import warnings

    from ..ops import cpu_kernels
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")             # (the reason is printed by the run that uses them)
        if not cpu_kernels.available():
            return "PyTorch (the project's CPU kernels are off or could not be built)"
    return f"hybridlm C++ kernels, level {cpu_kernels.level()}"


def cpu_host() -> dict:
    """The CPU a result ran on: model, vector-instruction flags, and the kernel path hybridlm took there."""
    from ..dtypes import cpu_flags
    from ..runtime import cpu_model
    return {"cpu": cpu_model(), "cpu_flags": sorted(f for f in cpu_flags() if f.startswith(SIMD_FLAGS)),
            "cpu_kernels": cpu_kernel_path()}


def host_line(host: dict) -> str:
    """cpu_host() as one markdown line, the first of a CPU suite's table."""
    return (f"CPU: {host['cpu']}; flags: {' '.join(host['cpu_flags']) or 'none listed'}; hybridlm kernel path: "
            f"{host['cpu_kernels']}\n")


def meta(quick: bool) -> dict:
    """machine_meta() + cpu_host() (model, vector flags, kernel path) + quick + the transformers version (None when
    not installed)."""
    from ..runtime import machine_meta
    try:
        import transformers
    except ImportError:
        transformers = None
    return dict(machine_meta(), **cpu_host(), quick=bool(quick),
                transformers=transformers and transformers.__version__)


def run_suite(name: str, s: dict, log=print) -> int:
    """Run suite `name` with settings `s`; its JSON at s["out"] (and its markdown beside it). -> exit status."""
    res = SUITES[name].function()(s, log)
    if res is None:                             # a torchrun rank other than 0: rank 0 reports
        return 0
    markdown = res.pop("markdown", None)
    write_results(s["out"], {"suite": name, **res}, meta(s["quick"]))
    if markdown:
        path = os.path.splitext(s["out"])[0] + ".md"
        with open(path, "w") as f:
            f.write(markdown)
        print("\n" + markdown + f"\nmarkdown: {path}")
    return 0 if res.get("ok", True) else 1


def main(name: str, argv: list[str] | None = None) -> int:
    """`python -m hybridlm.bench.MODULE`: the suite's own flags, --quick and --out."""
    module = SUITES[name].run.split(":")[0]
    p = argparse.ArgumentParser(prog=f"python -m {__package__}.{module}", description=SUITES[name].what)
    p.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test in seconds")
    p.add_argument("--out", default=None, help="JSON results file (default runs/bench/NAME.json)")
    add_flags(p, [name])
    args = p.parse_args(argv)
    return run_suite(name, settings(name, quick=args.quick, out=args.out, **given(args)))
