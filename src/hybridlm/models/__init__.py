from . import presets
from .causal_lm import CausalLM, CausalLMOutput
from .config import ModelConfig
from .layout import parse_layout

# The family modules hold the builders and checks that the letter table (models/registry.py) names; the table imports
# them on first use and is complete without them. They are imported here only so that a broken one fails at import
# time; the order is free (nothing in them runs at import but definitions).
from . import mixers_conv, mixers_deepseek, mixers_delta, mixers_kda, mixers_mamba1  # noqa: F401,E402
from . import mixers_moe, mixers_rodimus, mixers_wm, mixers_zamba  # noqa: F401,E402

__all__ = ["CausalLM", "CausalLMOutput", "ModelConfig", "parse_layout", "presets"]
