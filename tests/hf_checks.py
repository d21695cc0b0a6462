"""The checks every transformers cross-check runs on a converted model: logits, left padding, greedy generate,
directory conversion + `info`, and preset = twin. Each takes the transformers model (random weights, eval mode)."""
import torch

from hybridlm import presets
from hybridlm.cli import main as cli
from hybridlm.hf import from_transformers
from hybridlm.hf.common import TWINS
from hybridlm.hf.convert import config_from_transformers
from hybridlm.checkpoint import load_checkpoint

TOL = 1e-4                                           # float32 logits, random weights


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def _ids(hf, B, T, seed=1):
    return torch.randint(0, hf.config.vocab_size, (B, T), generator=torch.Generator().manual_seed(seed))


def assert_logits_match(hf, ours=None, B=2, T=21, tol=TOL):
    """Our converted model's logits = transformers' (T odd: not a multiple of any chunk size). Returns ours."""
    ours = ours if ours is not None else from_transformers(hf)
    x = _ids(hf, B, T)
    with torch.no_grad():
        ref, got = hf(x).logits, ours(x).logits
    assert got.shape == ref.shape and max_diff(got, ref) <= tol
    return ours


def assert_left_padding_matches(hf, ours=None, T=17, pads=(4, 0, 9), positions=True, tol=TOL):
    """A left-padded batch: real positions equal transformers' (given position ids counted from each row's first
    real token, where its attention needs them)."""
    ours = ours if ours is not None else from_transformers(hf)
    x = _ids(hf, len(pads), T)
    mask = torch.ones_like(x)
    for row, p in enumerate(pads):
        mask[row, :p] = 0
    kw = dict(position_ids=(mask.cumsum(1) - 1).clamp(min=0)) if positions else {}
    with torch.no_grad():
        ref = hf(x, attention_mask=mask, **kw).logits
        got = ours(x, attention_mask=mask).logits
    real = mask.bool()
    assert max_diff(got[real], ref[real]) <= tol
    return ours, x, got


def assert_greedy_matches(hf, ours=None, B=2, T=11, n=6):
    """Greedy generation with transformers' own cache = ours, token for token."""
    ours = ours if ours is not None else from_transformers(hf)
    x = _ids(hf, B, T)
    with torch.no_grad():
        ref = hf.generate(x, max_new_tokens=n, do_sample=False, use_cache=True)
    assert torch.equal(ours.generate(x, n, temperature=0), ref)


def assert_directory_converts(hf, tmp_path, capsys=None, info: str | None = None, T=13):
    """save_pretrained -> `hybridlm convert --from-hf` -> our checkpoint with transformers' logits; `info` prints
    `info` (the layout line). Returns our loaded model."""
    hf.save_pretrained(tmp_path / "hf")
    assert cli(["convert", "--from-hf", str(tmp_path / "hf"), "--out", str(tmp_path / "run")]) == 0
    ours = load_checkpoint(str(tmp_path / "run"))[0].eval()
    x = _ids(hf, 2, T)
    with torch.no_grad():
        assert max_diff(ours(x).logits, hf(x).logits) <= TOL
    if info is not None:
        capsys.readouterr()
        assert cli(["info", "--checkpoint", str(tmp_path / "run"), "--context", "8"]) == 0
        assert info in capsys.readouterr().out
    return ours


def assert_twin_is_preset(name: str, d_model: int, n_layers: int, vocab_size: int = 300, max_seq_len: int = 512):
    """hf.common.TWINS[name] (what `bench --suite twins` times) converts to exactly the preset's config."""
    twin = TWINS[name](d_model, n_layers, vocab_size, max_seq_len)
    assert config_from_transformers(twin) == presets.get(name, d_model=d_model, n_layers=n_layers,
                                                         vocab_size=vocab_size, max_seq_len=max_seq_len)
