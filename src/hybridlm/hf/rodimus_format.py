"""Released Rodimus checkpoints (codefuse-ai/rodimus remote-code format) -> a hybridlm checkpoint.

    convert_rodimus_dir("Rodimus-Plus-1.6B-Base", "runs/rodimus")   # -> "runs/rodimus/checkpoint"

The source directory holds `config.json` (`model_type` "rodimus", `block_type` "rodimus" | "rodimus_plus",
`mixer_cfg`, `attn_cfg`), safetensors weights (`model.safetensors`, or shards listed in
`model.safetensors.index.json`) and a transformers tokenizer. Tensors are read one at a time from the memory-mapped
shards and written straight into the output file, so at most one tensor is held in memory (never a full copy).
Every tensor of the source must be used and every expected one present with the shape config.json implies; any
other case, and any option whose function hybridlm does not compute, raises one error naming the file, tensor or
option. Their conventions, mapped exactly (read from the authors' released code):
  - `attn_cfg.window_size = W` is flash-attn's window (W // 2, 0): each query sees W // 2 + 1 keys, so
    swa_window = W // 2 + 1 (a missing or non-positive W is full causal attention: layout letter A);
  - keys and values are shared across query heads tiled as `(n h)` (query head j reads key j % num_heads_k and value
    j % num_heads_v); hybridlm groups heads contiguously, so query and value heads are permuted once here;
  - the GLU halves are `[x | gate]` (ours `[gate | up]`), the gate bias is `[g | τ]`, widths are align8(int(d·ratio)).
Numerics that differ by rounding only: their SW-SKA always runs in bf16 and their residual stream in float32.
"""
import json
import math
import os
import shutil

import torch
from torch import Tensor

from ..errors import CheckpointError, ConfigError, HybridLMError
from ..jsonio import read_json_object
from ..models.causal_lm import CausalLM
from ..models.config import ModelConfig, quiet_unread

INDEX_FILE, WEIGHTS_FILE = "model.safetensors.index.json", "model.safetensors"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja")
# options their blocks accept: name -> what hybridlm does with it
_MIXER_KEYS = {"d_conv", "expand_ratio", "mem_size", "input_gate_low_rank", "mode", "normalize_epsilon",
               "post_norm_epsilon"}
_ATTN_KEYS = {"num_heads", "num_heads_k", "num_heads_v", "window_size", "softmax_scale", "rotary_emb_dim",
              "rotary_emb_base", "rotary_emb_scale_base", "rotary_emb_interleaved", "ffn_expand_ratio"}
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


def _align8(x: int) -> int:
    return -(-x // 8) * 8


def _refuse(path: str, option: str, value, why: str = ""):
    raise ConfigError(f"{path}: {option} = {value!r} is not supported{': ' + why if why else ''}")


def read_config(src_dir: str) -> dict:
    path = os.path.join(src_dir, "config.json")
    hf = read_json_object(path, CheckpointError)
    if hf.get("model_type") != "rodimus":
        mt = hf.get("model_type")
        raise ConfigError(f"{path}: model_type {mt!r} is not a Rodimus checkpoint (expected 'rodimus')")
    return hf


def rodimus_config(hf: dict, path: str = "config.json") -> dict:
    """ModelConfig fields computing the function of their `RodimusForCausalLM` with config `hf`."""
    block = hf.get("block_type", "rodimus")
    if block not in ("rodimus", "rodimus_plus"):
        _refuse(path, "block_type", block, "expected 'rodimus' or 'rodimus_plus'")
    d, mixer = int(hf.get("d_model", 2048)), dict(hf.get("mixer_cfg") or {})
    for k in sorted(set(mixer) - _MIXER_KEYS):
        _refuse(path, f"mixer_cfg.{k}", mixer[k])
    if mixer.get("normalize_epsilon") not in (None, 1e-12):
        _refuse(path, "mixer_cfg.normalize_epsilon", mixer["normalize_epsilon"], "the key L2 norm uses 1e-12")
    n = int(mixer.get("mem_size", 64))
    rank = mixer.get("input_gate_low_rank", "auto")
    rank = max(d // 64, 16) if rank in ("auto", None) else int(float(rank))
    f = dict(layout=f"R*{int(hf.get('n_layer', 24))}", vocab_size=int(hf.get("vocab_size", 50277)), d_model=d,
             max_seq_len=int(hf.get("max_position_embeddings", 2048)),
             tie_embeddings=bool(hf.get("tie_word_embeddings", False)), norm="rms",
             norm_eps=float(hf.get("norm_epsilon", 1e-5)), pos_embedding="rope",
             embed_scale=math.sqrt(n) if hf.get("use_scale_embedding") else 1.0,
             embed_norm=bool(hf.get("use_norm_embedding", False)),
             rodimus_d_state=n, d_conv=int(mixer.get("d_conv", 4)), rodimus_rank=rank,
             rodimus_d_inner=_align8(int(d * float(mixer.get("expand_ratio", 2)))))
    if block == "rodimus_plus":
        f.update(_attention_fields(dict(hf.get("attn_cfg") or {}), d, path))
        f["layout"] = f"[R{'W' if f.get('swa_window') else 'A'}M]*{int(hf.get('n_layer', 24))}"
    return f


def _attention_fields(attn: dict, d: int, path: str) -> dict:
    for k in sorted(set(attn) - _ATTN_KEYS):
        _refuse(path, f"attn_cfg.{k}", attn[k])
    H = attn.get("num_heads") or d // 128
    Hk, Hv = attn.get("num_heads_k") or H, attn.get("num_heads_v") or H
    if d % H:
        _refuse(path, "attn_cfg.num_heads", H, f"d_model {d} must be a multiple of it")
    for name, h in (("num_heads_k", Hk), ("num_heads_v", Hv)):
        if not 1 <= h <= H or H % h:
            _refuse(path, f"attn_cfg.{name}", h, f"it must divide num_heads ({H})")
    if Hv % Hk:
        _refuse(path, "attn_cfg.num_heads_k", Hk, f"hybridlm shares each key across a group of value heads, so it must "
                f"divide num_heads_v ({Hv})")
    scale = attn.get("softmax_scale")
    if isinstance(scale, str):  # "norm": cosine attention with a per-head temperature
        _refuse(path, "attn_cfg.softmax_scale", scale, "only the default 1/√head_dim")
    # a numeric softmax_scale is accepted: their attention never passes it on (it always uses 1/√head_dim)
    if attn.get("rotary_emb_scale_base") is not None:
        _refuse(path, "attn_cfg.rotary_emb_scale_base", attn["rotary_emb_scale_base"], "XPos is not implemented")
    hd = d // H
    rope = attn.get("rotary_emb_dim", -1)
    rope = hd if rope is None or rope < 0 else int(rope)
    if rope % 2 or rope > hd:
        _refuse(path, "attn_cfg.rotary_emb_dim", rope, f"it must be even and at most the head size {hd}")
    window = attn.get("window_size")
    return dict(n_heads=H, n_kv_heads=Hv, n_k_heads=Hk, head_dim=hd, rope_dim=rope,
                rope_base=float(attn.get("rotary_emb_base", 10000.0)),
                rope_interleaved=bool(attn.get("rotary_emb_interleaved", False)),
                swa_window=int(window) // 2 + 1 if window and window > 0 else None,
                mlp_hidden=_align8(int(d * float(attn.get("ffn_expand_ratio", 4 / 3)))), mlp_gated=True,
                mlp_act="silu")


def model_config(hf: dict, path: str = "config.json") -> ModelConfig:
    fields = rodimus_config(hf, path)
    if fields.get("swa_window") is None:
        fields.pop("swa_window", None)
    try:
        with quiet_unread():
            return ModelConfig(**fields)
    except HybridLMError as e:
        raise ConfigError(f"{path}: {e}") from None


# --- reading: their tensors one at a time ---------------------------------------------------------------------
class _Shards:
    """The source tensors by name, memory-mapped from their safetensors files; records which ones were read."""

    def __init__(self, src_dir: str):
        from safetensors import safe_open
        index, single = os.path.join(src_dir, INDEX_FILE), os.path.join(src_dir, WEIGHTS_FILE)
        if os.path.exists(index):
            try:
                with open(index) as f:
                    wmap = json.load(f)["weight_map"]
                files = {os.path.join(src_dir, v) for v in wmap.values()}
            except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
                raise CheckpointError(f"{index} is not a safetensors index ({e})") from None
        elif os.path.exists(single):
            wmap, files = None, {single}
        else:
            raise CheckpointError(f"{src_dir} has no {WEIGHTS_FILE} nor {INDEX_FILE}")
        self.handles = {}
        for path in sorted(files):
            if not os.path.exists(path):
                raise CheckpointError(f"{path} is missing (listed in {INDEX_FILE})")
            try:
                self.handles[path] = safe_open(path, framework="pt")
            except Exception as e:  # SafetensorError: truncated or corrupt header/data
                raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None
        self.where = {k: path for path, h in self.handles.items() for k in h.keys()}
        for k, v in (wmap or {}).items():
            if self.where.get(k) != os.path.join(src_dir, v):
                raise CheckpointError(f"{INDEX_FILE} lists tensor {k!r} in {v}, which does not hold it")
        self.src_dir, self.used = src_dir, set()

    def __contains__(self, name: str) -> bool:
        return name in self.where

    def get(self, name: str, shape: tuple) -> Tensor:
        if name not in self.where:
            raise CheckpointError(f"{self.src_dir}: tensor {name!r} is missing from the checkpoint")
        h = self.handles[self.where[name]]
        got = tuple(h.get_slice(name).get_shape())
        if got != tuple(shape):
            raise CheckpointError(f"{self.where[name]}: tensor {name!r} has shape {list(got)}, expected {list(shape)} "
                                  f"from config.json")
        self.used.add(name)
        return h.get_tensor(name)


# --- the tensor plan: our name -> a function reading theirs ---------------------------------------------------------
def release_shapes(hf: dict, cfg: ModelConfig | None = None) -> dict[str, tuple]:
    """{their tensor name: shape} that config `hf` implies (`cfg` = model_config(hf), when already built)."""
    cfg = cfg or model_config(hf)
    d, V, n, m = cfg.d_model, cfg.vocab_size, cfg.rodimus_d_state, cfg.rodimus_d_inner
    r, K = cfg.rodimus_rank, cfg.d_conv
    s = {"model.embeddings.weight": (V, d), "model.norm_f.weight": (d,), "lm_head.weight": (V, d)}
    if cfg.embed_norm:
        s["model.embed_norm.weight"] = (d,)
    for i in range(int(hf.get("n_layer", 24))):
        t, mi = f"model.layers.{i}.", f"model.layers.{i}.mixer.inner_mixer."
        s.update({t + "mixer_norm.weight": (d,), t + "mixer.fc.weight": (2 * m, d),
                  mi + "short_conv.conv1d.weight": (m, 1, K), mi + "short_conv.conv1d.bias": (m,),
                  mi + "in_proj.weight": (2 * n, m), mi + "mem_gate_proj.weight": (2 * n, m),
                  mi + "mem_gate_proj.bias": (2 * n,), mi + "ch_gate_proj.0.weight": (r, m),
                  mi + "ch_gate_proj.1.weight": (m, r), mi + "ch_gate_proj.1.bias": (m,), mi + "residual_weight": (m,),
                  t + "mixer.act_norm.weight": (m,), t + "mixer.out_proj.weight": (d, m)})
        if hf.get("block_type") == "rodimus_plus":
            H, Hk, Hv, hd, f = cfg.n_heads, cfg.n_k_heads, cfg.kv_heads, cfg.attn_head_dim, cfg.mlp_hidden
            s.update({t + "attn_norm.weight": (d,), t + "ffn_norm.weight": (d,), t + "attn.q_proj.weight": (H * hd, d),
                      t + "attn.k_proj.weight": (Hk * hd, d), t + "attn.v_proj.weight": (Hv * hd, d),
                      t + "attn.out_proj.weight": (d, H * hd), t + "ffn.fc.weight": (2 * f, d),
                      t + "ffn.out_proj.weight": (d, f)})
    return s


def _head_orders(H: int, Hk: int, Hv: int) -> tuple[list[int], list[int]]:
    """(their query head for each of ours, their value head for each of ours). Theirs: query j reads value j % Hv and
    key j % Hk. Ours: query j' reads value j' // (H/Hv), value i' reads key i' // (Hv/Hk)."""
    gv, gq = Hv // Hk, H // Hv
    v_ours = {v: (v % Hk) * gv + v // Hk for v in range(Hv)}
    v_order = sorted(range(Hv), key=v_ours.get)
    q_order = sorted(range(H), key=lambda j: v_ours[j % Hv] * gq + j // Hv)
    return q_order, v_order


def _plan(cfg: ModelConfig, hf: dict, src: _Shards) -> dict:
    """{our tensor name: () -> tensor}, reading (and shape-checking) their tensors lazily."""
    shapes = release_shapes(hf, cfg)
    n, plus = cfg.rodimus_d_state, hf.get("block_type", "rodimus") == "rodimus_plus"

    def get(name):
        return lambda: src.get(name, shapes[name])

    plan = {"embed.weight": get("model.embeddings.weight"), "norm.weight": get("model.norm_f.weight")}
    if cfg.embed_norm:
        plan["embed_norm.weight"] = get("model.embed_norm.weight")
    if not cfg.tie_embeddings:
        plan["lm_head.weight"] = get("lm_head.weight")
    elif "lm_head.weight" in src:  # a tied head saved anyway: it must be the embedding
        get("lm_head.weight")()
    for i in range(int(hf.get("n_layer", 24))):
        t, b = f"model.layers.{i}.", f"blocks.{i}."
        x, mi = b + "mixer.", t + "mixer.inner_mixer."
        gate_b = get(mi + "mem_gate_proj.bias")
        plan.update({
            b + ("norm1.weight" if plus else "norm.weight"): get(t + "mixer_norm.weight"),
            x + "fc.weight": get(t + "mixer.fc.weight"),
            x + "conv.weight": lambda f=get(mi + "short_conv.conv1d.weight"): f()[:, 0],
            x + "conv.bias": get(mi + "short_conv.conv1d.bias"),
            x + "qk_proj.weight": get(mi + "in_proj.weight"),
            x + "gate_proj.weight": get(mi + "mem_gate_proj.weight"),
            x + "g_bias": lambda f=gate_b: f()[:n],
            x + "tau_bias": lambda f=gate_b: f()[n:],
            x + "beta_down.weight": get(mi + "ch_gate_proj.0.weight"),
            x + "beta_up.weight": get(mi + "ch_gate_proj.1.weight"),
            x + "beta_up.bias": get(mi + "ch_gate_proj.1.bias"),
            x + "residual_weight": get(mi + "residual_weight"),
            x + "norm_weight": get(t + "mixer.act_norm.weight"),
            x + "out_proj.weight": get(t + "mixer.out_proj.weight"),
        })
        if plus:
            plan.update(_plus_block(cfg, get, t, b))
    return plan


def _plus_block(cfg: ModelConfig, get, t: str, b: str) -> dict:
    """SW-SKA and GLU of a Rodimus+ block: heads permuted from their `(n h)` tiling to our contiguous groups."""
    d, H, Hv, hd = cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.attn_head_dim
    q_order, v_order = _head_orders(H, cfg.n_k_heads, Hv)

    def qkv():
        q = get(t + "attn.q_proj.weight")().view(H, hd, d)[q_order].flatten(0, 1)
        v = get(t + "attn.v_proj.weight")().view(Hv, hd, d)[v_order].flatten(0, 1)
        return torch.cat((q, get(t + "attn.k_proj.weight")(), v))

    def glu():  # theirs [x | gate], ours [gate | up]
        x, gate = get(t + "ffn.fc.weight")().chunk(2)
        return torch.cat((gate, x))

    return {b + "norm2.weight": get(t + "attn_norm.weight"), b + "norm3.weight": get(t + "ffn_norm.weight"),
            b + "attn.qkv.weight": qkv,
            b + "attn.out.weight": lambda: get(t + "attn.out_proj.weight")().view(d, H, hd)[:, q_order].flatten(1),
            b + "ffn.w_in.weight": glu, b + "ffn.w_out.weight": get(t + "ffn.out_proj.weight")}


# --- writing: a safetensors file streamed one tensor at a time -------------------------------------------------------
def _write_streaming(path: str, shapes: dict, plan: dict, dtype: torch.dtype, metadata: dict):
    """Write the tensors of `plan` (in `shapes`' order) as `path` without holding more than one in memory."""
    header, offset = {"__metadata__": metadata}, 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)                       # data starts 8-byte aligned
    with open(path, "wb") as f:
        f.write(len(blob).to_bytes(8, "little") + blob)
        for name, shape in shapes.items():
            t = plan[name]().to(dtype).contiguous()
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(f"internal error: {name} came out {tuple(t.shape)}, expected {tuple(shape)}")
            f.write(t.view(torch.uint8).numpy().data if t.numel() else b"")
            del t


def convert_rodimus_dir(src_dir: str, out_dir: str, dtype: str | torch.dtype | None = None) -> str:
    """Convert the Rodimus checkpoint directory `src_dir` into the hybridlm checkpoint `out_dir/checkpoint` (written
    atomically: config.json, model.safetensors, the tokenizer files); returns its path. `dtype` (float32, bfloat16,
    float16) casts the weights; by default they keep the dtype of the source embedding."""
    from ..data.tokenizer import tokenizer_from_dir
    from ..checkpoint import MODEL_FILE, new_tmp_dir, publish
    hf = read_config(src_dir)
    cfg = model_config(hf, os.path.join(src_dir, "config.json"))
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ConfigError(f"--dtype {dtype!r}: expected one of {', '.join(_DTYPES)}")
        dtype = _DTYPES[dtype]
    src = _Shards(src_dir)
    if dtype is None:
        dtype = src.handles[src.where["model.embeddings.weight"]].get_slice("model.embeddings.weight").get_dtype() \
            if "model.embeddings.weight" in src else "F32"
        dtype = {v: k for k, v in _ST_DTYPES.items()}.get(dtype, torch.float32)
    if os.path.exists(os.path.join(src_dir, "tokenizer.json")):
        tokenizer_from_dir(src_dir)                       # fail now, not at the first `generate`
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in CausalLM(cfg).state_dict().items()}
    aliases = {"lm_head.weight": "embed.weight"} if cfg.tie_embeddings else {}
    for k in aliases:
        shapes.pop(k)
    plan = _plan(cfg, hf, src)
    if set(plan) != set(shapes):
        raise CheckpointError(f"internal error: converter covers {sorted(set(plan) ^ set(shapes))} wrongly")
    tmp = new_tmp_dir(out_dir, "checkpoint")
    try:
        _write_streaming(os.path.join(tmp, MODEL_FILE), shapes, plan, dtype,
                         {"format": "pt", "aliases": json.dumps(aliases), "converted_from": "rodimus"})
        unused = sorted(set(src.where) - src.used)
        if unused:
            raise CheckpointError(f"{src_dir}: {len(unused)} tensor(s) not used by the conversion, e.g. "
                                  f"{', '.join(unused[:3])} (does config.json match the weights?)")
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(cfg.to_json())
        for name in TOKENIZER_FILES:
            if os.path.exists(os.path.join(src_dir, name)):
                shutil.copyfile(os.path.join(src_dir, name), os.path.join(tmp, name))
        publish(tmp, out_dir, "checkpoint")
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return os.path.join(out_dir, "checkpoint")
