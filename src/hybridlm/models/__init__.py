from . import mixers_deepseek  # noqa: F401  (registers the L and I letters)
from . import presets
from .causal_lm import CausalLM, CausalLMOutput
from .config import ModelConfig
from .layout import parse_layout
from . import mixers_wm  # noqa: F401,E402  (registers F, E, O and the wm_ options of A and S)
from . import mixers_rodimus  # noqa: F401,E402  (registers R, W and the two-hop block [...])
from . import mixers_kda  # noqa: F401,E402  (registers K: Kimi Delta Attention)
from . import mixers_delta  # noqa: F401,E402  (registers G, the delta-rule letters)
from . import mixers_mamba1  # noqa: F401,E402  (registers B, the Mamba-1 block)
from . import mixers_conv  # noqa: F401,E402  (registers C, the gated short convolution)
from . import mixers_zamba  # noqa: F401,E402  (registers Z, Zamba2's shared block feeding the next letter)

__all__ = ["CausalLM", "CausalLMOutput", "ModelConfig", "parse_layout", "presets"]
