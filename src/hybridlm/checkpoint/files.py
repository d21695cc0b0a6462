"""Checkpoints as plain files (safetensors + JSON, never pickle), written atomically and checksummed.

    RUN/step-000500/            one directory per saved step (`save_step_checkpoint`, `keep` newest kept)
        model.safetensors       weights; a tied weight is stored once, its other names in the metadata
        optimizer.safetensors   AdamW state tensors as "<param index>.<name>"; param groups + scalars as JSON
        config.json             transformers' config (model_type "hybridlm"): the ModelConfig under "hybridlm"
        modeling_hybridlm.py    the remote-code shim config.json's auto_map names (remote_code.py)
        trainer_state.json      step, tokens seen, RNG states, train config, tokenizer spec, data position
        tokenizer_config.json   (+ tokenizer.json for BPE)
        manifest.json           sha256 and size of every file above
    RUN/latest                  the name of the newest complete step directory (replaced atomically)
    RUN/config.json, RUN/model.safetensors.index.json, RUN/tokenizer*.json, RUN/modeling_hybridlm.py
                                the latest step as a transformers directory: the index maps every tensor to
                                `step-NNNNNN/model.safetensors`, so `AutoModelForCausalLM.from_pretrained(RUN)` and
                                `pipeline(..., model=RUN)` open the run itself (after `import hybridlm`, or with
                                `trust_remote_code=True` in any process)

A directory is first written to `RUN/NAME-tmp-XXXX`, fsynced, then renamed into place, and only then does
`latest` move to it, so a crash or a full disk during a save leaves the previous checkpoint intact and never
exposes a partial one. Loading verifies the manifest before reading any tensor: damaged bytes raise one
`CheckpointError` naming the file. Runs written before step directories (`RUN/checkpoint/`, no manifest)
and checkpoints whose config.json is the bare ModelConfig still load.
"""
import base64
import glob
import hashlib
import json
import math
import os
import re
import shutil
import tempfile

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from ..errors import CheckpointError, HybridLMError
from ..jsonio import read_json_object
from .remote_code import AUTO_MAP, SHIM_FILE, write_shim

MODEL_FILE, OPTIM_FILE = "model.safetensors", "optimizer.safetensors"
CONFIG_FILE, STATE_FILE = "config.json", "trainer_state.json"
MANIFEST_FILE, LATEST_FILE = "manifest.json", "latest"
INDEX_FILE = "model.safetensors.index.json"
_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_name(step: int) -> str:
    return f"step-{step:06d}"


# --- writing ---------------------------------------------------------------------------------------------
def dedupe_tied(state: dict) -> tuple[dict, dict]:
    """-> (the state dict with each shared tensor once, {alias name: stored name}) (tied weights are stored once)."""
    tensors, aliases, seen = {}, {}, {}
    for name, t in state.items():
        local = t.to_local() if hasattr(t, "to_local") else t     # a DTensor: its shard shares storage as well
        key = (local.data_ptr(), t.shape, t.dtype) if local.numel() else None
        if key in seen:
            aliases[name] = seen[key]
            continue
        if key is not None:
            seen[key] = name
        tensors[name] = t
    return tensors, aliases


def _save_model(model: nn.Module | dict, path: str):
    """Weights of a module, or a full state dict, to safetensors."""
    tensors, aliases = dedupe_tied(model.state_dict() if isinstance(model, nn.Module) else model)
    save_file({n: t.detach().contiguous() for n, t in tensors.items()}, path,
              metadata={"format": "pt", "aliases": json.dumps(aliases)})


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


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()


def _digest(files: dict) -> str:
    """The manifest's own checksum (over its file list), so a damaged manifest is named as such."""
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


def _manifest(directory: str) -> dict:
    """{relative path: {"sha256", "bytes"}} of every file under `directory` (DCP shards in `dcp/` included)."""
    files = {}
    for root, _, names in os.walk(directory):
        for n in names:
            path = os.path.join(root, n)
            files[os.path.relpath(path, directory)] = {"sha256": _sha256(path), "bytes": os.path.getsize(path)}
    return dict(sorted(files.items()))


def write_manifest(directory: str):
    """(Re)write `directory/manifest.json` over the files now there, through a temporary name."""
    files = {k: v for k, v in _manifest(directory).items() if k != MANIFEST_FILE}
    tmp = os.path.join(directory, MANIFEST_FILE + ".tmp")
    _write_json(tmp, {"version": 1, "files": files, "sha256": _digest(files)})
    os.replace(tmp, os.path.join(directory, MANIFEST_FILE))


def _finish_files(directory: str):
    """Write the manifest, fsync every file and give the usual permissions (mkdtemp makes it private)."""
    umask = os.umask(0)
    os.umask(umask)
    write_manifest(directory)
    for root, _, names in os.walk(directory):
        for n in names:
            path = os.path.join(root, n)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
            os.chmod(path, 0o666 & ~umask)
        os.chmod(root, 0o777 & ~umask)


def _fsync_dir(directory: str):
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(run_dir: str, name: str):
    tmp = os.path.join(run_dir, f".{LATEST_FILE}.tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(run_dir, LATEST_FILE))
    _fsync_dir(run_dir)


def step_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of the complete step directories in `run_dir`, oldest first."""
    found = []
    for name in os.listdir(run_dir) if os.path.isdir(run_dir) else []:
        m = STEP_DIR.match(name)
        if m and os.path.isfile(os.path.join(run_dir, name, MANIFEST_FILE)):
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return sorted(found)


def save_checkpoint(directory: str, model: nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    state: dict | None = None, tokenizer=None, name: str = "checkpoint") -> str:
    """Write `directory/name` atomically; returns its path. `model` must be the unwrapped module."""
    final = os.path.join(directory, name)
    tmp = new_tmp_dir(directory, name)
    try:
        _save_model(model, os.path.join(tmp, MODEL_FILE))
        if optimizer is not None:
            _save_optimizer(optimizer, os.path.join(tmp, OPTIM_FILE))
        from ..models.quantize import quantization_of
        write_metadata(tmp, model.config, state, tokenizer, dtype=next(model.parameters()).dtype,
                       quantization=quantization_of(model))
        publish(tmp, directory, name)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError):  # disk full, quota, permissions: the previous checkpoint is untouched
            raise CheckpointError(f"could not save checkpoint {final} ({e.strerror or e}); the previous "
                                  f"checkpoint in {directory} is intact") from None
        raise
    return final


def new_tmp_dir(directory: str, name: str) -> str:
    """A fresh temporary directory to write `directory/name` into (removing those a killed process left)."""
    os.makedirs(directory, exist_ok=True)
    for stale in glob.glob(os.path.join(directory, f"{name}-tmp-*")):
        shutil.rmtree(stale, ignore_errors=True)
    return tempfile.mkdtemp(prefix=f"{name}-tmp-", dir=directory)


def write_metadata(tmp: str, config, state: dict | None, tokenizer=None, dtype: torch.dtype = torch.float32,
                   quantization: dict | None = None):
    """config.json (as transformers reads it, with the `auto_map` of its remote-code shim, also written; a quantized
    model's scheme and swapped modules under `quantization_config`), trainer_state.json (+ this process's RNG state)
    and the tokenizer files."""
    special = {} if tokenizer is None else {"eos_token_id": tokenizer.eos_id, "pad_token_id": tokenizer.eos_id}
    if quantization is not None:
        special["quantization_config"] = quantization
    _write_json(os.path.join(tmp, CONFIG_FILE), config.transformers_dict(
        bos_token_id=None, **special, dtype=str(dtype).removeprefix("torch."), auto_map=AUTO_MAP))
    write_shim(tmp)
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
    _fsync_dir(directory)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_step_checkpoint(run_dir: str, step: int, model: nn.Module, optimizer=None, state: dict | None = None,
                         tokenizer=None, keep: int = 0) -> str:
    """Write `run_dir/step-NNNNNN` atomically, point `run_dir/latest` at it, then delete all but the `keep`
    newest step directories (0 = keep all). Returns the new directory."""
    path = save_checkpoint(run_dir, model, optimizer, dict(state or {}, step=step), tokenizer, name=step_name(step))
    mark_latest(run_dir, path, keep)
    return path


def mark_latest(run_dir: str, path: str, keep: int = 0):
    """Point `run_dir/latest` at the step directory `path` just published, then delete all but the `keep` newest
    step directories (0 = keep all) and what killed saves left behind."""
    try:
        _write_latest(run_dir, os.path.basename(path))
        write_run_index(run_dir, path)     # before old steps go: the index never names a deleted one
    except OSError as e:
        raise CheckpointError(f"could not update {os.path.join(run_dir, LATEST_FILE)} ({e.strerror or e})") from None
    for stale in glob.glob(os.path.join(run_dir, "step-*-tmp-*")) + glob.glob(os.path.join(run_dir, "step-*-deleting")):
        if not stale.startswith(path):
            shutil.rmtree(stale, ignore_errors=True)
    if keep > 0:
        for _, old in step_checkpoints(run_dir)[:-keep]:
            if old != path:  # renamed first, so a kill mid-delete leaves nothing that looks complete
                os.replace(old, old + "-deleting")
                shutil.rmtree(old + "-deleting", ignore_errors=True)


def _copy_atomic(src: str, dst: str):
    tmp = dst + ".tmp"
    shutil.copyfile(src, tmp)
    os.replace(tmp, dst)


def write_run_index(run_dir: str, step_dir: str):
    """Make `run_dir` a transformers directory of the step directory `step_dir`: its config.json, remote-code shim and
    tokenizer files copied up, and model.safetensors.index.json mapping each stored tensor to
    `STEP/model.safetensors` (transformers reads an index's file names relative to the directory). A step saved as
    DCP shards only has no such file: the index is removed until `consolidate` writes one, rather than left naming
    an older step."""
    from ..data.tokenizer import BPE_FILE
    from ..data.tokenizer import CONFIG_FILE as TOK_FILE
    name, weights = os.path.basename(os.path.normpath(step_dir)), os.path.join(step_dir, MODEL_FILE)
    index = os.path.join(run_dir, INDEX_FILE)
    if not os.path.isfile(weights):
        if os.path.exists(index):
            os.remove(index)
        return
    for f in (CONFIG_FILE, SHIM_FILE, TOK_FILE, BPE_FILE):
        if os.path.isfile(os.path.join(step_dir, f)):
            _copy_atomic(os.path.join(step_dir, f), os.path.join(run_dir, f))
    with safe_open(weights, "pt") as f:
        keys = list(f.keys())
        size = sum(math.prod(f.get_slice(k).get_shape()) * _BYTES[f.get_slice(k).get_dtype()] for k in keys)
    tmp = index + ".tmp"
    _write_json(tmp, {"metadata": {"total_size": size, "step_dir": name},
                      "weight_map": dict.fromkeys(keys, f"{name}/{MODEL_FILE}")})
    os.replace(tmp, index)


def ensure_writable(directory: str):
    """Create `directory` if needed and prove a file can be written there; else one clear CheckpointError."""
    parent = directory
    while parent and not os.path.exists(parent):  # the nearest existing ancestor must be a directory
        parent = os.path.dirname(parent)
    if parent and not os.path.isdir(parent):
        raise CheckpointError(f"output directory {directory} cannot be created: {parent} is a file")
    try:
        os.makedirs(directory, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=directory)
        os.close(fd)
        os.remove(probe)
    except OSError as e:
        raise CheckpointError(f"output directory {directory} is not writable ({e.strerror or e})") from None


# --- reading ---------------------------------------------------------------------------------------------
def find_checkpoint(path: str, name: str = "checkpoint") -> str:
    """`path` itself if it is a checkpoint, else the step directory `path/latest` names (the newest complete
    one if that is gone), else today's `path/name` (or the copy a crash left mid-swap). A run directory's own
    config.json (written for transformers, see the module doc) does not make it a checkpoint."""
    if not os.path.isdir(path):
        raise CheckpointError(f"checkpoint {path} does not exist")
    if os.path.exists(os.path.join(path, MODEL_FILE)):
        return path
    latest = os.path.join(path, LATEST_FILE)
    if os.path.isfile(latest):
        with open(latest, errors="replace") as f:
            target = f.read().strip()
        if STEP_DIR.match(target) and os.path.isfile(os.path.join(path, target, MANIFEST_FILE)):
            return os.path.join(path, target)
    steps = step_checkpoints(path)
    if steps:
        return steps[-1][1]
    if os.path.isdir(os.path.join(path, name)):
        return os.path.join(path, name)
    aside = sorted(glob.glob(os.path.join(path, f"{name}-old-*", name)))
    if aside:
        return aside[-1]
    if os.path.exists(os.path.join(path, CONFIG_FILE)) and not os.path.exists(os.path.join(path, INDEX_FILE)):
        return path           # weights missing, or DCP shards only: loading says which
    raise CheckpointError(f"no checkpoint in {path} (expected {CONFIG_FILE} and {MODEL_FILE})")


def verify_checkpoint(ckpt: str, names: list[str] | None = None):
    """Check sizes and sha256 of `names` (default: every file) against the manifest; a checkpoint without
    one (the `checkpoint/` layout from before manifests) passes unchecked."""
    manifest_path = os.path.join(ckpt, MANIFEST_FILE)
    if not os.path.exists(manifest_path):
        if STEP_DIR.match(os.path.basename(os.path.normpath(ckpt))):  # always written with one
            raise CheckpointError(f"{manifest_path} is missing")
        return
    manifest = _read_json(manifest_path)
    files = manifest.get("files")
    if not isinstance(files, dict) or manifest.get("sha256") != _digest(files):
        raise CheckpointError(f"{manifest_path} is damaged: its own checksum does not match")
    for name in files if names is None else [n for n in names if n in files]:
        path, want = os.path.join(ckpt, name), files[name]
        if not os.path.isfile(path):
            raise CheckpointError(f"{path} is missing")
        want = want if isinstance(want, dict) else {}
        if os.path.getsize(path) != want.get("bytes") or _sha256(path) != want.get("sha256"):
            raise CheckpointError(f"{path} is damaged: its checksum does not match {MANIFEST_FILE}")


def _read_json(path: str) -> dict:
    return read_json_object(path, CheckpointError)


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


def load_model_weights(model: nn.Module, path: str, assign: bool = False):
    """Copy the weights of `path` into `model`; with `assign` the model (built on the meta device) takes the loaded
    tensors themselves, in their stored dtype, so no second copy is made."""
    tensors, meta = _read_safetensors(path)
    try:
        for name, target in json.loads(meta.get("aliases", "{}")).items():
            tensors[name] = tensors[target]
        model.load_state_dict(tensors, strict=True, assign=assign)
    except (KeyError, RuntimeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} does not match the model in config.json ({str(e).splitlines()[0]})") from None
    if assign and hasattr(model, "tie_weights"):
        model.tie_weights()  # assign made one Parameter per name: tie the embeddings and shared layers (X@k) again


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
    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt, [CONFIG_FILE])
    cfg_path = os.path.join(ckpt, CONFIG_FILE)
    d = _read_json(cfg_path)
    if "model_type" in d:     # transformers' layout, the ModelConfig under "hybridlm"; else the bare ModelConfig
        if d["model_type"] != "hybridlm" or not isinstance(d.get("hybridlm"), dict):
            raise CheckpointError(f"{cfg_path}: a transformers {d['model_type']!r} config, not a hybridlm checkpoint "
                                  f"(convert it: hybridlm convert --from-hf {ckpt} --out RUN)")
        d = d["hybridlm"]
    try:
        return ModelConfig.from_dict(d)
    except CheckpointError:
        raise
    except (HybridLMError, TypeError, ValueError) as e:
        raise CheckpointError(f"{cfg_path}: invalid model config ({str(e).splitlines()[0]})") from None


def load_quantization(path: str) -> dict | None:
    """The `quantization_config` of a checkpoint's config.json (scheme, group_size, modules), or None."""
    ckpt = find_checkpoint(path)
    cfg_path = os.path.join(ckpt, CONFIG_FILE)
    q = _read_json(cfg_path).get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict) or q.get("quant_method") != "hybridlm" or not isinstance(q.get("modules"), list):
        raise CheckpointError(f"{cfg_path}: quantization_config is not one hybridlm wrote ({q!r:.80})")
    return q


def load_checkpoint(path: str, device: str | torch.device = "cpu", weights: bool = True):
    """-> (CausalLM with the saved weights in their saved dtype, trainer state dict ({} if none was saved)).
    weights=False: the model stays on the meta device, for a caller that loads the weights into its own shards
    (the trainer's resume from DCP shards)."""
    from ..models import CausalLM
    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt)  # every file, before anything is loaded
    cfg = load_config(ckpt)
    with torch.device("meta"):  # no memory and no random init: the saved weights replace it
        model = CausalLM(cfg)
        quantization = load_quantization(ckpt)
        if quantization is not None:   # the quantized modules' skeleton; the stored tensors fill it, as saved
            from ..models.quantize import quantize_
            quantize_(model, quantization["scheme"], quantization.get("group_size"), quantization["modules"])
    if weights and _sharded_only(ckpt):    # saved under FSDP and not consolidated yet
        model.to_empty(device="cpu")
        model.tie_weights()                             # to_empty made one tensor per name
        _load_weights(model, ckpt)
    elif weights:
        _load_weights(model, ckpt, assign=True)
    state_path = os.path.join(ckpt, STATE_FILE)
    state = _read_json(state_path) if os.path.exists(state_path) else {}
    state["checkpoint_dir"] = ckpt
    return (model.to(device) if weights else model), state


def _sharded_only(ckpt: str) -> bool:
    """No model.safetensors but DCP shards: a checkpoint saved under FSDP2 and not consolidated yet."""
    from .dcp import has_dcp
    return not os.path.exists(os.path.join(ckpt, MODEL_FILE)) and has_dcp(ckpt)


def _load_weights(model: nn.Module, ckpt: str, assign: bool = False):
    """The weights of checkpoint directory `ckpt` into `model`: from model.safetensors, else from its DCP shards."""
    if _sharded_only(ckpt):
        from .dcp import load_dcp_weights
        load_dcp_weights(model, ckpt)
    else:
        load_model_weights(model, os.path.join(ckpt, MODEL_FILE), assign=assign)


def load_weights_into(model: nn.Module, path: str):
    """Copy a checkpoint's (or run directory's) weights into `model`, built from a config that may differ from the
    saved one in anything that leaves the parameters alone (dsa_topk, dropout, ...). (Random initialisation is
    `init_weights`, the models' own.)"""
    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt)
    _load_weights(model, ckpt)


def load_pretrained(path: str, device: str | torch.device = "cpu"):
    """-> (model in eval mode, tokenizer) from a checkpoint directory (or a run directory holding one)."""
    model, state = load_checkpoint(path, device)
    return model.eval(), load_tokenizer(state["checkpoint_dir"])


def load_tokenizer(path: str):
    """The tokenizer saved with a checkpoint (or in a run directory's latest), its files verified."""
    from ..data.tokenizer import BPE_FILE, tokenizer_from_dir
    from ..data.tokenizer import CONFIG_FILE as TOK_FILE
    ckpt = find_checkpoint(path)
    verify_checkpoint(ckpt, [TOK_FILE, BPE_FILE])
    try:
        return tokenizer_from_dir(ckpt)
    except HybridLMError as e:
        raise CheckpointError(str(e)) from None
