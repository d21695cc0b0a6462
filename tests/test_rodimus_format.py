"""Converting released Rodimus checkpoints (codefuse-ai/rodimus format): a tiny random directory written the way their
code writes it converts, and the converted model computes the function of their block, checked against a plain-torch
transcription of their equations (window W // 2 + 1, g ** τ, (n h) head tiling, embedding scale/norm)."""
import json
import math
import os

import pytest
import torch
import torch.nn.functional as F
from conftest import assert_close, decode_logits
from safetensors.torch import save_file

from hybridlm.cli import main as cli_main
from hybridlm.errors import CheckpointError, ConfigError, HybridLMError
from hybridlm.hf.rodimus_format import convert_rodimus_dir
from hybridlm.layers.rodimus import Rodimus
from hybridlm.layers.init import initialised
from hybridlm.models import CausalLM, ModelConfig
from hybridlm.train import load_checkpoint, load_pretrained

D, L, V, N = 32, 2, 300, 8
PLUS_ATTN = dict(num_heads=4, num_heads_k=2, num_heads_v=4, window_size=6, softmax_scale=None, rotary_emb_dim=-1,
                 rotary_emb_base=10000.0, rotary_emb_interleaved=False)
TEMPLATE = "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}" \
           "{% if add_generation_prompt %}<|assistant|>{% endif %}"


def their_config(block_type="rodimus_plus", **over):
    """config.json as their RodimusConfig writes it (the generic PretrainedConfig keys included)."""
    cfg = dict(model_type="rodimus", architectures=["RodimusForCausalLM"], block_type=block_type, d_model=D,
               n_layer=L, vocab_size=V, norm_epsilon=1e-5, initializer_range=0.02, rescale_prenorm_residual=True,
               residual_in_fp32=True, use_fast_path=True, use_fused_cross_entropy=False, use_fused_swiglu=True,
               dropout=0.0, activation_dropout=0.0, attention_dropout=0.0,
               mixer_cfg=dict(d_conv=4, expand_ratio=1.5, mem_size=N, input_gate_low_rank="auto", mode="fused_chunk"),
               attn_cfg=dict(PLUS_ATTN) if block_type == "rodimus_plus" else {},
               max_position_embeddings=64, bos_token_id=0, eos_token_id=1, pad_token_id=None,
               tie_word_embeddings=False, use_cache=True, use_scale_embedding=True, use_norm_embedding=True,
               torch_dtype="float32", transformers_version="4.44.0")
    cfg.update(over)
    return cfg


def their_tensors(cfg, g=None) -> dict:
    """Random weights under their names and shapes; some decay channels have softplus pre-activations near -20
    (decay ~1, g ~ 2e-9), where the old g^τ floor changed the logits."""
    g = g or torch.Generator().manual_seed(0)
    d, mc = cfg["d_model"], cfg["mixer_cfg"]
    m = -(-int(d * mc["expand_ratio"]) // 8) * 8
    n, K, r = mc["mem_size"], mc["d_conv"], mc["input_gate_low_rank"]
    r = max(d // 64, 16) if r == "auto" else r

    def w(*shape, std=0.3):
        return torch.randn(*shape, generator=g) * std

    sd = {"model.embeddings.weight": w(cfg["vocab_size"], d, std=1.0), "model.norm_f.weight": 1 + w(d, std=0.1),
          "lm_head.weight": w(cfg["vocab_size"], d)}
    if cfg["use_norm_embedding"]:
        sd["model.embed_norm.weight"] = 1 + w(d, std=0.1)
    for i in range(cfg["n_layer"]):
        p, q = f"model.layers.{i}.", f"model.layers.{i}.mixer.inner_mixer."
        g_bias = torch.where(torch.arange(n) % 2 == 0, torch.full((n,), -20.0), w(n, std=1.0) - 2)
        sd.update({p + "mixer_norm.weight": 1 + w(d, std=0.1), p + "mixer.fc.weight": w(2 * m, d),
                   q + "short_conv.conv1d.weight": w(m, 1, K), q + "short_conv.conv1d.bias": w(m, std=0.1),
                   q + "in_proj.weight": w(2 * n, m), q + "mem_gate_proj.weight": w(2 * n, m, std=0.05),
                   q + "mem_gate_proj.bias": torch.cat((g_bias, w(n, std=1.0))),
                   q + "ch_gate_proj.0.weight": w(r, m), q + "ch_gate_proj.1.weight": w(m, r),
                   q + "ch_gate_proj.1.bias": w(m, std=0.1), q + "residual_weight": 1 + w(m, std=0.1),
                   p + "mixer.act_norm.weight": 1 + w(m, std=0.1), p + "mixer.out_proj.weight": w(d, m)})
        if cfg["block_type"] == "rodimus_plus":
            a = cfg["attn_cfg"]
            hd, f = d // a["num_heads"], -(-int(d * a.get("ffn_expand_ratio", 4 / 3)) // 8) * 8
            sd.update({p + "attn_norm.weight": 1 + w(d, std=0.1), p + "ffn_norm.weight": 1 + w(d, std=0.1),
                       p + "attn.q_proj.weight": w(a["num_heads"] * hd, d),
                       p + "attn.k_proj.weight": w(a["num_heads_k"] * hd, d),
                       p + "attn.v_proj.weight": w(a["num_heads_v"] * hd, d), p + "attn.out_proj.weight": w(d, d),
                       p + "ffn.fc.weight": w(2 * f, d), p + "ffn.out_proj.weight": w(d, f)})
    return sd


def write_tokenizer(directory, eos="<|role_end|>"):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=V, special_tokens=["<|endoftext|>", eos, "<|user|>", "<|assistant|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(["def f(x): return x + 1"] * 4, trainer=trainer)
    tok.save(os.path.join(directory, "tokenizer.json"))
    with open(os.path.join(directory, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "RodimusTokenizer", "eos_token": {"content": eos, "special": True},
                   "bos_token": "<|endoftext|>", "chat_template": TEMPLATE}, f)


def write_release(directory, cfg, sd, shards=1, dtype=torch.float32):
    """A checkpoint directory as their save_pretrained writes it: config.json, model.safetensors (or `shards` files
    with model.safetensors.index.json), tokenizer files."""
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(cfg, f)
    names = list(sd)
    if shards == 1:
        save_file({k: sd[k].to(dtype) for k in names}, os.path.join(directory, "model.safetensors"))
    else:
        wmap = {}
        for s in range(shards):
            fname = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
            part = names[s::shards]
            save_file({k: sd[k].to(dtype) for k in part}, os.path.join(directory, fname))
            wmap.update({k: fname for k in part})
        with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": 0}, "weight_map": wmap}, f)
    write_tokenizer(directory)
    return str(directory)


# --- their forward, transcribed from their equations (float64, token-by-token recurrence) -----------------------
def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _flow(h, sd, p, cfg):
    """RodimusFlow: GLU around ShortConv + DDTS gated linear attention (one head, state n × m)."""
    q, eps = p + "inner_mixer.", cfg["norm_epsilon"]
    x, gate = (h @ sd[p + "fc.weight"].T).chunk(2, -1)
    w = sd[q + "short_conv.conv1d.weight"]
    xc = F.conv1d(F.pad(x.transpose(1, 2), (w.shape[-1] - 1, 0)), w, sd[q + "short_conv.conv1d.bias"],
                  groups=w.shape[0])
    xc = F.silu(xc.transpose(1, 2))
    r, k = (xc @ sd[q + "in_proj.weight"].T).chunk(2, -1)
    u = torch.sigmoid(x @ sd[q + "ch_gate_proj.0.weight"].T @ sd[q + "ch_gate_proj.1.weight"].T
                      + sd[q + "ch_gate_proj.1.bias"]) * x
    sel, tau = (xc @ sd[q + "mem_gate_proj.weight"].T + sd[q + "mem_gate_proj.bias"]).chunk(2, -1)
    sel, tau = F.softplus(sel), torch.sigmoid(tau)
    k = F.normalize(k, dim=-1, eps=1e-12) * sel ** tau
    decay = torch.exp(-sel * tau)
    S, outs = torch.zeros(h.shape[0], k.shape[-1], u.shape[-1], dtype=h.dtype), []
    for t in range(h.shape[1]):
        S = decay[:, t, :, None] * S + k[:, t, :, None] * u[:, t, None, :]
        outs.append(torch.einsum("bn,bnm->bm", r[:, t], S) / math.sqrt(k.shape[-1]))
    o = torch.stack(outs, 1) + xc * sd[q + "residual_weight"]
    return _rms(o * F.silu(gate), sd[p + "act_norm.weight"], eps) @ sd[p + "out_proj.weight"].T


def _rope(x, base):
    T, hd = x.shape[1], x.shape[-1]
    ang = torch.arange(T, dtype=x.dtype)[:, None] / base ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x.chunk(2, -1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)


def _ska(x, sd, p, a):
    """SlideWindowSharedKeyAttention: keys and values tiled `(n h)`, each query sees window_size // 2 earlier keys."""
    B, T, d = x.shape
    H, Hk, Hv = a["num_heads"], a["num_heads_k"], a["num_heads_v"]
    hd = d // H
    q = _rope((x @ sd[p + "q_proj.weight"].T).view(B, T, H, hd), a["rotary_emb_base"])
    k = _rope((x @ sd[p + "k_proj.weight"].T).view(B, T, Hk, hd), a["rotary_emb_base"]).repeat(1, 1, H // Hk, 1)
    v = (x @ sd[p + "v_proj.weight"].T).view(B, T, Hv, hd).repeat(1, 1, H // Hv, 1)
    s = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(hd)
    t, j = torch.arange(T)[:, None], torch.arange(T)[None]
    W = a["window_size"]
    s = s.masked_fill(~((j <= t) & ((t - j <= W // 2) if W and W > 0 else True)), float("-inf"))
    y = torch.einsum("bhts,bshd->bthd", s.softmax(-1), v).reshape(B, T, d)
    return y @ sd[p + "out_proj.weight"].T


def their_logits(sd, cfg, ids):
    sd = {k: v.double() for k, v in sd.items()}
    eps = cfg["norm_epsilon"]
    h = sd["model.embeddings.weight"][ids]
    if cfg["use_scale_embedding"]:
        h = h * math.sqrt(cfg["mixer_cfg"]["mem_size"])
    if cfg["use_norm_embedding"]:
        h = _rms(h, sd["model.embed_norm.weight"], eps)
    res = None
    for i in range(cfg["n_layer"]):
        p = f"model.layers.{i}."
        res = h if res is None else h + res
        h = _flow(_rms(res, sd[p + "mixer_norm.weight"], eps), sd, p + "mixer.", cfg)
        if cfg["block_type"] == "rodimus_plus":  # two-hop: the attention reaches the stream through the GLU only
            res = h + res
            a = _ska(_rms(res, sd[p + "attn_norm.weight"], eps), sd, p + "attn.", cfg["attn_cfg"])
            x, gate = (_rms(a + res, sd[p + "ffn_norm.weight"], eps) @ sd[p + "ffn.fc.weight"].T).chunk(2, -1)
            h = (F.silu(gate) * x) @ sd[p + "ffn.out_proj.weight"].T
    return _rms(h + res, sd["model.norm_f.weight"], eps) @ sd["lm_head.weight"].T


# --- tests --------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("block_type,shards", [("rodimus", 1), ("rodimus_plus", 3)])
def test_converted_logits_equal_their_equations(tmp_path, block_type, shards):
    cfg = their_config(block_type)
    sd = their_tensors(cfg)
    ckpt = convert_rodimus_dir(write_release(tmp_path / "src", cfg, sd, shards=shards), str(tmp_path / "run"))
    model, tok = load_pretrained(ckpt)
    c = model.config
    assert c.rodimus_d_inner == 48 and c.embed_norm and c.embed_scale == math.sqrt(N) and not c.tie_embeddings
    if block_type == "rodimus_plus":
        assert c.layout == "[RWM]*2" and c.swa_window == 4 and c.n_k_heads == 2 and c.mlp_hidden == 48
    ids = torch.randint(0, V, (2, 17), generator=torch.Generator().manual_seed(1))
    assert_close(model(ids).logits, their_logits(sd, cfg, ids), rtol=1e-5, atol=1e-5, msg=block_type)
    assert_close(decode_logits(model, ids, 5), model(ids).logits, rtol=1e-5, atol=1e-5, msg="decode")
    assert tok.eos_token == "<|role_end|>" and tok.eos_id == tok.tok.token_to_id("<|role_end|>")


def test_full_attention_tied_and_plain_options(tmp_path):
    """window_size None -> full causal attention (letter A); tied head; integer expand; explicit low rank; one key
    head shared by 2 value heads and 4 query heads."""
    attn = dict(PLUS_ATTN, window_size=None, num_heads_k=1, num_heads_v=2, ffn_expand_ratio=2.0)
    cfg = their_config(attn_cfg=attn, tie_word_embeddings=True, use_scale_embedding=False, use_norm_embedding=False,
                       mixer_cfg=dict(d_conv=3, expand_ratio=2, mem_size=N, input_gate_low_rank=6))
    sd = their_tensors(cfg)
    del sd["lm_head.weight"]                      # their save_pretrained drops the tied head
    model, _ = load_checkpoint(convert_rodimus_dir(write_release(tmp_path / "src", cfg, sd), str(tmp_path / "run")))
    assert model.config.layout == "[RAM]*2" and model.lm_head.weight is model.embed.weight
    ids = torch.randint(0, V, (1, 12), generator=torch.Generator().manual_seed(2))
    sd["lm_head.weight"] = sd["model.embeddings.weight"]
    assert_close(model(ids).logits, their_logits(sd, cfg, ids), rtol=1e-5, atol=1e-5)


def test_g_pow_tau_near_decay_one():
    """Channels whose softplus pre-activation is far below -14 (decay ~1): the input gate is exactly g ** τ."""
    layer = initialised(Rodimus(16, layer_idx=0, d_state=8))
    with torch.no_grad():
        layer.g_bias.copy_(torch.tensor([-40.0, -30.0, -20.0, -15.0, -5.0, 0.0, 2.0, -90.0]))
        layer.gate_proj.weight.mul_(0.01)
    xc = torch.randn(2, 5, 32)
    log_a, in_gate = layer._gates(xc)
    raw = layer.gate_proj(xc)
    g, tau = F.softplus(raw[..., :8] + layer.g_bias), torch.sigmoid(raw[..., 8:] + layer.tau_bias)
    assert_close(in_gate[..., :7], g[..., :7] ** tau[..., :7], rtol=1e-6, atol=0)
    assert torch.isfinite(in_gate).all() and (in_gate[..., 2] < 1e-3).all()   # a 1e-6 floor gave ~1e-3 and above
    xc.requires_grad_(True)
    layer._gates(xc)[1].sum().backward()             # finite gradient where softplus underflows
    assert torch.isfinite(xc.grad).all() and torch.isfinite(layer.tau_bias.grad).all()


def test_dtype_kept_or_cast(tmp_path):
    cfg = their_config("rodimus", n_layer=1)
    src = write_release(tmp_path / "src", cfg, their_tensors(cfg), dtype=torch.bfloat16)
    model, _ = load_checkpoint(convert_rodimus_dir(src, str(tmp_path / "a")))
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, V, (1, 9))
    assert_close(decode_logits(model, ids, 4).float(), model(ids).logits.float(), rtol=0.05, atol=0.05)
    model, _ = load_checkpoint(convert_rodimus_dir(src, str(tmp_path / "b"), dtype="float32"))
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def _break(tmp_path, mutate_cfg=None, mutate_sd=None, shards=1):
    cfg = their_config()
    sd = their_tensors(cfg)
    if mutate_cfg:
        mutate_cfg(cfg)
    if mutate_sd:
        mutate_sd(sd)
    return write_release(tmp_path / "src", cfg, sd, shards=shards)


@pytest.mark.parametrize("mutate_cfg,match", [
    (lambda c: c.update(model_type="llama"), "model_type 'llama' is not a Rodimus checkpoint"),
    (lambda c: c.update(block_type="rodimus_mega"), "block_type"),
    (lambda c: c["attn_cfg"].update(softmax_scale="norm"), "attn_cfg.softmax_scale"),
    (lambda c: c["attn_cfg"].update(rotary_emb_scale_base=512), "attn_cfg.rotary_emb_scale_base"),
    (lambda c: c["attn_cfg"].update(num_heads_k=3), "attn_cfg.num_heads_k"),
    (lambda c: c["mixer_cfg"].update(normalize_epsilon=1e-6), "mixer_cfg.normalize_epsilon"),
    (lambda c: c["mixer_cfg"].update(use_short_conv=False), "mixer_cfg.use_short_conv"),
])
def test_unsupported_config_is_named(tmp_path, mutate_cfg, match):
    with pytest.raises(ConfigError, match=match):
        convert_rodimus_dir(_break(tmp_path, mutate_cfg=mutate_cfg), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


@pytest.mark.parametrize("mutate_sd,match", [
    (lambda sd: sd.pop("model.layers.1.mixer.inner_mixer.mem_gate_proj.bias"),
     "tensor 'model.layers.1.mixer.inner_mixer.mem_gate_proj.bias' is missing"),
    (lambda sd: sd.update({"model.layers.0.attn.k_proj.weight": torch.zeros(32, D)}),
     r"model-0000\d-of-00003.safetensors: tensor 'model.layers.0.attn.k_proj.weight' has shape \[32, 32\], "
     r"expected \[16, 32\]"),
    (lambda sd: sd.update({"model.layers.2.mixer_norm.weight": torch.ones(D)}),
     "1 tensor.s. not used by the conversion, e.g. model.layers.2.mixer_norm.weight"),
])
def test_missing_misshaped_or_unused_tensor_is_named(tmp_path, mutate_sd, match):
    with pytest.raises(CheckpointError, match=match):
        convert_rodimus_dir(_break(tmp_path, mutate_sd=mutate_sd, shards=3), str(tmp_path / "run"))
    assert not os.path.exists(tmp_path / "run" / "checkpoint")


def test_truncated_shard_is_named(tmp_path):
    src = _break(tmp_path, shards=2)
    shard = os.path.join(src, "model-00002-of-00002.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) - 100)
    with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors is corrupt or truncated"):
        convert_rodimus_dir(src, str(tmp_path / "run"))


def test_cli_convert_info_generate_chat(tmp_path, capsys):
    cfg = their_config(n_layer=1)
    src = write_release(tmp_path / "src", cfg, their_tensors(cfg), dtype=torch.bfloat16)
    run = str(tmp_path / "run")
    assert cli_main(["convert", "--from-hf", src, "--out", run]) == 0
    assert cli_main(["info", "--checkpoint", run, "--context", "8", "16"]) == 0
    out = capsys.readouterr().out
    assert "[RWM]*1" in out and "parameters" in out
    for dtype in ("bfloat16", "float32"):
        assert cli_main(["generate", "--checkpoint", run, "--prompt", "def f", "--max-new-tokens", "4",
                         "--chat", "--dtype", dtype, "--temperature", "0"]) == 0
    assert capsys.readouterr().out.startswith("<|user|>def f<|role_end|><|assistant|>")
    assert cli_main(["convert", "--from-hf", str(tmp_path), "--out", run]) == 2      # no config.json
    with open(tmp_path / "other.json", "w") as f:
        json.dump({"model_type": "gpt2"}, f)
    os.replace(tmp_path / "other.json", tmp_path / "config.json")
    assert cli_main(["convert", "--from-hf", str(tmp_path), "--out", run]) == 2
    assert "model_type 'gpt2' cannot be converted" in capsys.readouterr().err


def test_n_k_heads_validation():
    ModelConfig(layout="AM", d_model=32, n_heads=4, n_kv_heads=4, n_k_heads=2)
    with pytest.raises(HybridLMError, match="n_k_heads"):
        ModelConfig(layout="AM", d_model=32, n_heads=4, n_kv_heads=2, n_k_heads=4)
    m = CausalLM(ModelConfig(layout="WM", d_model=32, n_heads=4, n_k_heads=2, swa_window=3, vocab_size=V)).eval()
    ids = torch.randint(0, V, (1, 10))
    assert_close(decode_logits(m, ids, 4), m(ids).logits)
