"""Initialisation: every module initialises what it owns (`init_weights`), so a model built on the meta device and
initialised after `to_empty` is the model built eagerly, rule for rule and number for number; FSDP2 ranks initialise
their shards only, to the same numbers."""
import math

import pytest
import torch
from conftest import assert_close
from test_models import tiny_config
from test_parallel import WORLD, spawn, tiny

from hybridlm import CausalLM, ModelConfig
from hybridlm.layers.short_conv import ShortConv
from hybridlm.models.registry import LETTERS
from hybridlm.optim import param_groups

# together every letter, two-hop and parallel blocks, X@k sharing (Zamba2), a learned position table, the WM options
COVER = ["mamba2-attention", "rodimus++", "cheems", "doge", "jamba", "qwen3-next", "kimi-linear", "lfm2",
         "deepseek-sparse", "zamba2", "falcon-h1", "gpt"]


def test_presets_cover_every_letter():
    assert set().union(*({c for c in tiny_config(n).layout if c.isalpha()} for n in COVER)) == set(LETTERS)


def meta_built(cfg: ModelConfig) -> CausalLM:
    with torch.device("meta"):
        m = CausalLM(cfg)
    assert all(p.is_meta for p in m.parameters())
    m.to_empty(device="cpu")
    return m


@pytest.mark.parametrize("name", COVER + ["hyper"])
def test_meta_build_then_init_is_the_eager_build(name):
    """Exact: the eager build is itself a meta build + to_empty + init_weights, so the RNG is drawn in one order."""
    cfg = tiny_config("llama", hyper_connections=2, hc_manifold=False) if name == "hyper" else tiny_config(name)
    torch.manual_seed(0)
    eager = CausalLM(cfg)
    m = meta_built(cfg)
    with torch.no_grad():
        for p in m.parameters():
            p.fill_(float("nan"))         # whatever to_empty left: init_weights must overwrite every element
        for b in m.buffers():
            b.fill_(float("nan"))
    torch.manual_seed(0)
    m.init_weights()
    a, b = eager.state_dict(), m.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), f"{name}: {k}"
    ids = torch.randint(0, cfg.vocab_size, (1, 12))
    assert torch.equal(eager.eval()(ids).logits, m.eval()(ids).logits)


def _std_ok(w, std, name):
    assert abs(w.float().std().item() / std - 1) < 0.1, f"{name}: std {w.std().item():.4g}, want {std:.4g}"
    assert abs(w.float().mean().item()) < 3 * std / math.sqrt(w.numel()) + 1e-3, name


@pytest.mark.parametrize("name", COVER)
def test_init_statistics_per_parameter_kind(name):
    """Today's rules, per parameter kind: N(0, std) projections and embeddings, residual outputs N(0, std/√L), norms
    1, biases 0, Mamba-2's dt_bias / A_log / D, the conv as PyTorch's Conv1d, Rodimus' released gate init."""
    cfg = tiny_config(name, d_model=128)
    torch.manual_seed(0)
    m = CausalLM(cfg)
    std, out_std = cfg.init_std, cfg.init_std / math.sqrt(m.num_layers)
    residual_out = ("out_proj.weight", "o_proj.weight", "w_out.weight", "out.weight")
    seen = set()
    for n, p in m.named_parameters():
        leaf = n.rsplit(".", 1)[-1]
        if ".conv." in n:                              # ShortConv: U(±1/√K) weight (and bias, or 0 for LFM2)
            assert p.abs().max() <= p.shape[-1] ** -0.5 if leaf == "weight" else True, n
            kind = "conv"
        elif leaf == "dt_bias" or n.endswith("dt_proj.bias") or leaf == "g_bias":
            dt = torch.nn.functional.softplus(p)
            assert dt.min() >= 1e-4 - 1e-9 and dt.max() <= 0.1 + 1e-6, n
            kind = "dt"
        elif leaf == "A_log":
            if p.dim() == 2:                           # Mamba-1: S4D-real A[c, i] = -(i + 1)
                assert torch.equal(p, torch.arange(1, p.shape[1] + 1.0).log().expand_as(p)), n
            else:
                assert p.min() >= 0 and p.max() <= math.log(16) + 1e-6, n
            kind = "A_log"
        elif leaf in ("D", "norm_weight", "residual_weight", "res_weight", "dt_norm", "b_norm", "c_norm", "v_table",
                      "pos_mask") or (p.dim() == 1 and "norm" in n and leaf == "weight"):
            assert torch.equal(p, torch.ones_like(p)), n
            kind = "ones"
        elif leaf == "bias" and "norm" in n or leaf in ("A",) or leaf == "bias" and p.dim() == 1 and "conv" not in n \
                and "tau" not in n and "beta_up" not in n:
            assert torch.equal(p, torch.zeros_like(p)), n
            kind = "zeros"
        elif any(g in n for g in ("qk_proj", "gate_proj", "beta_down", "beta_up")) and ".mixer." in n and \
                name.startswith("rodimus"):
            if leaf == "bias":
                assert torch.equal(p, torch.zeros_like(p)), n
            else:                                      # xavier-uniform, gain 2^-2.5
                bound = 2 ** -2.5 * math.sqrt(6 / sum(p.shape))
                assert p.abs().max() <= bound and abs(p.std() / (bound / math.sqrt(3)) - 1) < 0.1, n
            kind = "gate"
        elif n.endswith("dt_proj.weight") and ".mixer." in n and "B" in cfg.layout:   # Mamba-1: U(±dt_rank^-½)
            bound = p.shape[1] ** -0.5
            assert p.abs().max() <= bound and abs(p.std() / (bound / math.sqrt(3)) - 1) < 0.1, n
            kind = "dt_proj"
        elif leaf == "tau_bias":
            assert torch.sigmoid(p).min() >= 1 / 16 - 1e-6 and torch.sigmoid(p).max() <= 0.9 + 1e-6, n
            kind = "tau"
        elif n.endswith("feed.proj.weight") or n.endswith(residual_out) and ".feed." not in n:   # Zamba2: proj only
            _std_ok(p, out_std, n)
            kind = "residual out"
        elif p.dim() >= 2 and p.numel() >= 1000 and leaf in ("weight", "w_up", "w_gate", "w_down"):
            _std_ok(p, std, n)
            kind = "N(0, std)"
        else:
            continue
        seen.add(kind)
    assert {"N(0, std)", "residual out"} <= seen, seen
    if any(c in cfg.layout for c in "SBRGK"):
        assert {"dt", "A_log" if "R" not in cfg.layout else "gate"} <= seen, seen
    if any(isinstance(x, ShortConv) for x in m.modules()):
        assert "conv" in seen, seen


def test_tied_and_shared_weights_are_initialised_once(monkeypatch):
    """A tied LM head is the embedding; the tensors `Z@0` occurrences share are one tensor, drawn once, by the
    first occurrence, while each occurrence draws its own adapters and output projection."""
    cfg = tiny_config("zamba2", zamba_adapter_rank=4, zamba_attn_adapter=True).replace(layout="Z@0 S Z@1 S Z@0 S")
    assert cfg.tie_embeddings
    drawn = []
    real = torch.nn.init.normal_

    def normal_(tensor, mean=0.0, std=1.0, generator=None):
        drawn.append(tensor.data_ptr())
        return real(tensor, mean, std, generator)
    monkeypatch.setattr(torch.nn.init, "normal_", normal_)
    m = CausalLM(cfg)
    assert m.lm_head.weight is m.embed.weight and drawn.count(m.embed.weight.data_ptr()) == 1
    zs = [b.feed for b in m.blocks if hasattr(b, "feed")]
    first, later = zs[0], zs[2:]
    assert later and all(z.qkv.weight is first.qkv.weight and z.w_in.weight is first.w_in.weight for z in later)
    for p in (first.qkv.weight, first.out.weight, first.w_in.weight, first.w_out.weight):
        assert drawn.count(p.data_ptr()) == 1
    for z in later:                                    # per occurrence: drawn by each, so they differ
        assert z.proj.weight is not first.proj.weight and not torch.equal(z.proj.weight, first.proj.weight)
        assert not torch.equal(z.mlp_adapter.up.weight, first.mlp_adapter.up.weight)


@pytest.mark.parametrize("name", ["mamba2-attention", "rodimus++", "kimi-linear", "lfm2"])
def test_checkpoint_into_a_meta_built_model_gives_the_same_logits(tmp_path, name):
    from hybridlm.checkpoint import load_checkpoint, save_checkpoint
    torch.manual_seed(0)
    m = CausalLM(tiny_config(name)).eval()
    ids = torch.randint(0, 97, (2, 16))
    path = save_checkpoint(str(tmp_path), m)
    loaded, _ = load_checkpoint(path)
    assert not any(p.is_meta for p in loaded.parameters())
    assert torch.equal(loaded.eval()(ids).logits, m(ids).logits)
    # a state dict from before ShortConv (`mixer.conv_weight`, `mixer.conv_bias`) loads too
    old = {k.replace(".conv.weight", ".conv_weight").replace(".conv.bias", ".conv_bias"): v
           for k, v in m.state_dict().items()}
    assert any(k.endswith("conv_weight") for k in old)
    fresh = meta_built(m.config)
    fresh.load_state_dict(old, strict=True)
    assert torch.equal(fresh.eval()(ids).logits, m(ids).logits)


def test_short_conv_is_one_module_in_all_six_mixers():
    for name in ("mamba2", "mamba", "rodimus", "kimi-linear", "qwen3-next", "lfm2"):
        m = CausalLM(tiny_config(name))
        assert any(isinstance(x, ShortConv) for x in m.modules()), name
        assert not any(n.endswith(("conv_weight", "conv_bias")) for n, _ in m.named_parameters()), name


def test_no_decay_follows_names_and_dims():
    m = CausalLM(tiny_config("jamba"))            # B: a 2-D A_log
    m2 = CausalLM(tiny_config("doge", wm_dyn_mask="position"))
    for model in (m, m2):
        decay, no_decay = (g["params"] for g in param_groups(model, 0.1))
        names = {id(p): n for n, p in model.named_parameters()}
        assert all(p.dim() >= 2 for p in decay)
        assert {names[id(p)].rsplit(".", 1)[-1] for p in no_decay if p.dim() >= 2} <= {"A_log", "pos_mask"}
    assert any(names[id(p)].endswith("pos_mask") for p in no_decay)
    assert any(n.endswith("A_log") and p.dim() == 2 and not any(p is q for q in param_groups(m, 0.1)[0]["params"])
               for n, p in m.named_parameters())


# --- FSDP2: a meta-built model, sharded, then initialised shard by shard ----------------------------------------
def _fsdp_meta_init(rank):
    from hybridlm.train.parallel import parallelize
    for tied in (True, False):
        cfg = tiny("mamba2-attention", tie_embeddings=tied)
        torch.manual_seed(0)
        ref = CausalLM(cfg)
        with torch.device("meta"):
            model = CausalLM(cfg)
        torch.manual_seed(0)
        parallelize(model, "fsdp", world=WORLD, checkpointing=True)
        assert (model.lm_head.weight is model.embed.weight) == tied
        local = sum(p.to_local().numel() for p in model.parameters())
        assert local < 0.75 * ref.num_parameters()       # this rank allocated its shards, not the model
        got = {n.replace("_checkpoint_wrapped_module.", ""): p.full_tensor() for n, p in model.named_parameters()}
        for n, p in ref.named_parameters():
            assert torch.equal(got[n], p), f"{n} (tied={tied})"
        sizes = [len(g["params"]) for g in param_groups(model, 0.1)]
        assert sizes == [len(g["params"]) for g in param_groups(ref, 0.1)]
        ids = torch.randint(0, 64, (2, 12))
        assert_close(model(ids).logits, ref(ids).logits, rtol=1e-5, atol=1e-6)


def test_fsdp_initialises_each_shard_like_one_process():
    spawn(_fsdp_meta_init)
