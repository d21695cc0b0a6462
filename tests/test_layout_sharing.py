"""Weight-shared layers `X@k`: parsing and its errors, ties kept through init, counting, training, checkpoints
(safetensors with shared tensors), meta-device loading with assign=True and the transformers wrapper."""
import pytest
import torch

from conftest import assert_close, decode_logits
from hybridlm import CausalLM
from hybridlm.errors import ConfigError
from hybridlm.models import ModelConfig
from hybridlm.models.layout import Tagged, flatten, parse_layout, shared_groups
from hybridlm.models.registry import LETTERS

SMALL = dict(d_model=32, n_heads=4, vocab_size=61, ssd_headdim=16, ssd_d_state=8, mlp_hidden=48, max_seq_len=64)


def test_parse_tags():
    items = parse_layout("(S*2 Z@0 S Z@1 S)*2", LETTERS.keys())
    assert "".join(flatten(items)) == "SSZSZS" * 2
    tagged = [it for it in items if isinstance(it, Tagged)]
    assert [t.tag for t in tagged] == [0, 1, 0, 1] and tagged[0] == "Z" and tagged[0].col == 5
    assert shared_groups(items) == {0: [2, 8], 1: [4, 10]}
    assert parse_layout("A@3 * 2 M", LETTERS.keys()) == ["A", "A", "M"]
    assert shared_groups(parse_layout("A@3 * 2 M", LETTERS.keys())) == {3: [0, 1]}


@pytest.mark.parametrize("layout, col, msg", [
    ("S@0 A@0", 5, "tag @0 is already given to 'S'"),
    ("S @", 4, "expected a tag number"),
    ("(SA)@1", 5, "'@' must follow a letter"),
    ("@1 S", 1, "'@' must follow a letter"),
    ("X@0", 1, "unknown mixer letter 'X'"),
    ("[R@0 W M]", 3, "not available inside a two-hop block"),
])
def test_tag_errors_name_the_column(layout, col, msg):
    with pytest.raises(ConfigError, match="column") as e:
        ModelConfig(layout=layout, **SMALL)
    assert f"column {col}:" in str(e.value) and msg in str(e.value)


def test_shared_layers_must_have_one_config():
    with pytest.raises(ConfigError, match=r"layer_overrides differ between layers \[0, 2\]"):
        ModelConfig(layout="A@0 M A@0 M", layer_overrides={2: {"n_heads": 2}}, **SMALL)


def model(layout="A@0 M A@0 M@1 S M@1", **kw):
    return CausalLM(ModelConfig(layout=layout, **{**SMALL, **kw}))


def test_ties_survive_init_and_count_once():
    m, plain = model(), model(layout="AMAMSM")
    a0, a1 = m.blocks[0], m.blocks[2]
    assert a0 is not a1 and a0.mixer.layer_idx == 0 and a1.mixer.layer_idx == 2    # own modules, own cache slots
    assert a0.mixer.qkv.weight is a1.mixer.qkv.weight and a0.norm.weight is a1.norm.weight
    assert m.blocks[3].mixer.w_in.weight is m.blocks[5].mixer.w_in.weight
    shared = sum(p.numel() for p in a0.parameters()) + sum(p.numel() for p in m.blocks[3].parameters())
    assert m.num_parameters() == plain.num_parameters() - shared
    assert len(m.state_dict()) == len(plain.state_dict())                      # every name is still there
    m.reset_parameters()
    assert a0.mixer.qkv.weight is a1.mixer.qkv.weight


def test_gradient_sums_over_occurrences_and_training_keeps_the_tie():
    m, plain = model(), model(layout="AMAMSM")
    plain.load_state_dict(m.state_dict())                  # the same weights, untied: each occurrence its own copy
    ids = torch.randint(0, 61, (2, 12))
    m(ids, labels=ids).loss.backward()
    plain(ids, labels=ids).loss.backward()
    g, (g0, g2) = m.blocks[0].mixer.qkv.weight.grad, (plain.blocks[i].mixer.qkv.weight.grad for i in (0, 2))
    assert_close(g, g0 + g2, atol=1e-6)                    # one tensor's gradient: the sum over its occurrences
    assert not torch.allclose(g0, g2)
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    assert len(opt.param_groups[0]["params"]) == len(list(plain.parameters())) - len(list(m.blocks[0].parameters())) \
        - len(list(m.blocks[3].parameters()))             # each shared tensor updated once
    opt.step()
    assert m.blocks[0].mixer.qkv.weight is m.blocks[2].mixer.qkv.weight


def test_decode_matches_forward():
    m = model().eval()
    ids = torch.randint(0, 61, (2, 11))
    with torch.no_grad():
        assert_close(decode_logits(m, ids, 4), m(ids).logits, atol=1e-5, rtol=1e-5)


def test_checkpoint_round_trip_keeps_ties(tmp_path):
    from hybridlm.checkpoint import load_checkpoint, save_checkpoint
    m = model().eval()
    save_checkpoint(str(tmp_path / "ck"), m)
    back, _ = load_checkpoint(str(tmp_path / "ck"))                            # meta build + assign=True
    back.eval()
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
    assert back.blocks[0].mixer.qkv.weight is back.blocks[2].mixer.qkv.weight
    assert back.lm_head.weight is back.embed.weight
    assert back.num_parameters() == m.num_parameters()


def test_meta_build_assign_then_tie():
    m = model()
    with torch.device("meta"):
        empty = model()
    empty.load_state_dict(m.state_dict(), assign=True)
    assert empty.blocks[0].mixer.qkv.weight is not empty.blocks[2].mixer.qkv.weight    # what assign does
    empty.tie_weights()
    assert empty.blocks[0].mixer.qkv.weight is empty.blocks[2].mixer.qkv.weight
    assert empty.num_parameters() == m.num_parameters()


def test_transformers_wrapper_saves_and_loads_shared_layers(tmp_path):
    transformers = pytest.importorskip("transformers")
    from hybridlm.hf.modeling import HybridLMForCausalLM
    m = model().eval()
    HybridLMForCausalLM.from_model(m).save_pretrained(tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.randint(0, 61, (2, 9))
    with torch.no_grad():
        assert torch.equal(back(ids).logits, m(ids).logits)
    inner = back.model
    assert inner.blocks[0].mixer.qkv.weight is inner.blocks[2].mixer.qkv.weight
