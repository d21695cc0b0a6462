"""transformers checkpoint directories <-> hybridlm checkpoints (`hybridlm convert`).

    convert_from_hf("llama-dir", "runs/llama")        # config.json + model.safetensors (or sharded + index)
    export_to_hf("runs/m2a", "hf-m2a")                # HybridLMForCausalLM; AutoModelForCausalLM loads it

`FROM_HF` maps config.json's `model_type` to the function converting such a directory, as (module, name) so that
nothing is imported before it is needed; a new checkpoint family is one row. Tensors are read from the safetensors files only when a converter asks for them, checked first against the
shapes the transformers model of that config.json has, and handed to a CausalLM built on the meta device without a
copy, so converting holds one copy of the weights. Needs transformers (`pip install hybridlm[hf]`).
"""
import os

import torch

from ..errors import CheckpointError, ConfigError
from ..jsonio import read_json_object
from ..models.causal_lm import CausalLM
from .common import LazyTensor, Tensors

WEIGHTS, INDEX = "model.safetensors", "model.safetensors.index.json"


def _json(path: str) -> dict:
    return read_json_object(path, CheckpointError)


def read_tensors(directory: str) -> tuple[dict[str, LazyTensor], dict[str, tuple[list[int], str]]]:
    """The tensors of `directory`'s model.safetensors (or the shards its index names), unread: name -> LazyTensor,
    and name -> (shape, file) for the checks."""
    from safetensors import safe_open
    index = os.path.join(directory, INDEX)
    if os.path.exists(index):
        weight_map = _json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index} has no weight_map")
        files = sorted(set(weight_map.values()))
    elif os.path.exists(os.path.join(directory, WEIGHTS)):
        files = [WEIGHTS]
    else:
        raise CheckpointError(f"no {WEIGHTS} or {INDEX} in {directory} (only safetensors checkpoints are read)")
    lazy, meta = {}, {}
    for name in files:
        path = os.path.join(directory, name)
        if not os.path.exists(path):
            raise CheckpointError(f"{path} is missing (named by {INDEX})")
        try:
            with safe_open(path, "pt") as f:
                for key in f.keys():
                    lazy[key], meta[key] = LazyTensor(path, key), (list(f.get_slice(key).get_shape()), path)
        except Exception as e:  # SafetensorError derives from Exception only
            raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None
    return lazy, meta


def _check_shapes(hf_config, meta: dict, directory: str):
    """Every tensor the transformers model of this config has must be in the files, with its shape."""
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        ref = AutoModelForCausalLM.from_config(hf_config)
    tied = set(getattr(ref, "all_tied_weights_keys", {}) or {}) if getattr(hf_config, "tie_word_embeddings", False) \
        else set()
    expected = ref.state_dict()
    try:  # checkpoints keep the names (and per-expert tensors) that transformers' loading renames and merges
        from transformers.core_model_loading import revert_weight_conversion
        saved = revert_weight_conversion(ref, dict(expected))
        if all(k in meta for k in saved if k not in tied) and not all(k in meta for k in expected if k not in tied):
            expected = saved
    except (ImportError, AttributeError, TypeError, ValueError, RuntimeError):
        pass
    for name, t in expected.items():
        if name in tied and name not in meta:
            continue
        if name not in meta and _per_expert(name, t, meta):
            continue                     # the converter stacks them; load_state_dict(strict) checks the result
        if name not in meta:
            raise CheckpointError(f"{directory}: the safetensors files have no tensor {name!r}")
        shape, path = meta[name]
        if shape != list(t.shape):
            raise CheckpointError(f"{path}: tensor {name!r} has shape {shape}, config.json implies {list(t.shape)}")


def _per_expert(name: str, t, meta: dict) -> bool:
    """A fused expert tensor `...experts.<param>` [E, ...] of the in-memory model that the files hold in the per-expert
    checkpoint format (`...experts.{0..E-1}.<proj>.weight`, as transformers still saves Mixtral-style experts)."""
    head, sep, _ = name.rpartition("experts.")
    return bool(sep) and all(any(k.startswith(f"{head}experts.{e}.") for k in meta) for e in range(t.shape[0]))


def convert_transformers_dir(src_dir: str, out_dir: str, dtype: str | torch.dtype | None = None) -> str:
    """A transformers checkpoint of a family in `CONVERTERS` -> a hybridlm checkpoint under `out_dir` (plus the
    tokenizer when `src_dir` has one), its weights cast to `dtype` ("bfloat16", torch.bfloat16, ...) if given.
    Returns the checkpoint path."""
    from transformers import AutoConfig
    from .common import convert_weights
    from .convert import config_from_transformers
    hf_config = AutoConfig.from_pretrained(src_dir)
    lazy, meta = read_tensors(src_dir)
    _check_shapes(hf_config, meta, src_dir)
    cfg = config_from_transformers(hf_config)
    sd = convert_weights(hf_config, Tensors(lazy), cfg)
    if dtype is not None:
        dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
        cast = {}                                                # a tied weight is one tensor under two names
        sd = {k: cast.setdefault(id(v), v.to(dtype)) for k, v in sd.items()}
    return save_converted(out_dir, cfg, sd, src_dir)


def save_converted(out_dir: str, cfg, sd: dict, src_dir: str) -> str:
    """Write a converted state dict as a hybridlm checkpoint (the tokenizer of `src_dir` too, if it has one)."""
    from ..data.tokenizer import BPE_FILE, check_fits, tokenizer_from_dir
    from ..checkpoint import save_checkpoint
    with torch.device("meta"):
        model = CausalLM(cfg)
    try:
        model.load_state_dict(sd, strict=True, assign=True)      # the converted tensors become the parameters
    except RuntimeError as e:
        raise ConfigError(f"converted weights do not fit the hybridlm model: {str(e).splitlines()[0]}") from None
    model.tie_weights()                                          # assign untied them (tied embeddings, X@k layers)
    tok = None
    if os.path.exists(os.path.join(src_dir, BPE_FILE)):
        tok = tokenizer_from_dir(src_dir)
        check_fits(tok, cfg.vocab_size, os.path.join(src_dir, BPE_FILE))
    return save_checkpoint(out_dir, model, state={"converted_from": os.path.abspath(src_dir)}, tokenizer=tok)


# config.json model_type -> (module, function(src_dir, out_dir, dtype=None) -> checkpoint path)
FROM_HF = {t: (__name__, "convert_transformers_dir") for t in ("llama", "mamba2", "doge", "deepseek_v3", "deepseek_v32")}
FROM_HF["kimi_linear"] = ("hybridlm.hf.convert_kimi_linear", "convert_kimi_dir")   # files named as released
FROM_HF.update((t, (__name__, "convert_transformers_dir")) for t in ("bamba", "nemotron_h", "granitemoehybrid"))
FROM_HF["qwen3_next"] = (__name__, "convert_transformers_dir")
FROM_HF.update({t: (__name__, "convert_transformers_dir") for t in ("mamba", "falcon_mamba", "jamba")})   # Mamba-1: B
FROM_HF["falcon_h1"] = (__name__, "convert_transformers_dir")
FROM_HF["lfm2"] = (__name__, "convert_transformers_dir")
FROM_HF["zamba2"] = (__name__, "convert_transformers_dir")
FROM_HF["rodimus"] = ("hybridlm.hf.rodimus_format", "convert_rodimus_dir")   # codefuse-ai's remote-code releases


def convert_from_hf(src_dir: str, out_dir: str, dtype: str | torch.dtype | None = None) -> str:
    """Dispatch on `src_dir/config.json`'s model_type through `FROM_HF`."""
    if not os.path.isdir(src_dir):
        raise CheckpointError(f"{src_dir} is not a directory")
    path = os.path.join(src_dir, "config.json")
    model_type = _json(path).get("model_type")
    if model_type == "hybridlm":
        raise ConfigError(f"{src_dir} is already a hybridlm checkpoint: use it as it is (--checkpoint {src_dir})")
    if model_type not in FROM_HF:
        raise ConfigError(f"{path}: model_type {model_type!r} cannot be converted; supported: "
                          f"{', '.join(sorted(FROM_HF))}")
    import importlib
    module, fn = FROM_HF[model_type]
    return getattr(importlib.import_module(module), fn)(src_dir, out_dir, dtype=dtype)


def export_to_hf(src: str, out_dir: str, native: bool | str = False) -> str:
    """A hybridlm run or checkpoint -> a transformers directory (model, config, generation config, tokenizer):
    HybridLMForCausalLM, or with `native` ("auto", a family, or True for "auto") transformers' own class when the
    model is exactly one (hf/native.py)."""
    from ..data.tokenizer import check_fits, tokenizer_from_dir
    from ..errors import HybridLMError
    from ..checkpoint import load_checkpoint
    model, state = load_checkpoint(src)
    try:
        tok = tokenizer_from_dir(state["checkpoint_dir"])
    except HybridLMError:
        tok = None
    if tok is not None:
        check_fits(tok, model.config.vocab_size, state["checkpoint_dir"])
    special = {} if tok is None else dict(eos_token_id=tok.eos_id, pad_token_id=tok.eos_id)
    if native:
        from .native import to_native
        hf_model = to_native(model, "auto" if native is True else native, **special)
    else:
        from .modeling import HybridLMForCausalLM
        hf_model = HybridLMForCausalLM.from_model(model.eval(), **special)
    hf_model.save_pretrained(out_dir)
    if tok is not None:
        tok.save(out_dir)
    return out_dir
