"""The `gpt` preset is the Transformer tutorial's TransformerLM (sections 2.1.1-2.1.4), and cross-attention
(section 2.2) works inside a decoder block."""
import torch
import torch.nn.functional as F
from torch import nn

from conftest import assert_close
from hybridlm import CausalLM, presets
from hybridlm.layers.attention import Attention
from hybridlm.layers.cross_attention import CrossAttention
from hybridlm.layers.mlp import MLP
from hybridlm.context import SeqContext


class TutorialLM(nn.Module):
    """The tutorial's model, written out plainly: token + learned position embeddings, pre-LayerNorm blocks of
    causal self-attention (fused qkv with bias, explicit masked softmax) and a GELU MLP, final LayerNorm, untied
    lm_head without bias."""

    def __init__(self, vocab, d, heads, d_ff, n_layers, max_len):
        super().__init__()
        self.heads = heads
        self.tok, self.pos = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(nn.ModuleDict(dict(
            ln1=nn.LayerNorm(d), qkv=nn.Linear(d, 3 * d), proj=nn.Linear(d, d), ln2=nn.LayerNorm(d),
            up=nn.Linear(d, d_ff), down=nn.Linear(d_ff, d))) for _ in range(n_layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, idx):
        B, T = idx.shape
        x = self.tok(idx) + self.pos(torch.arange(T))
        for b in self.blocks:
            q, k, v = b.qkv(b.ln1(x)).split(x.shape[-1], dim=-1)
            q, k, v = (t.view(B, T, self.heads, -1).transpose(1, 2) for t in (q, k, v))
            att = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
            att = att.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
            x = x + b.proj((att @ v).transpose(1, 2).reshape(B, T, -1))
            x = x + b.down(F.gelu(b.up(b.ln2(x))))
        return self.head(self.ln_f(x))


def test_gpt_preset_is_the_tutorial_transformer_lm():
    cfg = presets.get("gpt", n_layers=2, d_model=64, n_heads=4, vocab_size=97, max_seq_len=64)
    assert (cfg.pos_embedding, cfg.norm, cfg.mlp_gated, cfg.mlp_act, cfg.attn_bias, cfg.mlp_bias) == \
        ("learned", "layer", False, "gelu", True, True)
    assert cfg.dropout > 0 and not cfg.tie_embeddings and cfg.mlp_hidden_size == 4 * 64
    ours = CausalLM(cfg).eval()
    with torch.no_grad():                    # non-zero biases and LayerNorm parameters everywhere
        for p in ours.parameters():
            if p.dim() == 1:
                p.copy_(0.1 * torch.randn_like(p) + (1.0 if p.shape[0] == 64 else 0.0))
    ref = TutorialLM(97, 64, 4, 256, 2, 64).eval()
    sd = {"tok.weight": ours.embed.weight, "pos.weight": ours.pos_embed.weight, "ln_f.weight": ours.norm.weight,
          "ln_f.bias": ours.norm.bias, "head.weight": ours.lm_head.weight}
    for i in range(2):
        a, m = ours.blocks[2 * i], ours.blocks[2 * i + 1]
        for name, mod in (("ln1", a.norm), ("qkv", a.mixer.qkv), ("proj", a.mixer.out), ("ln2", m.norm),
                          ("up", m.mixer.w_in), ("down", m.mixer.w_out)):
            sd[f"blocks.{i}.{name}.weight"], sd[f"blocks.{i}.{name}.bias"] = mod.weight, mod.bias
    ref.load_state_dict(sd)
    ids = torch.randint(0, 97, (2, 33))
    assert_close(ours(ids).logits, ref(ids), atol=1e-5)
    # dropout is active in training mode only
    ours.train()
    assert not torch.equal(ours(ids).logits, ours(ids).logits)


def test_cross_attention_is_softmax_over_the_memory():
    xa = CrossAttention(32, 4, d_memory=24, n_kv_heads=2, bias=True)
    x, mem = torch.randn(2, 7, 32), torch.randn(2, 11, 24)
    mask = torch.ones(2, 11, dtype=torch.bool)
    mask[1, 8:] = False                                         # row 1's memory has 8 real positions
    got = xa(x, mem, mask)
    q = xa.q(x).view(2, 7, 4, 8)
    k, v = xa.memory_kv(mem)
    k, v = k.repeat_interleave(2, 2), v.repeat_interleave(2, 2)
    s = torch.einsum("bthd,bshd->bhts", q, k) / 8 ** 0.5
    p = s.masked_fill(~mask[:, None, None], float("-inf")).softmax(-1)
    ref = xa.out(torch.einsum("bhts,bshd->bthd", p, v).reshape(2, 7, 32))
    assert_close(got, ref, atol=1e-5)
    # padded memory positions are ignored; precomputed keys/values give the same result
    assert_close(got[1:], xa(x[1:], mem[1:, :8]), atol=1e-5)
    assert_close(xa(x, xa.memory_kv(mem), mask), got, atol=0)


class DecoderBlock(nn.Module):
    """Pre-norm decoder block: causal self-attention, cross-attention to a memory, MLP."""

    def __init__(self, d, heads):
        super().__init__()
        self.ln1, self.ln2, self.ln3 = nn.LayerNorm(d), nn.LayerNorm(d), nn.LayerNorm(d)
        self.self_attn = Attention(d, heads, heads, d // heads, layer_idx=0)
        self.cross = CrossAttention(d, heads)
        self.mlp = MLP(d, 4 * d, act="gelu", gated=False)

    def forward(self, x, memory, memory_mask=None):
        ctx = SeqContext(positions=torch.arange(x.shape[1]).expand(x.shape[:2]))
        x = x + self.self_attn(self.ln1(x), ctx=ctx)
        x = x + self.cross(self.ln2(x), memory, memory_mask)
        return x + self.mlp(self.ln3(x))


def test_cross_attention_in_a_decoder_block():
    torch.manual_seed(0)
    blk = DecoderBlock(32, 4)
    encoder = nn.Linear(16, 32)
    x, src = torch.randn(2, 9, 32), torch.randn(2, 13, 16)
    y = blk(x, encoder(src))
    # causal over the target, full over the memory
    x2 = x.clone()
    x2[:, 6:] += 1.0
    assert_close(blk(x2, encoder(src))[:, :6], y[:, :6], atol=1e-6)
    src2 = src.clone()
    src2[:, -1] += 1.0                                          # the last memory position reaches every query
    assert (blk(x, encoder(src2)) - y).abs().amax(-1).min() > 1e-4
    # the encoder learns through the cross-attention
    y.square().mean().backward()
    assert encoder.weight.grad is not None and encoder.weight.grad.abs().sum() > 0
