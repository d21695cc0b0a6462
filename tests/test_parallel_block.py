"""The parallel block `{...}` of the layout language (Falcon-H1's attention beside Mamba-2): parsing, errors that
point at the column, and a model that decodes like its full forward, ignores padding and stops at resets."""
import re

import pytest
import torch

from conftest import assert_close, decode_logits, packed_logits, padded_logits
from hybridlm.errors import ConfigError
from hybridlm.models import CausalLM, ModelConfig
from hybridlm.models.layout import Hop, Parallel, flatten, parse_layout

LET = frozenset("ASMRWC")
TOKEN = frozenset("ASRWC")


def test_parse_parallel_blocks():
    items = parse_layout("({AS}M)*2 {S A}*2", LET, TOKEN)
    assert items == [("A", "S"), "M", ("A", "S"), "M", ("S", "A"), ("S", "A")]
    assert all(isinstance(items[i], Parallel) for i in (0, 2, 4, 5)) and not isinstance(items[0], Hop)
    assert flatten(items) == list("ASMASMSASA")
    hop = parse_layout("[RWM]", LET, TOKEN)[0]
    assert isinstance(hop, Hop) and not isinstance(hop, Parallel)


@pytest.mark.parametrize("layout,col,what", [
    ("{}M", 1, "empty parallel block"),
    ("A{AM}", 4, "channel mixer"),
    ("{A{S}}", 3, "no nesting"),
    ("{A(S)}", 3, "no nesting"),
    ("{AS", 4, "missing '}'"),
    ("AS}", 3, "unexpected '}'"),
    ("[R{AS}M]", 3, "inside a two-hop block"),
    ("{AX}", 3, "unknown mixer letter 'X'"),
    ("{A*2}", 3, "unexpected '*'"),
])
def test_errors_point_at_the_column(layout, col, what):
    with pytest.raises(ConfigError, match=f"at column {col}: .*{re.escape(what)}"):
        parse_layout(layout, LET, TOKEN)


def test_config_rejects_channel_mixer_in_braces():
    with pytest.raises(ConfigError, match="channel mixer"):
        ModelConfig(layout="({AM}M)*2", d_model=32, n_heads=2)


def small(**kw):
    kw = dict(layout="({AS}M)*2", vocab_size=61, d_model=32, n_heads=4, n_kv_heads=2, ssd_headdim=8, ssd_d_state=8,
              ssd_chunk_size=4, max_seq_len=64, **kw)
    return CausalLM(ModelConfig(**kw)).eval()


def test_block_sums_mixers_on_one_norm():
    m = small()
    blk = m.blocks[0]
    x = torch.randn(2, 7, 32)
    ctx = m._context(torch.zeros(2, 7, dtype=torch.long), None, None, None)
    h = blk.norm(x)
    want = x + blk.mixer[0](h, ctx=ctx) + blk.mixer[1](h, ctx=ctx)
    assert_close(blk(x, ctx, None), want, atol=1e-6)
    assert m.num_layers == 6 and [b.mixer[1].layer_idx for b in (m.blocks[0], m.blocks[2])] == [1, 4]


@pytest.mark.parametrize("layout", ["({AS}M)*2", "{SAS} M {A S}"])
def test_decode_equals_full_forward(layout):
    m = small() if layout.startswith("(") else CausalLM(small().config.replace(layout=layout)).eval()
    ids = torch.randint(0, 61, (2, 13))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(decode_logits(m, ids, 5), full, atol=1e-4)
        assert_close(decode_logits(m, ids, 4, 9), full, atol=1e-4)


@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions(side):
    m = small()
    ids, pad = torch.randint(0, 61, (2, 11)), torch.randint(0, 61, (2, 5))
    with torch.no_grad():
        assert_close(padded_logits(m, ids, pad, side), m(ids).logits, atol=1e-4)


def test_resets_equal_separate_runs():
    m = small()
    assert_close(*packed_logits(m, torch.randint(0, 61, (1, 6)), torch.randint(0, 61, (1, 7))), atol=1e-4)


def test_hyper_connections_and_generation():
    m = small(hyper_connections=2)
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert_close(decode_logits(m, ids, 4), m(ids).logits, atol=1e-4)
    out = small().generate(ids[:1], 4, temperature=0)
    assert out.shape == (1, 13)
    loss = small()(ids, labels=ids).loss
    loss.backward()
