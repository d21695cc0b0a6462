"""Each public-hybrid preset against its transformers twin, on the same weights, in one interleaved run.

    hybridlm bench --suite twins                                   # every preset in hf.common.TWINS
    hybridlm bench --suite twins --presets qwen3-next,bamba --d-model 256 --layers 4 --shapes 4x512 --out t.json

For each preset, `TWINS[preset](d_model, n_layers, vocab_size, max_seq_len)` gives the transformers config of the
same model; the transformers model is built from it with random weights and converted with `from_transformers`, so
both compute the same function (the converted logits are checked against transformers' before timing). Then
forward+backward steps (no optimizer) alternate ours / transformers, every preset's steps interleaved with the
others', and medians are reported as tokens/s and the ratio ours / transformers.
"""
import torch

from ..markdown import markdown_table
from . import measure as ms

NATIVE = ("transformer++", "mamba2")         # exactly transformers' Llama / Mamba-2 (hf/native.py)


def native_twin(preset: str, d: int, n: int, v: int, L: int, **overrides):
    """The transformers LlamaConfig / Mamba2Config of presets.get(preset, ...), by hf.native's mapping."""
    from ..models import presets
    from ..hf.native import native_config
    if preset == "mamba2":          # no attention: the preset's default rope acts on nothing; Mamba2Config has none
        overrides = dict(overrides, pos_embedding="none")
    cfg = presets.get(preset, n_layers=n, d_model=d, vocab_size=v, max_seq_len=L, **overrides)
    return native_config(cfg, eos_token_id=None, pad_token_id=None)


def twins() -> dict:
    """hf.common.TWINS (filled by the converters) plus the two pairs `--compare-hf` has always measured."""
    from ..hf import convert  # noqa: F401  (importing the converters registers their twins)
    from ..hf.common import TWINS
    for preset in NATIVE:
        TWINS.setdefault(preset, lambda d, n, v, L, preset=preset: native_twin(preset, d, n, v, L))
    return TWINS


def build_twin(name: str, *, d_model: int, n_layers: int, vocab_size: int, max_seq_len: int, seed: int = 0):
    """(transformers model, our converted model), same weights, in train mode; raises if their logits differ."""
    from transformers import AutoModelForCausalLM

    from ..hf.convert import from_transformers
    from ..hf.kernels import torch_fallback_on_cpu
    torch_fallback_on_cpu()          # FLA installed: transformers' hybrids would call its kernels on CPU tensors
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(twins()[name](d_model, n_layers, vocab_size, max_seq_len)).float().eval()
    hf.config.use_cache = False      # training steps; transformers' hybrid caches also refuse models without attention
    ours = from_transformers(hf)
    ids = torch.randint(0, vocab_size, (1, 16), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        diff = (ours(ids).logits - hf(ids).logits).abs().max().item()
    if diff > 1e-3:
        raise RuntimeError(f"{name}: converted logits differ from transformers' by {diff:.3g}")
    return hf.train(), ours.train()


def run(presets: list[str], *, d_model: int = 256, n_layers: int = 4, vocab_size: int = 8192,
        shapes=((4, 512),), repeats: int = 5, log=print) -> dict:
    pairs = {}
    max_len = max(T for _, T in shapes)
    for name in presets:
        pairs[name] = build_twin(name, d_model=d_model, n_layers=n_layers, vocab_size=vocab_size, max_seq_len=max_len)
    rows = []
    for B, T in shapes:
        timed = ms.run_cases(ms.train_cases({n: {"ours": o, "hf": h} for n, (h, o) in pairs.items()}, B, T,
                                            vocab_size, seed=B * 7919 + T), repeats)
        for name, (hf, ours) in pairs.items():
            o, h = ms.pick(timed, name, "ours"), ms.pick(timed, name, "hf")
            row = dict(preset=name, hf_class=type(hf).__name__, layout=ours.config.layout, batch=B, seq_len=T,
                       parameters=ours.num_parameters(), ours_tokens_per_s=o["per_s"], hf_tokens_per_s=h["per_s"],
                       ratio=o["per_s"] / h["per_s"])
            log(f"  {name:16s} {B}x{T}: ours {o['per_s']:8.0f} tok/s  {row['hf_class']:28s} {h['per_s']:8.0f} "
                f"tok/s  ratio {row['ratio']:.2f}  ({ours.config.layout})")
            rows.append(row)
    return {"train": rows, "settings": dict(d_model=d_model, n_layers=n_layers, vocab_size=vocab_size,
                                            shapes=[list(s) for s in shapes], repeats=repeats),
            "threads": torch.get_num_threads()}


def to_markdown(res: dict) -> str:
    """The results as a markdown table (docs/results/twins.md)."""
    st = res["settings"]
    lines = [f"Training step (forward + backward, no optimizer) of each preset and its transformers twin on the same "
             f"weights: d_model {st['d_model']}, {st['n_layers']} transformers layers, vocab {st['vocab_size']}, "
             f"float32, {res['threads']} threads, medians of {st['repeats']} interleaved repeats.", ""]
    lines += markdown_table(["preset", "transformers class", "layout", "batch×T", "parameters", "ours tok/s",
                             "transformers tok/s", "ratio"],
                            [[f"`{r['preset']}`", f"`{r['hf_class']}`", f"`{r['layout']}`",
                              f"{r['batch']}×{r['seq_len']}", f"{r['parameters']:,}", f"{r['ours_tokens_per_s']:,.0f}",
                              f"{r['hf_tokens_per_s']:,.0f}", f"{r['ratio']:.2f}"] for r in res["train"]])
    return "\n".join(lines) + "\n"
