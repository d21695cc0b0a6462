"""The remote-code shim every directory hybridlm writes carries, so that transformers' Auto classes open it in a process
that never imported hybridlm: `AutoModelForCausalLM.from_pretrained(RUN, trust_remote_code=True)`, lm-eval's `hf`
model, PEFT / TRL scripts, serving front ends.

config.json's `auto_map` names SHIM_FILE, which only imports the installed package: the directory holds no copy of the
model code, so it never goes stale when hybridlm is upgraded (transformers copies the shim into its modules cache
as it is). Where hybridlm is not installed, transformers' own import check of the shim stops with one line:
"... requires the following packages that were not found in your environment: hybridlm. Run `pip install hybridlm`".
Keep the import path `hybridlm.hf.modeling` stable: directories written today import it for good.
The tokenizer needs no shim: tokenizer_config.json names transformers' own PreTrainedTokenizerFast (data/tokenizer.py).
"""
import os

SHIM_FILE = "modeling_hybridlm.py"
AUTO_MAP = {"AutoConfig": "modeling_hybridlm.HybridLMConfig",
            "AutoModelForCausalLM": "modeling_hybridlm.HybridLMForCausalLM"}
SHIM = '''"""hybridlm's model for transformers' Auto classes (trust_remote_code=True). The code is the installed
hybridlm package (pip install hybridlm), imported here: this directory holds none of it."""
from hybridlm.hf.modeling import HybridLMConfig, HybridLMForCausalLM  # noqa: F401
'''


def write_shim(directory: str):
    """Write `directory/SHIM_FILE` (through a temporary name: a reader never sees half of it)."""
    tmp = os.path.join(directory, SHIM_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(SHIM)
    os.replace(tmp, os.path.join(directory, SHIM_FILE))
