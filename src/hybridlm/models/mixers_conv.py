"""The gated short-convolution letter (LFM2, transformers' Lfm2ForCausalLM; hf/convert_lfm2.py):

    C  in_proj -> b, c, h; y = out_proj(c ⊙ causal_depthwise_conv(b ⊙ h)), `d_conv` taps, cache = conv tail
"""
from .registry import need


def _validate_conv(cfg):
    need(isinstance(cfg.d_conv, int) and cfg.d_conv >= 1,
         f"d_conv must be an integer >= 1 (taps of the C convolution), got {cfg.d_conv!r}")


def _gated_conv(cfg, idx):
    from ..layers.gated_conv import GatedShortConv
    return GatedShortConv(cfg.d_model, layer_idx=idx, kernel=cfg.d_conv, bias=cfg.conv_bias)
