"""Checkpoint reading and writing, below everything that saves or opens a model (train, eval, hf, commands).

`files.py`: one directory of safetensors + JSON per checkpoint, written atomically, checksummed, opened by
transformers; `dcp.py`: the sharded form FSDP2 runs save (torch.distributed.checkpoint) and its consolidation.
"""
from .files import (INDEX_FILE, LATEST_FILE, MANIFEST_FILE, MODEL_FILE, OPTIM_FILE, ensure_writable,
                    find_checkpoint, load_weights_into, load_checkpoint, load_config, load_model_weights, load_optimizer,
                    load_pretrained, load_quantization, load_tokenizer, mark_latest, new_tmp_dir, publish, rng_state,
                    save_checkpoint, save_step_checkpoint, set_rng_state, step_checkpoints, step_name,
                    verify_checkpoint, write_manifest, write_metadata, write_run_index)

__all__ = ["INDEX_FILE", "LATEST_FILE", "MANIFEST_FILE", "MODEL_FILE", "OPTIM_FILE", "ensure_writable",
           "find_checkpoint", "load_weights_into", "load_checkpoint", "load_config", "load_model_weights", "load_optimizer",
           "load_pretrained", "load_quantization", "load_tokenizer", "mark_latest", "new_tmp_dir", "publish",
           "rng_state", "save_checkpoint", "save_step_checkpoint", "set_rng_state", "step_checkpoints", "step_name",
           "verify_checkpoint", "write_manifest", "write_metadata", "write_run_index"]
