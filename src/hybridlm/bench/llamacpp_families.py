"""The hybrid families llama.cpp runs, beside hybridlm on the same weights: `hybridlm bench --suite llamacpp
--families qwen3-next,kimi-linear,...`.

Each family is built as a random ~1B model by transformers' own class with its released layer pattern (modest expert
counts), saved as a transformers directory with a small BPE tokenizer (both runtimes are fed token ids), then
 - llama.cpp: its own `convert_hf_to_gguf.py` writes a bf16 GGUF, its quantizer Q8_0 / Q4_0 from it;
 - hybridlm: `convert --from-hf` on the same directory (hf/directory.py), run as `hybridlm generate` runs it.
The directory gets the input fixes llama.cpp's converter needs (none changes a number: see `_fix_dir`); both
runtimes read the fixed directory. Round by round, every runtime in a fresh process (bench/llamacpp.py's jobs):
prefill and decode tok/s, the logits after the prompt compared (bf16 against bf16) and the greedy tokens that agree.
"""
import json
import os
import time

import torch

from . import measure as ms
from .llamacpp_jobs import LLAMA_FTYPES, PAIRS, convert_to_gguf, hybridlm_job, llamacpp_job, quantize_gguf

# name -> (transformers config class, its arguments at ~1B, at --quick size). Vocabulary 32,000 for all but Mamba-2
# (llama.cpp pads Mamba vocabularies to 16): the weights a decode step reads are the layers', as released.
_LLAMA = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22, num_attention_heads=32,
              num_key_value_heads=4)                                                   # TinyLlama's shape
_NEMOTRON_8B = "M-M-M-MM-M-M-M*-M-M-M*-M-M-M-M*-M-M-M-M*-M-MM-M-M-M-M-M-"            # Nemotron-H 8B's 52 layers
FAMILIES = {
    "llama": ("LlamaConfig", _LLAMA,
              dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)),
    "mamba2": ("Mamba2Config", dict(hidden_size=2048, num_hidden_layers=48, state_size=128, expand=2, head_dim=64,
                                    num_heads=64, n_groups=1, vocab_size=50288),
               dict(hidden_size=128, num_hidden_layers=2, state_size=16, expand=2, head_dim=16, num_heads=16,
                    n_groups=1, vocab_size=512)),
    "qwen3-next": ("Qwen3NextConfig",                # 3 Gated DeltaNet : 1 gated attention, 32 experts top-4
                   dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=8, num_key_value_heads=2,
                        head_dim=256, linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=128,
                        linear_value_head_dim=128, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=512,
                        shared_expert_intermediate_size=512, intermediate_size=2048),
                   dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                        shared_expert_intermediate_size=64, intermediate_size=256)),
    "kimi-linear": ("KimiLinearConfig",              # 3 KDA : 1 MLA, a dense first layer, 32 experts top-4
                    dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=24, num_attention_heads=16,
                         num_key_value_heads=16, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                         qk_nope_head_dim=128, v_head_dim=128, linear_head_dim=128, linear_num_heads=16,
                         layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
                         mlp_layer_types=["dense"] + ["sparse"] * 23, moe_intermediate_size=512,
                         num_local_experts=32, num_experts_per_tok=4),
                    dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=4, kv_lora_rank=64, q_lora_rank=None, qk_rope_head_dim=16,
                         qk_nope_head_dim=32, v_head_dim=32, linear_head_dim=32, linear_num_heads=4,
                         layer_types=["linear_attention"] * 3 + ["full_attention"],
                         mlp_layer_types=["dense"] + ["sparse"] * 3, moe_intermediate_size=64, num_local_experts=8,
                         num_experts_per_tok=2)),
    "nemotron-h": ("NemotronHConfig",                # Mamba-2 / attention / squared-ReLU MLP in the 8B's pattern
                   dict(hidden_size=1536, hybrid_override_pattern=_NEMOTRON_8B, num_attention_heads=12,
                        num_key_value_heads=2, head_dim=128, intermediate_size=6144, mamba_num_heads=48,
                        mamba_head_dim=64, n_groups=8, ssm_state_size=128, chunk_size=128),
                   dict(hidden_size=128, hybrid_override_pattern="M-M*-", num_attention_heads=4,
                        num_key_value_heads=2, head_dim=32, intermediate_size=256, mamba_num_heads=8,
                        mamba_head_dim=32, n_groups=2, ssm_state_size=16, chunk_size=16)),
    "granite-4": ("GraniteMoeHybridConfig",          # Granite-4.0-H-micro's shape: dense, attention 4 of 40
                  dict(hidden_size=1024, shared_intermediate_size=4096, intermediate_size=4096, num_hidden_layers=40,
                       layer_types=["full_attention" if i % 10 == 9 else "mamba" for i in range(40)],
                       num_attention_heads=8, num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0,
                       mamba_n_heads=32, mamba_d_head=64, mamba_n_groups=1, mamba_d_state=128,
                       mamba_chunk_size=128, tie_word_embeddings=True),
                  dict(hidden_size=128, shared_intermediate_size=256, intermediate_size=256, num_hidden_layers=3,
                       layer_types=["mamba", "full_attention", "mamba"], num_attention_heads=4,
                       num_key_value_heads=2, num_local_experts=0, num_experts_per_tok=0, mamba_n_heads=8,
                       mamba_d_head=32, mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16,
                       tie_word_embeddings=True)),
    "falcon-h1": ("FalconH1Config",                  # attention and Mamba-2 side by side in every layer
                  dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=12,
                       num_key_value_heads=2, head_dim=128, mamba_d_ssm=3072, mamba_n_heads=48, mamba_d_head=64,
                       mamba_n_groups=1, mamba_d_state=128, mamba_d_conv=4, mamba_chunk_size=128),
                  dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=32, mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                       mamba_n_groups=1, mamba_d_state=16, mamba_d_conv=4, mamba_chunk_size=16)),
    "lfm2": ("Lfm2Config",                           # LFM2-1.2B's pattern: gated short convolutions, 6 attention
             dict(hidden_size=2048, intermediate_size=12288, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, block_auto_adjust_ff_dim=True, block_ffn_dim_multiplier=1.0,
                  block_multiple_of=256,
                  layer_types=["full_attention" if i in (2, 5, 8, 10, 12, 14) else "conv" for i in range(16)]),
             dict(hidden_size=128, intermediate_size=384, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, layer_types=["conv", "full_attention", "conv"])),
    "jamba": ("JambaConfig",                         # Mamba-1 with attention every 8th layer, 16 experts top-2
              dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
                   num_key_value_heads=4, num_experts=16, num_experts_per_tok=2, attn_layer_period=8,
                   attn_layer_offset=4, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=16,
                   mamba_expand=2, mamba_d_conv=4),
              dict(hidden_size=128, intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=4,
                   attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, mamba_d_state=8,
                   mamba_expand=2, mamba_d_conv=4)),
    "bamba": ("BambaConfig",                         # Mamba-2 with 3 attention layers of 32
              dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=32, num_attention_heads=12,
                   num_key_value_heads=4, attn_layer_indices=[9, 18, 27], mamba_n_heads=48, mamba_d_head=64,
                   mamba_n_groups=1, mamba_d_state=128, mamba_chunk_size=128),
              dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                   num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=8, mamba_d_head=32,
                   mamba_n_groups=1, mamba_d_state=16, mamba_chunk_size=16)),
}
VOCAB = 32000
RUNTIMES = ("bf16", "q8_0", "q4_0")


def family_config(name: str, quick: bool = False):
    """The transformers config of family `name` (~1B, or tiny with `quick`)."""
    import transformers
    from ..errors import ConfigError
    if name not in FAMILIES:
        raise ConfigError(f"unknown family {name!r}: choose from {', '.join(FAMILIES)}")
    cls, full, tiny = FAMILIES[name]
    kw = dict(vocab_size=512 if quick else VOCAB, max_position_embeddings=4096, bos_token_id=None,
              eos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    kw.update(tiny if quick else full)
    return getattr(transformers, cls)(**kw)


def _fix_dir(name: str, d: str) -> None:
    """The input fixes llama.cpp's converter needs on a transformers 5 directory (none changes a number)."""
    path = os.path.join(d, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    if name == "falcon-h1":                  # the converter reads head_dim, which transformers derives and drops
        cfg.setdefault("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    if name == "nemotron-h" and "E" not in cfg.get("hybrid_override_pattern", ""):
        for k in ("num_experts_per_tok", "n_routed_experts", "n_group", "topk_group"):   # written always: read as MoE
            cfg.pop(k, None)
    if name == "nemotron-h":                 # the converter reads the released pattern string ("M-M*-"); transformers
        letters = {"linear_attention": "M", "mamba": "M", "full_attention": "*", "attention": "*", "mlp": "-",
                   "moe": "E"}                                   # 5 writes it as a list of its own names
        cfg["hybrid_override_pattern"] = "".join(letters[t] for t in cfg.pop("layers_block_type"))
        cfg["num_hidden_layers"] = len(cfg["hybrid_override_pattern"])
    if name == "granite-4":                  # the converter knows the released names of the layer types
        cfg["layer_types"] = ["attention" if t.endswith("attention") and t != "linear_attention" else "mamba"
                              for t in cfg["layer_types"]]
    if name == "kimi-linear":                # the released config's keys, which the converter and quantizer read
        cfg.setdefault("moe_router_activation_func", "sigmoid")
        types = cfg["layer_types"]
        cfg.setdefault("linear_attn_config", {
            "full_attn_layers": [i + 1 for i, t in enumerate(types) if t == "full_attention"],
            "kda_layers": [i + 1 for i, t in enumerate(types) if t != "full_attention"],
            "head_dim": cfg["linear_head_dim"], "num_heads": cfg["linear_num_heads"],
            "short_conv_kernel_size": cfg.get("linear_conv_kernel_dim", 4)})
        dense = cfg["mlp_layer_types"]
        cfg.setdefault("first_k_dense_replace", next((i for i, t in enumerate(dense) if t != "dense"), len(dense)))
    if name == "bamba":                      # rotary dims as transformers applies them (partial RoPE)
        head = cfg["hidden_size"] // cfg["num_attention_heads"]
        cfg.setdefault("attn_rotary_emb", int(head * cfg.get("partial_rotary_factor", 0.5)))
    with open(path + ".tmp", "w") as f:
        json.dump(cfg, f, indent=2)
    os.replace(path + ".tmp", path)
    if name == "kimi-linear":                # the dense first layer: `mlp.*` as released, not `block_sparse_moe.*`
        _rename_tensors(d, lambda k: k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."))


def _rename_tensors(d: str, rename) -> None:
    from safetensors.torch import load_file, save_file
    for fn in sorted(os.listdir(d)):
        if fn.endswith(".safetensors"):
            path = os.path.join(d, fn)
            sd = load_file(path)
            save_file({rename(k): v for k, v in sd.items()}, path + ".tmp", metadata={"format": "pt"})
            os.replace(path + ".tmp", path)
    index = os.path.join(d, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            idx = json.load(f)
        idx["weight_map"] = {rename(k): v for k, v in idx["weight_map"].items()}
        with open(index + ".tmp", "w") as f:
            json.dump(idx, f, indent=2)
        os.replace(index + ".tmp", index)


def build_family(name: str, root: str, src: str, quick: bool = False, runtimes=RUNTIMES) -> dict:
    """Family `name` as a transformers directory, hybridlm's checkpoint of it and llama.cpp's GGUFs of it at
    `runtimes` (made once, reused when present; `src`: llama.cpp's sources).
    -> {"hf", "checkpoint", "gguf": {runtime: path}, "parameters", "vocab"}."""
    import transformers
    from ..data.tokenizer import BPETokenizer
    from ..hf.directory import convert_from_hf
    d = os.path.join(root, name)
    hf, run = os.path.join(d, "hf"), os.path.join(d, "hybridlm")
    cfg = family_config(name, quick)
    if not os.path.isfile(os.path.join(hf, "config.json")):
        torch.manual_seed(0)
        model = getattr(transformers, FAMILIES[name][0].replace("Config", "ForCausalLM"))(cfg).eval()
        model = model.to(torch.bfloat16)     # the weights both runtimes read, bf16 as released
        tmp = hf + ".tmp"
        model.save_pretrained(tmp)
        del model
        with open(__file__) as f:
            BPETokenizer.train([f.read()], 512).save(tmp)
        _fix_dir(name, tmp)
        os.replace(tmp, hf)
    if not os.path.isdir(run):
        convert_from_hf(hf, run)
    ggufs = {rt: os.path.join(d, f"{rt}.gguf") for rt in ("bf16", *runtimes)}
    for rt in ("bf16", "f32"):
        if rt in ggufs and not os.path.isfile(ggufs[rt]):
            convert_to_gguf(hf, ggufs[rt], rt, src, extra=["--no-mtp"] if name == "qwen3-next" else [],
                            raw_config=name == "nemotron-h")     # transformers adds MoE keys it has no use for
    for rt, ftype in LLAMA_FTYPES.items():
        if rt in ggufs and not os.path.isfile(ggufs[rt]):
            quantize_gguf(ggufs["bf16"], ggufs[rt], ftype)
    with torch.device("meta"):
        params = sum(p.numel() for p in getattr(transformers, FAMILIES[name][0].replace("Config", "ForCausalLM"))(
            cfg).parameters())
    return {"hf": hf, "checkpoint": run, "gguf": ggufs, "parameters": params, "vocab": cfg.vocab_size}


def families_suite(s: dict, log=print) -> dict:
    """`--suite llamacpp --families ...`: every family built (build_family), then llama.cpp and hybridlm at each of
    `runtimes` in fresh processes, interleaved round by round. Settings (registry.py): families ("all" or a comma
    list), prompt, new, rounds, runtimes, dir, llamacpp_src, quick. -> {"rows": [...], "families": {...}}."""
    from ..dtypes import cpu_flags
    from ..errors import ConfigError
    from .registry import cpu_host
    families = list(FAMILIES) if s["families"] == "all" else s["families"].split(",")
    runtimes = tuple(s["runtimes"].split(","))
    bad = [rt for rt in runtimes if rt not in PAIRS]
    if bad:
        raise ConfigError(f"--runtimes {','.join(bad)}: the families run {', '.join(PAIRS)}")
    for name in families:
        family_config(name)                          # one clear error for a misspelt family, before any work
    prompt, new, quick = s["prompt"], s["new"], s["quick"]
    threads = torch.get_num_threads()
    out = {"settings": dict(s), "threads": threads, **cpu_host(),
           "cpu_bf16": sorted({"amx_bf16", "avx512_bf16"} & cpu_flags()), "families": {}, "rows": []}
    for name in families:
        t = time.perf_counter()
        made = build_family(name, os.path.join(s["dir"], "families"), s["llamacpp_src"], quick, runtimes)
        log(f"{name}: {made['parameters'] / 1e9:.2f}B parameters ({time.perf_counter() - t:.0f} s to build)")
        runs = {k: [] for rt in runtimes for k in (rt, PAIRS[rt])}
        job = dict(vocab=made["vocab"], prompt=prompt, new=new)
        for _ in range(s["rounds"]):                 # interleaved: every configuration once per round
            for rt in runtimes:
                runs[rt].append(ms.fresh(llamacpp_job, gguf=made["gguf"][rt], threads=threads, **job))
                runs[PAIRS[rt]].append(ms.fresh(hybridlm_job, checkpoint=made["checkpoint"], weights=PAIRS[rt],
                                                **job))
        ref, us = runs[runtimes[0]][0], runs[PAIRS[runtimes[0]]][0]
        a, b = torch.tensor(ref["last_logits"]), torch.tensor(us["last_logits"])
        agree = {"max_abs_logit_diff": float((a - b).abs().max()), "logit_scale": float(a.abs().max()),
                 "same_first_token": int(a.argmax()) == int(b.argmax()),
                 "greedy_tokens_agreeing": next((i for i, (x, y) in enumerate(zip(ref["tokens"], us["tokens"]))
                                                 if x != y), len(ref["tokens"]))}
        out["families"][name] = dict(parameters=made["parameters"], agreement=agree)
        log(f"  {runtimes[0]} logits after the prompt, llama.cpp vs hybridlm: max |diff| "
            f"{agree['max_abs_logit_diff']:.3f} (largest {agree['logit_scale']:.2f}); greedy tokens agreeing "
            f"{agree['greedy_tokens_agreeing']} of {new}")
        for rt in runtimes:
            theirs, ours = runs[rt], runs[PAIRS[rt]]
            row = {"family": name, "llamacpp": rt, "hybridlm": PAIRS[rt], "parameters": made["parameters"]}
            for key in ("decode_tokens_per_s", "prefill_tokens_per_s"):
                row[key] = {"llamacpp": [r[key] for r in theirs], "hybridlm": [r[key] for r in ours]}
                row[key.split("_")[0] + "_ratio"] = ms.median(row[key]["hybridlm"]) / ms.median(row[key]["llamacpp"])
            out["rows"].append(row)
            out["cpu_kernels"] = ours[0].get("kernels", out["cpu_kernels"])     # the path the hybridlm run took
            log(f"  {rt:>5} / {PAIRS[rt]:<8} decode {ms.median(row['decode_tokens_per_s']['llamacpp']):6.2f} vs "
                f"{ms.median(row['decode_tokens_per_s']['hybridlm']):6.2f} tok/s ({row['decode_ratio']:.2f}x); "
                f"prefill {ms.median(row['prefill_tokens_per_s']['llamacpp']):6.1f} vs "
                f"{ms.median(row['prefill_tokens_per_s']['hybridlm']):6.1f} ({row['prefill_ratio']:.2f}x)")
    out["markdown"] = families_table(out)
    return out


def families_table(res: dict) -> str:
    """The suite's result as markdown: the host (CPU, flags, kernel path), then one row per family and runtime pair,
    medians over the rounds."""
    from ..markdown import markdown_table
    from .registry import host_line
    med = ms.median
    rows = [[r["family"], f"{r['parameters'] / 1e9:.2f}B", f"{r['llamacpp']} / {r['hybridlm']}",
             f"{med(r['decode_tokens_per_s']['llamacpp']):.1f}", f"{med(r['decode_tokens_per_s']['hybridlm']):.1f}",
             f"{r['decode_ratio']:.2f}x", f"{med(r['prefill_tokens_per_s']['llamacpp']):.0f} / "
             f"{med(r['prefill_tokens_per_s']['hybridlm']):.0f}", f"{r['prefill_ratio']:.2f}x"] for r in res["rows"]]
    return host_line(res) + "\n" + "\n".join(markdown_table(
        ["family", "params", "llama.cpp / hybridlm", "decode llama.cpp", "decode hybridlm", "decode ratio",
         "prefill tok/s", "prefill ratio"], rows)) + "\n"
