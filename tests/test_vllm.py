"""vLLM serves hybridlm models (where `hybridlm[vllm]` is installed: `make vllm`; skipped elsewhere).

Greedy tokens of `vllm.LLM(..., dtype="float32", enforce_eager=True, skip_tokenizer_init=True)` equal `hybridlm
generate`'s (CausalLM.generate, temperature 0) for every prompt of one batch sent together, two of which share a long
prefix: on `convert --to-hf --as-native` exports (Llama, Mamba-2, Granite-4.0-H, Nemotron-H and DeepSeek-V3 shapes:
vLLM's own model classes) and through the plugin on run directories, for every letter it serves: the rodimus++ preset,
a layout mixing A, S, R and M, one with LFM2's gated short convolution C, one with CDMoE E, a Qwen3-Next-/Kimi-shaped
one with Gated DeltaNet G, KDA K and routed MoE O, MLA L on vLLM's MLA, MLA L (ours) with Mamba-1 B, inner-function
attention F with the dynamic mask; tensor parallel 2 gives the tokens of 1.
vLLM starts an engine process per model (about a minute each on two busy cores): each model runs in a subprocess.
"""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("vllm")

from hybridlm import CausalLM, ModelConfig, presets  # noqa: E402
from hybridlm.errors import ConfigError  # noqa: E402
from hybridlm.checkpoint.files import save_step_checkpoint  # noqa: E402
from hybridlm.train import save_checkpoint  # noqa: E402
from hybridlm.vllm.config import check_servable  # noqa: E402

V, NEW = 97, 8
# vLLM's CPU attention refused a head dim of 16: heads of 64 throughout
SIZES = dict(vocab_size=V, d_model=128, max_seq_len=256, n_heads=2, n_kv_heads=1, head_dim=64, ssd_headdim=32,
             ssd_d_state=16)

_SERVE = """
import json, sys
from vllm import LLM, SamplingParams
if __name__ == "__main__":
    model, prompts, new, rounds, extra = json.loads(sys.argv[1])
    kw = dict(skip_tokenizer_init=True, dtype="float32", enforce_eager=True, max_model_len=256,
              gpu_memory_utilization=0.1, seed=0)
    llm = LLM(model=model, **{**kw, **extra})
    for _ in range(rounds):
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(temperature=0, max_tokens=new))
        print("TOKENS " + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    prefix = torch.randint(0, V, (100,), generator=g).tolist()
    return [torch.randint(0, V, (9,), generator=g).tolist(),
            prefix + torch.randint(0, V, (7,), generator=g).tolist(),       # these two share a 100-token prefix
            prefix + torch.randint(0, V, (12,), generator=g).tolist(),
            torch.randint(0, V, (41,), generator=g).tolist()]


def ours(model: CausalLM, ps: list[list[int]]) -> list[list[int]]:
    """hybridlm generate's greedy continuation of each prompt alone."""
    return [model.generate(torch.tensor([p]), NEW, temperature=0)[0, len(p):].tolist() for p in ps]


def served(directory: str, ps: list[list[int]], rounds: int = 1, **extra) -> list[list[list[int]]]:
    """vLLM's greedy tokens for the batch `ps`, sent `rounds` times to one engine: a list per round. Tensor
    parallelism on vLLM's CPU build runs a process per rank, each bound to its own core (VLLM_CPU_OMP_THREADS_BIND:
    unbound, it refuses to start on a machine with fewer cores than it wants per rank)."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    tp = extra.get("tensor_parallel_size", 1)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    r = subprocess.run([sys.executable, "-c", _SERVE, json.dumps([directory, ps, NEW, rounds, extra])], env=env,
                       capture_output=True, text=True, timeout=900)
    lines = [x for x in r.stdout.splitlines() if x.startswith("TOKENS ")]
    causes = [x for x in r.stderr.splitlines() if "Error" in x or "error" in x][:12]    # the engine's root cause
    assert r.returncode == 0 and len(lines) == rounds, "\n".join(causes) + "\n" + r.stderr[-3000:]
    return [json.loads(x[len("TOKENS "):]) for x in lines]


def model(cfg: ModelConfig) -> CausalLM:
    """A random model whose every layer moves the logits: at hybridlm's init the small output projections leave
    the tied embedding echoing the last token, which a wrong mixer would echo too. Matrices are redrawn at
    1/sqrt(fan-in); vectors (norms, gates, decays, biases) keep their init."""
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and not name.startswith(("embed", "lm_head")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
    return m


# MLA at the one latent size vLLM's CPU MLA decode kernel computes (512 + a rope key of 64), small otherwise
MLA_CPU = dict(mla_kv_lora_rank=512, mla_rope_dim=64, mla_q_lora_rank=64, mla_qk_nope_dim=32)
# and a latent it does not compute: L stays on our attention (expanded keys: qk 48 + 16 = 64, v 64)
MLA_64 = dict(mla_kv_lora_rank=64, mla_q_lora_rank=48, mla_qk_nope_dim=48, mla_rope_dim=16, mla_v_dim=64)

NATIVE = {   # case -> (preset, sizes)
    "llama": ("llama", dict(n_layers=2)),
    "mamba2": ("mamba2", dict(n_layers=2, ssd_ngroups=2)),
    "granite-4.0-h": ("granite-hybrid", dict(n_layers=3)),
    "nemotron-h": ("nemotron-h", dict(n_layers=4)),
    "deepseek-v3": ("deepseek-mla", dict(n_layers=2, **MLA_CPU)),
}
# case -> vLLM's arguments it needs here. DeepseekV3: vLLM's CPU rotary kernel (RotaryEmbedding.forward_cpu) rotates
# a [tokens, heads, dim] query of more than one head wrongly, which vLLM's MLA wrapper hands it: vLLM's rope in
# PyTorch instead
NATIVE_ARGS = {"deepseek-v3": dict(compilation_config={"custom_ops": ["-rotary_embedding"]})}


@pytest.mark.slow
@pytest.mark.parametrize("case", NATIVE)
def test_native_export_served_by_vllm(case, tmp_path):
    name, kw = NATIVE[case]
    m = model(presets.get(name, **{**SIZES, **kw}))
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    save_checkpoint(run, m)
    subprocess.run([sys.executable, "-m", "hybridlm", "convert", "--to-hf", run, "--as-native", "--out", out],
                   check=True, capture_output=True)
    ps = prompts()
    assert served(out, ps, **NATIVE_ARGS.get(case, {})) == [ours(m, ps)]


@pytest.mark.slow
def test_native_qwen3_next_served_in_bf16(tmp_path):
    """vLLM's CPU Gated DeltaNet runs in bf16 only (head dims 64 / 128), so a Qwen3Next export serves in bf16 there,
    and its greedy tokens drift from float32 ones on near-ties. The rule: every token vLLM picks is, under our float32
    model fed vLLM's own sequence, within a quarter of the spread between the best and the median logit of the best
    (a token picked at random sits near the median, a spread away; bf16 rounding measured up to 0.11 here)."""
    m = model(presets.get("qwen3-next", n_layers=4, **SIZES))
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    save_checkpoint(run, m)
    subprocess.run([sys.executable, "-m", "hybridlm", "convert", "--to-hf", run, "--as-native", "--out", out],
                   check=True, capture_output=True)
    ps = prompts()
    (got,) = served(out, ps, dtype="bfloat16")
    for p, toks in zip(ps, got):
        assert len(toks) == NEW
        with torch.no_grad():
            logits = m(torch.tensor([p + toks])).logits[0, len(p) - 1: -1].float()   # [NEW, V]
        best = logits.max(-1).values
        picked = logits.gather(-1, torch.tensor(toks)[:, None])[:, 0]
        spread = best - logits.median(-1).values
        assert ((best - picked) <= 0.25 * spread).all(), (toks, (best - picked) / spread)


PLUGIN = {   # case -> config: served through hybridlm.vllm from the run directory itself
    "rodimus++": presets.get("rodimus++", n_layers=2, **{**SIZES, "n_kv_heads": None, "head_dim": None},
                             swa_window=24),
    "mixed": ModelConfig(layout="A M S M R M [RWM] S M", attn_shared_key=False, swa_window=24, rodimus_d_state=16,
                         **SIZES),
    "short-conv": ModelConfig(layout="C M A M C M", conv_bias=True, **SIZES),
    "cdmoe": ModelConfig(layout="S E A E", wm_cdmoe_experts=16, wm_cdmoe_topk=4, **SIZES),
    # Qwen3-Next's and Kimi-Linear's mixers in a layout of one's own: ours with vLLM's cache in float32 (vLLM's CPU
    # Gated DeltaNet is bf16-only, its KDA Triton-only); O (sigmoid router with a bias, shared expert) ours
    "delta-moe": ModelConfig(layout="G O A O K O", gdn_k_heads=1, gdn_v_heads=2, gdn_k_dim=32, gdn_v_dim=32,
                             kda_heads=2, kda_head_dim=32, moe_experts=4, moe_topk=2, moe_shared=True,
                             moe_router="sigmoid", moe_router_bias=True, moe_hidden=64, **SIZES),
    # the Qwen3-Next preset as a run (gated attention with a quarter of each head rotated, q/k norm; G; O with a
    # gated shared expert), as the plugin serves it for the serve benchmark
    "qwen3-next": presets.get("qwen3-next", n_layers=4, **SIZES),
    # heads of 184 channels (the 125M preset's), which vLLM's CPU attention lacks: computed at 192, zero-padded
    "head-dim-184": ModelConfig(layout="A M S M", **{**SIZES, "head_dim": 184}),
    # MLA on vLLM's own (its latent cache: 512 + 64, the one size vLLM's CPU MLA decode kernel computes)
    "mla-vllm": ModelConfig(layout="L M L M", **MLA_CPU, **SIZES),
    # MLA at a latent vLLM's CPU MLA does not compute, so ours (expanded keys in vLLM's attention) and Mamba-1
    "mla-mamba1": ModelConfig(layout="L M B M", **MLA_64, **SIZES),
    # inner-function attention and the "dt" dynamic mask on F and A (its bias as one more key channel: heads of 65
    # channels, computed at 80)
    "inner-function": ModelConfig(layout="F M S M A M", wm_dyn_mask="dt", wm_inner_values=8, wm_inner_topk=2,
                                  wm_inner_dret=16, **{**SIZES, "n_kv_heads": 2}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", PLUGIN)
def test_plugin_serves_run(case, tmp_path):
    m = model(PLUGIN[case])
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)         # a run directory as training leaves it: weights in step-000001/
    ps = prompts()
    assert served(run, ps) == [ours(m, ps)]


@pytest.mark.slow
def test_plugin_prefix_caching(tmp_path):
    """vLLM's prefix caching (mamba "align" mode: block-boundary states of A, S and R layers kept and copied) on the
    mixed layout: the batch twice, the second time from the states the first left in the cache."""
    m = model(PLUGIN["mixed"])
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)
    ps = prompts()
    assert served(run, ps, rounds=2, enable_prefix_caching=True) == [ours(m, ps)] * 2


TP = {   # case -> config: tensor_parallel_size 2 gives the tokens of 1 (and of generate)
    "mixed": ModelConfig(layout="A M S O R M G O", attn_shared_key=False, rodimus_d_state=16, gdn_k_heads=1,
                         gdn_v_heads=2, gdn_k_dim=32, gdn_v_dim=32, moe_experts=4, moe_topk=2, moe_hidden=64, **SIZES),
    "rodimus++": PLUGIN["rodimus++"],
    "mla": PLUGIN["mla-vllm"],          # vLLM's MLA: a head per rank
}


@pytest.mark.slow
@pytest.mark.parametrize("case", TP)
def test_tensor_parallel(case, tmp_path):
    m = model(TP[case])
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)
    ps = prompts()
    want = ours(m, ps)
    assert served(run, ps, tensor_parallel_size=2, distributed_executor_backend="mp") == [want]
    assert served(run, ps) == [want]


@pytest.mark.parametrize("layout, letter, extra", [
    ("I M", "letter I", {}), ("Z S M", "letter Z", {}), ("{AS} M", "parallel blocks", {}),
    ("A M", "letter A .*heads of 600 channels", dict(head_dim=600)),
    ("F M", "letter F .*wm_keep_window", dict(wm_dyn_mask="dt", wm_keep_window=4, n_kv_heads=1, head_dim=64)),
    ("S M", "letter S .*wm_ssd_rope", dict(wm_ssd_rope=True))])
def test_refused_at_load_with_the_letter_named(layout, letter, extra):
    with pytest.raises(ConfigError, match=f"cannot serve {letter}"):
        check_servable(ModelConfig(**{**dict(layout=layout, vocab_size=V, d_model=64, n_heads=1), **extra}))


@pytest.mark.parametrize("layout, sizes, why", [
    ("L M L M", MLA_CPU, None), ("L M O M", {**MLA_CPU, "moe_experts": 4, "moe_topk": 2}, None),
    ("L M L M", MLA_64, r"only a latent of 512 \+ a rope key of 64 \(this L: 64 \+ 16\)"),
    ("L M A M", MLA_CPU, "has A beside L"), ("[RWM] L M", MLA_CPU, "has W beside L"),
    ("L M S M", MLA_CPU, r"beside recurrent state \(S\)"), ("L M B M", MLA_CPU, r"recurrent state \(B\)")])
def test_mla_on_vllms_own_or_ours(layout, sizes, why):
    """kind("L") takes vLLM's MLA where its CPU backend runs the layout (and the config turns vLLM's use_mla on:
    a latent of 576 per token), ours otherwise, with the reason."""
    import re

    from hybridlm.vllm.config import ArchConvertor, HybridLMVLLMConfig
    from hybridlm.vllm.layers import MLALayer, OwnAttentionLayer, kind
    cfg = ModelConfig(layout=layout, rodimus_d_state=16, **{**SIZES, **sizes})
    refusal = MLALayer.refuse(cfg, "L")
    assert kind("L", cfg) is (MLALayer if why is None else OwnAttentionLayer)
    assert refusal is None if why is None else re.search(why, refusal), refusal
    hf = HybridLMVLLMConfig(hybridlm=cfg.to_dict())
    arch = ArchConvertor(hf, hf)
    assert arch.is_deepseek_mla() == (why is None)
    if why is None:
        assert arch.get_head_size() == 512 + 64


@pytest.mark.slow
def test_readme_command_serves_one_request(tmp_path):
    """README's `vllm serve RUN`, as typed (with a port of its own), after `make vllm` on a machine without a GPU:
    vllm-cpu's command finds the `vllm` version it looks up (scripts/setup-vllm.sh's alias), opens the run through
    the plugin, and answers one /v1/completions request with generate's greedy tokens."""
    import socket
    import time
    import urllib.request

    from hybridlm.data.tokenizer import ByteTokenizer
    m = model(ModelConfig(layout="A M S M", **{**SIZES, "vocab_size": 257}))
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m, tokenizer=ByteTokenizer())
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    vllm = os.path.join(os.path.dirname(sys.executable), "vllm")
    log = open(tmp_path / "serve.log", "w")
    proc = subprocess.Popen([vllm, "serve", run, "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 900
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-4000:]
            assert time.time() < deadline, "vllm serve did not come up in 15 minutes"
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=5)
                break
            except OSError:
                time.sleep(3)
        prompt = prompts()[3]
        body = dict(model=run, prompt=prompt, max_tokens=NEW, temperature=0, logprobs=0,
                    return_tokens_as_token_ids=True)
        req = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            out = json.load(r)
        tokens = [int(t.split(":")[1]) for t in out["choices"][0]["logprobs"]["tokens"]]
        assert tokens == ours(m, [prompt])[0]
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
