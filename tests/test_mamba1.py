"""The Mamba-1 letter B: decoding (with chunked prefill) = the full forward, padding leaves real positions unchanged,
packed documents = separate runs, training reduces the loss, impossible sizes fail at config time, presets, `info`."""
import os
import subprocess
import sys

import pytest
import torch

from conftest import assert_close, assert_trains, decode_logits, packed_logits, padded_logits
from hybridlm import CausalLM, ModelConfig, presets
from hybridlm.cache import RecurrentCache
from hybridlm.errors import ConfigError

SMALL = dict(vocab_size=61, d_model=32, mamba1_d_state=6, mamba1_chunk_size=4, n_heads=4)
CASES = {"plain": dict(layout="(BM)*2"), "jamba-norms-bias": dict(layout="BM AM", mamba1_bcdt_norm="weight",
                                                                    mamba1_bias=True, pos_embedding="none"),
         "falcon-norms-no-conv-bias": dict(layout="B*2", mamba1_bcdt_norm="plain", mamba1_conv_bias=False,
                                           mamba1_dt_rank=3, mamba1_expand=3, d_conv=3)}


def model(**kw):
    torch.manual_seed(0)
    m = CausalLM(ModelConfig(**{**SMALL, **kw}))
    with torch.no_grad():   # move the ones/zeros inits (D, norm weights, biases) off their defaults
        for name, p in m.named_parameters():
            if p.dim() == 1:
                p.add_(0.2 * torch.randn_like(p))
    return m.eval()


@pytest.mark.parametrize("case", sorted(CASES))
def test_decode_equals_full_forward(case):
    m = model(**CASES[case])
    ids = torch.randint(0, 61, (2, 14))
    with torch.no_grad():
        full = m(ids).logits
        assert_close(decode_logits(m, ids, 5, 9), full, msg="chunked prefill + decode")
        assert_close(decode_logits(m, ids, 14), full, msg="prefill only")


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("side", ["left", "right"])
def test_padding_leaves_real_positions(case, side):
    m = model(**CASES[case])
    ids, pad = torch.randint(0, 61, (2, 11)), torch.randint(0, 61, (2, 6))
    with torch.no_grad():
        assert_close(padded_logits(m, ids, pad, side), m(ids).logits)


def test_left_padded_decode_and_cache_state():
    m = model(layout="(BM)*2")
    ids, pad = torch.randint(0, 61, (2, 9)), torch.randint(0, 61, (2, 4))
    mask = torch.cat([torch.zeros(2, 4), torch.ones(2, 9)], 1).long()
    cache = m.make_cache(2)
    with torch.no_grad():
        m(torch.cat([pad, ids[:, :6]], 1), attention_mask=mask[:, :10], cache=cache)
        steps = [m(ids[:, t:t + 1], cache=cache).logits for t in range(6, 9)]
        ref = m(ids).logits[:, 6:]
    assert_close(torch.cat(steps, 1), ref)
    slot = cache.layers[0]
    assert isinstance(slot, RecurrentCache) and slot.state.dtype == torch.float32
    assert slot.state.shape == (2, 64, 6) and slot.conv.shape == (2, 3, 64)


def test_packed_documents_equal_separate_runs():
    m = model(layout="(BM)*2")
    assert_close(*packed_logits(m, torch.randint(0, 61, (1, 13)), torch.randint(0, 61, (1, 10))), atol=2e-5)


def test_bf16_forward_close_and_state_float32():
    m = model(layout="B*2")
    ids = torch.randint(0, 61, (2, 12))
    with torch.no_grad():
        ref = m(ids).logits
        cache = m.make_cache(2)
        got = m.to(torch.bfloat16)(ids, cache=cache).logits
    assert cache.layers[0].state.dtype == torch.float32
    assert_close(got, ref, rtol=0, atol=2e-2)             # 3.0e-3 seen (logits up to 0.84)


def test_trains_and_keeps_its_init():
    m = model(layout="BM", mamba1_bcdt_norm="weight")
    mixer = m.blocks[0].mixer
    fresh = CausalLM(ModelConfig(layout="B", **SMALL)).blocks[0].mixer
    assert_close(fresh.A_log, torch.log(torch.arange(1, 7.0)).repeat(64, 1), rtol=0, atol=0)   # S4D-real A
    assert (fresh.D == 1).all() and fresh.dt_proj.bias.abs().max() > 0                       # not re-initialised
    from hybridlm.optim import param_groups
    assert any(p is fresh.A_log for p in param_groups(fresh, 0.1)[1]["params"])   # a matrix, not decayed
    assert_trains(m, torch.randint(0, 61, (4, 24)), steps=8, drop=0.1)
    assert mixer.A_log.grad is not None and mixer.dt_norm.grad is not None


@pytest.mark.parametrize("field,value,match", [
    ("mamba1_d_state", 0, "mamba1_d_state"), ("d_conv", 0, "d_conv"),
    ("mamba1_expand", 0, "mamba1_expand"), ("mamba1_dt_rank", 0, "mamba1_dt_rank"),
    ("mamba1_bcdt_norm", "layer", "mamba1_bcdt_norm"), ("mamba1_norm_eps", 0.0, "mamba1_norm_eps"),
    ("mamba1_chunk_size", 0, "mamba1_chunk_size")])
def test_impossible_sizes_fail_at_config_time(field, value, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(layout="BM", **{**SMALL, field: value})
    ModelConfig(layout="AM", **{**SMALL, field: value})             # only layers using B check them


def test_presets():
    j = presets.get("jamba")
    assert j.layout == "(BM BO BM BO AM BO BM BO)*2" and j.pos_embedding == "none" and j.mamba1_bcdt_norm == "weight"
    assert not j.moe_norm_topk and j.moe_router == "softmax" and j.moe_experts == 16
    j = presets.get("jamba", d_model=64, n_layers=1)
    assert j.mamba1_dt_rank == 4 and j.head_dim == 8 and j.mlp_hidden == j.moe_hidden == 192
    assert presets.get("mamba", n_layers=3).layout == "B*3"
    assert "S" in presets.get("jamba-ssd").layout and "B" not in presets.get("jamba-ssd").layout


def test_info_shows_the_layout():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "hybridlm", "info", "--preset", "jamba", "--n-layers", "1", "--d-model",
                        "32", "--set", "n_heads=4", "--set", "n_kv_heads=1", "--set", "head_dim=8",
                        "--context", "4", "8"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "BM BO BM BO AM BO BM BO" in r.stdout and "bytes/token" in r.stdout
