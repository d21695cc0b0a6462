"""The gated short-convolution letter (LFM2, transformers' Lfm2ForCausalLM; hf/convert_lfm2.py):

    C  in_proj -> b, c, h; y = out_proj(c ⊙ causal_depthwise_conv(b ⊙ h)), `conv_kernel` taps, cache = conv tail
"""
from .registry import need


def _validate_conv(cfg):
    need(isinstance(cfg.conv_kernel, int) and cfg.conv_kernel >= 1,
         f"conv_kernel must be an integer >= 1 (taps of the C convolution), got {cfg.conv_kernel!r}")


def _gated_conv(cfg, idx):
    from ..layers.gated_conv import GatedShortConv
    return GatedShortConv(cfg.d_model, layer_idx=idx, kernel=cfg.conv_kernel, bias=cfg.conv_bias)
