"""Hyper-connections (model option `hyper_connections=n`): mHC residual matrices are doubly stochastic, the n=1
identity setting is exactly the plain residual model, and n streams keep every model contract (decode = full
forward, padding, training) on any layout."""
import pytest
import torch

from conftest import assert_close, assert_trains, decode_logits, padded_logits
from hybridlm import CausalLM, ModelConfig
from hybridlm.errors import ConfigError
from hybridlm.layers.hyper_connections import HyperConnection

TINY = dict(d_model=64, n_heads=4, vocab_size=97, ssd_headdim=16, ssd_d_state=16, ssd_chunk_size=8, max_seq_len=128)
LAYOUTS = ["(AM)*2", "S A M S"]


def model(layout, **kw) -> CausalLM:
    return CausalLM(ModelConfig(layout=layout, **TINY, **kw)).eval()


def scramble(m, scale=1.0):
    """Random mixing weights (the init is too tame to test anything): static logits and dynamic logits each
    with standard deviation about `scale`."""
    with torch.no_grad():
        for name, p in m.named_parameters():
            if name.endswith(".mix.proj"):
                p.copy_(scale * torch.randn_like(p) / p.shape[1] ** 0.5)
            elif name.endswith(".mix.static"):
                p.copy_(scale * torch.randn_like(p))
            elif name.endswith(".mix.scale"):
                p.fill_(1.0)
    return m


@pytest.mark.parametrize("scale", [None, 0.35])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_residual_matrix_is_doubly_stochastic(layout, scale):
    m = model(layout, hyper_connections=4)
    if scale is not None:          # mixing logits of std 0.5 in all, as after some training
        scramble(m, scale)
    m(torch.randint(0, 97, (2, 19)))
    hcs = [b for b in m.blocks if isinstance(b, HyperConnection)]
    assert len(hcs) == len(m.blocks) > 0
    for hc in hcs:
        res = hc.last_res                                          # [B, T, 4, 4], per token
        assert res.shape == (2, 19, 4, 4) and (res >= 0).all()
        assert (res.sum(-1) - 1).abs().max() <= 1e-5, "rows"
        assert (res.sum(-2) - 1).abs().max() <= 1e-5, "columns"


@pytest.mark.parametrize("layout", LAYOUTS)
def test_one_stream_identity_setting_is_exactly_the_plain_residual_model(layout):
    plain = model(layout)
    hc = model(layout, hyper_connections=1, hc_manifold=False)   # original HC init: pre = post = res = 1
    sd = {k.replace(".norm.", ".block.norm.", 1).replace(".mixer.", ".block.mixer.", 1)
          if k.startswith("blocks.") else k: v for k, v in plain.state_dict().items()}
    missing, unexpected = hc.load_state_dict(sd, strict=False)
    assert not unexpected and all(".mix." in k for k in missing)
    ids = torch.randint(0, 97, (2, 23))
    a, b = plain(ids, labels=ids, return_logits=True), hc(ids, labels=ids, return_logits=True)
    assert torch.equal(a.logits, b.logits) and torch.equal(a.loss, b.loss)
    a.loss.backward()
    b.loss.backward()
    # backward sums the same terms through other kernels: equal up to float rounding
    assert_close(hc.embed.weight.grad, plain.embed.weight.grad, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("manifold", [True, False])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_streams_keep_decode_padding_and_training_contracts(layout, manifold):
    m = scramble(model(layout, hyper_connections=3, hc_manifold=manifold), scale=0.3)
    ids = torch.randint(0, 97, (2, 21))
    full = m(ids).logits
    assert_close(decode_logits(m, ids, 8), full, atol=2e-5)
    assert_close(padded_logits(m, ids[:1], torch.randint(0, 97, (1, 4))), full[:1], atol=2e-5)
    assert_trains(m, ids, 8, drop=0.3)
    assert all(p.grad is not None for n, p in m.named_parameters() if ".mix." in n)
    m2 = CausalLM(ModelConfig.from_dict(m.config.to_dict())).eval()
    m2.load_state_dict(m.state_dict())
    assert torch.equal(m2(ids).logits, m.eval()(ids).logits)


@pytest.mark.parametrize("bad, match", [
    (dict(hyper_connections=0), "hyper_connections .* must be >= 1"),
    (dict(hyper_connections=-2), "hyper_connections .* must be >= 1"),
    (dict(hyper_connections=2, hc_sinkhorn_iters=0), "hc_sinkhorn_iters"),
    (dict(hyper_connections=2, residual_scale=True), "pick one"),
])
def test_bad_options_raise_config_errors(bad, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig(layout="(AM)*2", **bad)
