"""`hybridlm convert` and transformers tokenizers: small random transformers checkpoints (Llama with GQA, sharded;
Mamba2 with ngroups 2; Doge dense and MoE; DeepseekV3) converted to hybridlm checkpoints and back (our wrapper, and
transformers' own class with --as-native), logits <= 1e-4 apart; AutoTokenizer round trips; one clear error for each
bad input."""
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import hybridlm  # noqa: E402,F401
from hybridlm.cli import main as cli  # noqa: E402
from hybridlm.data.tokenizer import BPETokenizer, ByteTokenizer, tokenizer_from_dir  # noqa: E402
from hybridlm.errors import CheckpointError, ConfigError, InputError  # noqa: E402
from hybridlm.hf.directory import convert_from_hf, export_to_hf  # noqa: E402
from hybridlm.train import load_checkpoint  # noqa: E402
from test_hf_deepseek import v3  # noqa: E402
from test_hf_doge import doge  # noqa: E402

V = 97


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=None, eos_token_id=None)).eval()


def mamba2():
    torch.manual_seed(0)
    return transformers.Mamba2ForCausalLM(transformers.Mamba2Config(
        vocab_size=V, hidden_size=64, num_hidden_layers=2, state_size=16, head_dim=16, num_heads=8, n_groups=2,
        chunk_size=16, tie_word_embeddings=True, bos_token_id=None, eos_token_id=None, pad_token_id=None)).eval()


CASES = {"llama-gqa-sharded": llama, "mamba2-ngroups2": mamba2, "doge-dense": lambda: doge(is_moe=False),
         "deepseek-v3": v3}


def max_diff(a, b):
    return (a - b).abs().max().item()


@pytest.mark.parametrize("case", CASES)
def test_from_hf_and_back(case, tmp_path):
    hf = CASES[case]()
    src = tmp_path / "hf"
    hf.save_pretrained(src, **({"max_shard_size": "40KB"} if "sharded" in case else {}))
    assert ("sharded" in case) == os.path.exists(src / "model.safetensors.index.json")
    ids = torch.randint(0, V, (2, 17))
    ref = hf(ids).logits
    assert cli(["convert", "--from-hf", str(src), "--out", str(tmp_path / "run")]) == 0
    ours, _ = load_checkpoint(str(tmp_path / "run"))
    assert max_diff(ours.eval()(ids).logits, ref) <= 1e-4
    assert cli(["convert", "--to-hf", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert max_diff(back(ids).logits, ref) <= 1e-4
    if case.startswith(("llama", "mamba2")):
        export_to_hf(str(tmp_path / "run"), str(tmp_path / "native"), native=True)
        native = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native")
        assert type(native) is type(hf) and max_diff(native(ids).logits, ref) <= 1e-4


def test_doge_moe_converts_every_weight(tmp_path):
    """transformers' CDMoE mixes tokens (its router view spans the tokens): the two agree on one token, and our export round trips."""
    hf = doge(is_moe=True)
    hf.save_pretrained(tmp_path / "hf")
    ckpt = convert_from_hf(str(tmp_path / "hf"), str(tmp_path / "run"), dtype="float32")
    ours = load_checkpoint(ckpt)[0].eval()
    one = torch.tensor([[35]])                              # one token: transformers routes it alone
    assert max_diff(ours(one).logits, hf(one).logits) <= 1e-4
    export_to_hf(str(tmp_path / "run"), str(tmp_path / "back"))
    ids = torch.randint(0, V, (2, 9))
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    # the same weights and function; not bitwise: the CPU's vector kernels (embedding_bag in the experts) may sum in
    # another order for tensors loaded at another memory alignment (seen: 2e-6)
    assert torch.equal(back.model.state_dict()["blocks.1.mixer.up_embed.weight"],
                       ours.state_dict()["blocks.1.mixer.up_embed.weight"])
    assert max_diff(back(ids).logits, ours(ids).logits) <= 1e-5


def test_as_native_refuses_what_is_not_exactly_llama_or_mamba2(tmp_path):
    """Llama has no q/k norm (LFM2's attention has: auto writes that class); a Mamba-2/attention mix with RoPE is no
    family's (tests/test_hf_native.py covers every family)."""
    from hybridlm import CausalLM, presets
    from hybridlm.train import save_checkpoint
    m = CausalLM(presets.get("transformer++", n_layers=1, d_model=32, n_heads=2, vocab_size=50, qk_norm=True))
    save_checkpoint(str(tmp_path), m)
    with pytest.raises(ConfigError, match="not exactly a Llama: qk_norm=True"):
        export_to_hf(str(tmp_path), str(tmp_path / "x"), native="llama")
    export_to_hf(str(tmp_path), str(tmp_path / "lfm2"), native=True)
    assert type(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "lfm2")).__name__ == "Lfm2ForCausalLM"
    m = CausalLM(presets.get("mamba2-attention", n_layers=2, d_model=32, n_heads=2, vocab_size=50, ssd_headdim=16))
    save_checkpoint(str(tmp_path), m)
    with pytest.raises(ConfigError, match="layout 'SA' exactly: the closest, NemotronH, stops at "
                                          "tie_embeddings=True, pos_embedding='rope'"):
        export_to_hf(str(tmp_path), str(tmp_path / "x"), native=True)


def test_as_native_takes_the_mamba2_preset(tmp_path):
    """The `mamba2` preset keeps the library's default pos_embedding "rope", which no S layer reads: it is exactly a
    Mamba2ForCausalLM and exports as one."""
    from hybridlm import CausalLM, presets
    from hybridlm.train import save_checkpoint
    torch.manual_seed(0)
    m = CausalLM(presets.get("mamba2", n_layers=2, d_model=32, vocab_size=50, ssd_headdim=16)).eval()
    assert m.config.pos_embedding == "rope"
    save_checkpoint(str(tmp_path / "run"), m)
    export_to_hf(str(tmp_path / "run"), str(tmp_path / "native"), native=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "native").eval()
    assert type(hf).__name__ == "Mamba2ForCausalLM"
    ids = torch.randint(0, 50, (1, 12))
    with torch.no_grad():
        assert max_diff(hf(ids).logits, m(ids).logits) < 1e-4


# --- tokenizers ----------------------------------------------------------------------------------------------
TEXT = "héllo wörld 🚀 <b>\t\n  two  spaces \x00 done\r\n漢字"


@pytest.mark.parametrize("kind", ["byte", "bpe"])
def test_auto_tokenizer_round_trips_text(kind, tmp_path):
    tok = ByteTokenizer() if kind == "byte" else \
        BPETokenizer.train(["def add(a, b):\n    return a + b\n" * 20, "héllo wörld " * 30], 300)
    tok.save(str(tmp_path))
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ids = auto(TEXT)["input_ids"]
    assert ids == tok.encode(TEXT) and auto.decode(ids) == TEXT
    assert auto.eos_token == "<|endoftext|>" and auto.eos_token_id == tok.eos_id
    assert auto.decode(ids + [tok.eos_id], skip_special_tokens=True) == TEXT
    assert type(tokenizer_from_dir(str(tmp_path))) is type(tok)
    auto.save_pretrained(tmp_path / "again")          # a transformers-written directory reads back too
    assert tokenizer_from_dir(str(tmp_path / "again")).encode(TEXT) == ids


def test_tokenizer_train_command_and_train_generate_accept_it(tmp_path):
    data = tmp_path / "t.txt"
    data.write_text("def add(a, b):\n    return a + b\n\n" * 100)
    assert cli(["tokenizer", "train", "--vocab-size", "300", "--data", str(data), "--out", str(tmp_path / "tok")]) == 0
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert auto.decode(auto("return a + b")["input_ids"]) == "return a + b"
    tiny = ["--preset", "transformer++", "--n-layers", "1", "--d-model", "32", "--set", "n_heads=2"]
    assert cli(["train", *tiny, "--data", str(data), "--tokenizer", str(tmp_path / "tok"), "--steps", "2",
                "--seq-len", "16", "--batch-size", "2", "--warmup", "1", "--eval-every", "2", "--eval-tokens", "200",
                "--out", str(tmp_path / "run"), "--no-progress"]) == 0
    assert tokenizer_from_dir(str(tmp_path / "run" / "step-000002")).vocab_size == auto.vocab_size
    assert cli(["generate", "--checkpoint", str(tmp_path / "run"), "--tokenizer", str(tmp_path / "tok"),
                "--prompt", "def", "--max-new-tokens", "3"]) == 0


# --- bad input: one clear error each ---------------------------------------------------------------------------
def one_line_error(capsys, *args):
    """The CLI's answer to bad input: exit status 2 and one line on stderr."""
    capsys.readouterr()
    code = cli([str(a) for a in args])
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip() and "Writing" not in ln]
    assert code == 2 and len(lines) == 1 and lines[0].startswith("hybridlm: error: "), lines
    return lines[0]


@pytest.fixture
def llama_dir(tmp_path):
    llama().save_pretrained(tmp_path / "hf")
    return tmp_path / "hf"


def test_unsupported_architecture_dir(tmp_path, capsys):
    transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50).save_pretrained(tmp_path)
    msg = one_line_error(capsys, "convert", "--from-hf", tmp_path, "--out", tmp_path / "run")
    assert "config.json" in msg and "'gpt2'" in msg and "llama" in msg


def _rewrite(path, edit):
    from safetensors.torch import load_file, save_file
    sd = load_file(path)
    edit(sd)
    save_file(sd, path, metadata={"format": "pt"})


def test_missing_tensor(llama_dir):
    _rewrite(llama_dir / "model.safetensors", lambda sd: sd.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="no tensor 'model.layers.1.mlp.up_proj.weight'"):
        convert_from_hf(str(llama_dir), str(llama_dir / "run"))


def test_mis_shaped_tensor(llama_dir, capsys):
    def shrink(sd):
        sd["model.layers.0.self_attn.k_proj.weight"] = sd["model.layers.0.self_attn.k_proj.weight"][:8]
    _rewrite(llama_dir / "model.safetensors", shrink)
    msg = one_line_error(capsys, "convert", "--from-hf", llama_dir, "--out", llama_dir / "run")
    assert "model.safetensors" in msg and "'model.layers.0.self_attn.k_proj.weight' has shape [8, 64]" in msg


def test_tokenizer_larger_than_the_vocabulary(llama_dir, tmp_path, capsys):
    big = BPETokenizer.train(["some text to learn from " * 50 + "".join(map(chr, range(300, 700)))], 400)
    big.save(str(llama_dir))                                    # 400+ ids for a model of 97
    with pytest.raises(InputError, match=r"tokenizer .*tokenizer.json has \d+ ids but the model's vocab_size is 97"):
        convert_from_hf(str(llama_dir), str(tmp_path / "run"))
    os.remove(llama_dir / "tokenizer.json")
    os.remove(llama_dir / "tokenizer_config.json")
    convert_from_hf(str(llama_dir), str(tmp_path / "run"))
    os.makedirs(tmp_path / "big")
    big.save(str(tmp_path / "big"))
    msg = one_line_error(capsys, "generate", "--checkpoint", tmp_path / "run", "--tokenizer", tmp_path / "big")
    assert "big" in msg and "vocab_size is 97" in msg
