"""Checkpoints as plain files (safetensors + JSON, never pickle), written atomically.

    DIR/checkpoint/
        model.safetensors       weights; a tied weight is stored once, its other names in the metadata
        optimizer.safetensors   AdamW state tensors as "<param index>.<name>"; param groups + scalars as JSON
        config.json             ModelConfig
        trainer_state.json      step, tokens seen, RNG states, train config, tokenizer spec
        tokenizer_config.json   (+ tokenizer.json for BPE)

Everything is first written to `DIR/checkpoint-tmp-XXXX` and then renamed into place, so an interrupted
save leaves the previous checkpoint intact. Any missing, truncated or corrupt file raises one
`CheckpointError` naming the file and the problem.
"""
import base64
import glob
import json
import os
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError, HybridLMError

MODEL_FILE, OPTIM_FILE = "model.safetensors", "optimizer.safetensors"
CONFIG_FILE, STATE_FILE = "config.json", "trainer_state.json"


# --- writing ---------------------------------------------------------------------------------------------
def _save_model(model: nn.Module | dict, path: str):
    """Weights of a module, or a full state dict (as FSDP consolidation gathers it), to safetensors."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in (model.state_dict() if isinstance(model, nn.Module) else model).items():
        key = (t.data_ptr(), t.shape, t.dtype) if t.numel() else None
        if key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t.detach().contiguous()
    save_file(tensors, path, metadata={"format": "pt", "aliases": json.dumps(aliases)})


def _save_optimizer(optimizer: torch.optim.Optimizer, path: str):
    sd = optimizer.state_dict()
    tensors, scalars = {}, {}
    for idx, st in sd["state"].items():
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                tensors[f"{idx}.{k}"] = v.detach().contiguous()
            else:
                scalars[f"{idx}.{k}"] = v
    meta = {"param_groups": json.dumps(sd["param_groups"]), "scalars": json.dumps(scalars)}
    save_file(tensors, path, metadata=meta)


def rng_state() -> dict:
    s = {"torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()}
    if torch.cuda.is_available():
        s["cuda"] = [base64.b64encode(t.numpy().tobytes()).decode() for t in torch.cuda.get_rng_state_all()]
    return s


def set_rng_state(s: dict):
    def dec(b):
        return torch.frombuffer(bytearray(base64.b64decode(b)), dtype=torch.uint8)
    if "torch" in s:
        torch.set_rng_state(dec(s["torch"]))
    if "cuda" in s and torch.cuda.is_available() and len(s["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([dec(b) for b in s["cuda"]])


def _write_json(path: str, obj):
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)


def _finish_files(directory: str):
    """fsync every file and give the usual permissions (mkdtemp makes the directory private)."""
    umask = os.umask(0)
    os.umask(umask)
    for name in os.listdir(directory):
        path = os.path.join(directory, name)
        if os.path.isdir(path):          # a distributed checkpoint's shards (dist_checkpoint.py)
            _finish_files(path)
            continue
        with open(path, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(path, 0o666 & ~umask)
    os.chmod(directory, 0o777 & ~umask)


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    state: dict | None = None, tokenizer=None, name: str = "checkpoint") -> str:
    """Write `directory/name` atomically; returns its path. `model` must be the unwrapped module."""
    final = os.path.join(directory, name)
    tmp = new_tmp_dir(directory, name)
    try:
        _save_model(model, os.path.join(tmp, MODEL_FILE))
        if optimizer is not None:
            _save_optimizer(optimizer, os.path.join(tmp, OPTIM_FILE))
        write_metadata(tmp, model.config, state, tokenizer)
        publish(tmp, directory, name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def new_tmp_dir(directory: str, name: str) -> str:
    """A fresh temporary directory to write `directory/name` into (removing those a killed process left)."""
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, f"{name}-tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{name}-tmp-", dir=directory)


def write_metadata(tmp: str, config, state: dict | None, tokenizer=None):
    """config.json, trainer_state.json (+ this process's RNG state) and the tokenizer files."""
    _write_json(os.path.join(tmp, CONFIG_FILE), config.to_dict())
    _write_json(os.path.join(tmp, STATE_FILE), dict(state or {}, rng=rng_state()))
    if tokenizer is not None:
        tokenizer.save(tmp)


def publish(tmp: str, directory: str, name: str) -> str:
    """fsync the files written into `tmp` and rename it to `directory/name`, replacing a previous checkpoint."""
    _finish_files(tmp)
    final = os.path.join(directory, name)
    old = None
    if os.path.exists(final):  # a directory cannot be replaced while non-empty: move it aside first
        old = tempfile.mkdtemp(prefix=f"{name}-old-", dir=directory)
        os.replace(final, os.path.join(old, name))
    os.replace(tmp, final)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


# --- reading ---------------------------------------------------------------------------------------------
def find_checkpoint(path: str, name: str = "checkpoint") -> str:
    """`path` itself if it is a checkpoint, else `path/name` (or the copy a crash left mid-swap)."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.exists(os.path.join(path, CONFIG_FILE)) or os.path.exists(os.path.join(path, MODEL_FILE)):
        return path
    if os.path.isdir(os.path.join(path, name)):
        return os.path.join(path, name)
    aside = sorted(glob.glob(os.path.join(path, f"{name}-old-*", name)))
    if aside:
        return aside[-1]
    raise CheckpointError(f"no checkpoint in {path} (expected {CONFIG_FILE} and {MODEL_FILE})")


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing")
    try:
        with open(path) as f:
            obj = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path} should hold a JSON object")
    return obj


def _read_safetensors(path: str) -> tuple[dict, dict]:
    if not os.path.exists(path):
        raise CheckpointError(f"{path} is missing")
    try:
        tensors = load_file(path)
        with safe_open(path, "pt") as f:
            meta = f.metadata() or {}
    except Exception as e:  # SafetensorError derives from Exception only
        raise CheckpointError(f"{path} is corrupt or truncated ({e})") from None
    return tensors, meta


def load_model_weights(model: nn.Module, path: str):
    tensors, meta = _read_safetensors(path)
    try:
        for name, target in json.loads(meta.get("aliases", "{}")).items():
            tensors[name] = tensors[target]
        model.load_state_dict(tensors, strict=True)
    except (KeyError, RuntimeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} does not match the model in config.json ({str(e).splitlines()[0]})") from None


def load_optimizer(optimizer: torch.optim.Optimizer, checkpoint_dir: str):
    path = os.path.join(checkpoint_dir, OPTIM_FILE)
    tensors, meta = _read_safetensors(path)
    try:
        groups = json.loads(meta["param_groups"])
        state: dict = {}
        for key, v in list(tensors.items()) + list(json.loads(meta.get("scalars", "{}")).items()):
            idx, k = key.split(".", 1)
            state.setdefault(int(idx), {})[k] = v
        for g in groups:
            if isinstance(g.get("betas"), list):
                g["betas"] = tuple(g["betas"])
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (KeyError, ValueError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} does not match the optimizer ({e})") from None


def load_config(path: str):
    """The ModelConfig of a checkpoint (or run directory), without loading weights."""
    from ..models import ModelConfig
    cfg_path = os.path.join(find_checkpoint(path), CONFIG_FILE)
    try:
        return ModelConfig.from_dict(_read_json(cfg_path))
    except CheckpointError:
        raise
    except (HybridLMError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid model config ({str(e).splitlines()[0]})") from None


def load_checkpoint(path: str, device: str | torch.device = "cpu"):
    """-> (CausalLM with the saved weights, trainer state dict ({} if none was saved))."""
    from ..models import CausalLM
    ckpt = find_checkpoint(path)
    model = CausalLM(load_config(ckpt))
    if not os.path.exists(os.path.join(ckpt, MODEL_FILE)) and os.path.isdir(os.path.join(ckpt, "dcp")):
        from .dist_checkpoint import load_dcp_weights   # saved under FSDP and not consolidated yet
        load_dcp_weights(model, ckpt)
    else:
        load_model_weights(model, os.path.join(ckpt, MODEL_FILE))
    state_path = os.path.join(ckpt, STATE_FILE)
    state = _read_json(state_path) if os.path.exists(state_path) else {}
    state["checkpoint_dir"] = ckpt
    return model.to(device), state


def load_pretrained(path: str, device: str | torch.device = "cpu"):
    """-> (model in eval mode, tokenizer) from a checkpoint directory (or a run directory holding one)."""
    from ..data.tokenizer import tokenizer_from_dir
    model, state = load_checkpoint(path, device)
    try:
        tok = tokenizer_from_dir(state["checkpoint_dir"])
    except HybridLMError as e:
        raise CheckpointError(str(e)) from None
    return model.eval(), tok
