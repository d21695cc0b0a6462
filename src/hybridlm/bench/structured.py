"""The cost of constrained decoding (`hybridlm bench --suite serve --schema FILE|builtin`): per decode step, the
grammar mask (each row's matcher fills its bitmask, the mask is applied to the logits [B, V], each matcher accepts
its token) beside the plain decode step of the same model at the same batch, at each batch size of --concurrency;
and the compile time of each schema against the tokenizer's vocabulary (a fresh compiler, no cache).

The mask runs on the CPU whatever the model's device (xgrammar's matchers are CPU code); the decode step is the
model's one-token forward over a cache prefilled with 64 tokens. The target: mask <= 10% of the decode step.
"""
import json
import time

import torch

from .measure import clock, median, prefilled

# representative schemas: a flat object, nested objects with arrays and enums, a tool-call-like object
BUILTIN = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "email": {"type": "string"}, "active": {"type": "boolean"}},
             "required": ["name", "age", "email", "active"]},
    "nested": {"type": "object", "properties": {
        "order": {"type": "object", "properties": {
            "id": {"type": "string"}, "status": {"enum": ["new", "paid", "shipped", "done"]},
            "items": {"type": "array", "items": {"type": "object", "properties": {
                "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1},
                "price": {"type": "number"}}, "required": ["sku", "qty", "price"]}}},
            "required": ["id", "status", "items"]},
        "notes": {"type": "array", "items": {"type": "string"}}}, "required": ["order"]},
    "tool": {"type": "object", "properties": {"name": {"const": "search"}, "arguments": {
        "type": "object", "properties": {"query": {"type": "string"}, "top_k": {"type": "integer"},
                                         "lang": {"enum": ["en", "de", "fr", "ja"]}},
        "required": ["query"]}}, "required": ["name", "arguments"]},
}


def schemas_of(arg: str) -> dict:
    """{name: schema} of --schema: "builtin" or a JSON schema file."""
    if arg == "builtin":
        return dict(BUILTIN)
    with open(arg) as f:
        return {arg: json.load(f)}


def _own_sources():
    """This package's Python sources, the texts a `bpe:N` --schema-tokenizer is trained on (no download)."""
    import pathlib
    for path in sorted(pathlib.Path(__file__).resolve().parents[1].rglob("*.py")):
        yield path.read_text()


def compile_times(tok, vocab_size: int, schemas: dict, repeats: int = 3) -> dict:
    """Seconds to compile each schema with a fresh compiler (median of `repeats`)."""
    from ..models.structured import Grammars, Spec
    out = {}
    for name, schema in schemas.items():
        times = []
        for _ in range(repeats):
            g = Grammars(tok, vocab_size)
            t = time.perf_counter()
            g.compile(Spec.json_schema(schema))
            times.append(time.perf_counter() - t)
        out[name] = median(times)
    return out


def mask_step(grammars, spec, batch: int, vocab_size: int, seed: int = 0):
    """A callable that runs one constrained step's mask work for `batch` rows on random logits [B, V]: fill and
    apply every row's mask, pick each row's token (the most likely allowed one), accept it; a finished row's
    matcher starts over (untimed)."""
    from ..models.structured import mask_logits
    rows = [grammars.constraint(spec) for _ in range(batch)]
    logits = torch.randn(batch, vocab_size, generator=torch.Generator().manual_seed(seed))

    def setup():
        for i, c in enumerate(rows):
            if c.finished:
                rows[i] = grammars.constraint(spec)
        return logits.clone()

    def run(x):
        tokens = mask_logits(x, rows).argmax(-1).tolist()
        for c, t in zip(rows, tokens):
            c.accept(t)
    return setup, run


def structured_cost(s: dict, log=print) -> dict:
    """The suite's --schema mode: for each preset, decode step vs mask per batch size, and compile times."""
    from ..data.tokenizer import load_tokenizer
    from ..models import CausalLM, presets
    from ..models.sizing import fit_params, parse_count
    from ..models.structured import Grammars, Spec
    tok = load_tokenizer(s["schema_tokenizer"] or "byte", texts=_own_sources())
    schemas = schemas_of(s["schema"])
    out = {"schemas": list(schemas), "tokenizer": s["schema_tokenizer"] or "byte", "vocab_size": tok.vocab_size,
           "presets": {}}
    out["compile_s"] = compile_times(tok, tok.vocab_size, schemas)
    for name, t in out["compile_s"].items():
        log(f"compile {name}: {1e3 * t:.1f} ms")
    spec = Spec.json_schema(next(iter(schemas.values())))
    grammars = Grammars(tok, tok.vocab_size)
    for preset in s["presets"].split(","):
        over = {"vocab_size": tok.vocab_size, "max_seq_len": 4096}
        if s["n_layers"]:
            over["n_layers"] = s["n_layers"]
        if s["d_model"] or not s["params"]:
            cfg = presets.get(preset, **over, **({"d_model": s["d_model"]} if s["d_model"] else {}))
        else:
            cfg, _ = fit_params(lambda d: presets.get(preset, **over, d_model=d), parse_count(s["params"]),
                                range(64, 16385, 64), what="d_model")
        torch.manual_seed(0)
        model = CausalLM(cfg).eval()
        from ..models.quantize import use_cpu_kernels_
        use_cpu_kernels_(model)
        rows = {}
        for b in s["concurrency"]:
            step, _ = prefilled(model, 64, batch=b)
            times = clock({"decode": step, "mask": mask_step(grammars, spec, b, tok.vocab_size)}, s["schema_steps"], 2)
            d, m = median(times["decode"]), median(times["mask"])
            rows[b] = {"decode_ms": 1e3 * d, "mask_ms": 1e3 * m, "mask_fraction": m / d}
            log(f"{preset:<18} batch {b:<3} decode {1e3 * d:8.2f} ms  mask {1e3 * m:7.3f} ms  ({100 * m / d:.1f}% "
                f"of the step)")
        out["presets"][preset] = {"params": model.num_parameters(), "batches": rows}
    worst = max(r["mask_fraction"] for p in out["presets"].values() for r in p["batches"].values())
    out["ok"] = True
    out["markdown"] = _markdown(out, worst)
    return out


def _markdown(out: dict, worst: float) -> str:
    lines = [f"Constrained decoding, tokenizer {out['tokenizer']} ({out['vocab_size']} ids): the grammar mask per "
             f"decode step beside the step (worst {100 * worst:.1f}%; target <= 10%).", "",
             "| preset | batch | decode step (ms) | mask (ms) | mask / step |", "|---|---|---|---|---|"]
    for preset, p in out["presets"].items():
        for b, r in p["batches"].items():
            lines.append(f"| {preset} | {b} | {r['decode_ms']:.2f} | {r['mask_ms']:.3f} | "
                         f"{100 * r['mask_fraction']:.1f}% |")
    lines += ["", "| schema | compile (ms) |", "|---|---|"]
    lines += [f"| {n} | {1e3 * t:.1f} |" for n, t in out["compile_s"].items()]
    return "\n".join(lines) + "\n"
