"""vLLM serves hybridlm models (where `hybridlm[vllm]` is installed: `make vllm`; skipped elsewhere).

Greedy tokens of `vllm.LLM(..., dtype="float32", enforce_eager=True, skip_tokenizer_init=True)` equal `hybridlm
generate`'s (CausalLM.generate, temperature 0) for every prompt of one batch sent together, two of which share a long
prefix: on `convert --to-hf --as-native` exports (Llama, Mamba-2, Granite-4.0-H, Nemotron-H and DeepSeek-V3 shapes:
vLLM's own model classes) and through the plugin on run directories, for every letter it serves: the rodimus++ preset,
a layout mixing A, S, R and M, one with LFM2's gated short convolution C, one with CDMoE E, a Qwen3-Next-/Kimi-shaped
one with Gated DeltaNet G, KDA K and routed MoE O, a DeepSeek-V3-routed O, MLA L on vLLM's MLA, MLA L (ours) with
Mamba-1 B, inner-function attention F with the dynamic mask; tensor parallel 2 gives the tokens of 1 (O sharded by
vLLM's FusedMoE, L on vLLM's MLA among them). Where vLLM's kernel demands bf16 (its CPU Gated DeltaNet: the
Qwen3Next export, G on vLLM's layer through the plugin, also under tensor parallelism) the tokens meet a stated bf16
rule.
O is served by layers.MoELayer (vLLM's FusedMoE, its CPU experts) in every case here; ChannelLayer (ours) takes the
options FusedMoE cannot do (test_routed_moe_falls_back_to_ours); the routing options no served case has are checked
layer against layer, without an engine (test_moe_layer_equals_ours).
K and B also on vLLM's own layers (KimiGatedDeltaNetAttention, MambaMixer), and a KimiLinear export on vLLM's
kimi_linear, with torch kernels standing in for the GPU ones vLLM's CPU build lacks (vllm_kernels.py).
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
from hybridlm.vllm.layers import ChannelLayer, MoELayer, kind  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

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


# the engine in the script's own process (VLLM_ENABLE_V1_MULTIPROCESSING=0), vLLM's GPU kernels swapped for torch
# references first (vllm_kernels.py), each kernel's call count printed after the run
_PATCHED = "import vllm_kernels\nvllm_kernels.patch()\n" + _SERVE + """
    print("CALLS " + json.dumps(vllm_kernels.CALLS))
"""


def served(directory: str, ps: list[list[int]], rounds: int = 1, kernels: tuple[str, ...] = (),
           **extra) -> list[list[list[int]]]:
    """vLLM's greedy tokens for the batch `ps`, sent `rounds` times to one engine: a list per round. Tensor
    parallelism on vLLM's CPU build runs a process per rank, each bound to its own core (VLLM_CPU_OMP_THREADS_BIND:
    unbound, it refuses to start on a machine with fewer cores than it wants per rank). `kernels`: run with
    vllm_kernels.py's reference kernels patched in, each of these called at least once."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", TOKENIZERS_PARALLELISM="false")
    if kernels:
        env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0",
                   PYTHONPATH=os.pathsep.join((os.path.dirname(__file__), env.get("PYTHONPATH", ""))))
    tp = extra.get("tensor_parallel_size", 1)
    if tp > 1:
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
    r = subprocess.run([sys.executable, "-c", _PATCHED if kernels else _SERVE,
                        json.dumps([directory, ps, NEW, rounds, extra])], env=env,
                       capture_output=True, text=True, timeout=900)
    lines = [x for x in r.stdout.splitlines() if x.startswith("TOKENS ")]
    causes = [x for x in r.stderr.splitlines() if "Error" in x or "error" in x][:12]    # the engine's root cause
    assert r.returncode == 0 and len(lines) == rounds, "\n".join(causes) + "\n" + r.stderr[-3000:]
    if kernels:     # vLLM's layers ran: their kernels were called
        calls = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("CALLS "))[len("CALLS "):])
        assert all(calls.get(k) for k in kernels), calls
    return [json.loads(x[len("TOKENS "):]) for x in lines]


def model(cfg: ModelConfig) -> CausalLM:
    """A random model whose every layer moves the logits: at hybridlm's init the small output projections leave
    the tied embedding echoing the last token, which a wrong mixer would echo too. Matrices are redrawn at
    1/sqrt(fan-in); vectors (norms, gates, decays, biases) keep their init, but for O's correction bias (a zero
    buffer at init), drawn so that it steers the choice of experts."""
    torch.manual_seed(0)
    m = CausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if p.dim() >= 2 and not name.startswith(("embed", "lm_head")):
                p.normal_(0.0, p.shape[-1] ** -0.5)
        for name, b in m.named_buffers():
            if name.endswith("router_bias"):
                b.normal_(0.0, 0.2)
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
    assert_bf16_agrees(m, ps, got)


def assert_bf16_agrees(m: CausalLM, ps: list[list[int]], got: list[list[int]]):
    """The bf16 rule: every token vLLM picked is, under our float32 model `m` fed vLLM's own sequence, within a
    quarter of the spread between the best and the median logit of the best."""
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
    # Gated DeltaNet is bf16-only with heads of 64 or 128, its KDA Triton-only); O (sigmoid router with a bias, shared
    # expert) on FusedMoE
    "delta-moe": ModelConfig(layout="G O A O K O", gdn_k_heads=1, gdn_v_heads=2, gdn_k_dim=32, gdn_v_dim=32,
                             kda_heads=2, kda_head_dim=32, moe_experts=4, moe_topk=2, moe_shared=True,
                             moe_router="sigmoid", moe_router_bias=True, moe_hidden=64, **SIZES),
    # the Qwen3-Next preset as a run (gated attention with a quarter of each head rotated, q/k norm; G; O on vLLM's
    # FusedMoE with a sigmoid-gated shared expert), as the plugin serves it for the serve benchmark (in float32: G
    # ours; bf16: vLLM's, below)
    "qwen3-next": presets.get("qwen3-next", n_layers=4, **SIZES),
    # DeepSeek-V3's routing on vLLM's FusedMoE: sigmoid scores, correction bias, 4 groups of 4 experts of which the
    # 2 best, routed scaling, renormalised top 3, a shared expert without gate
    "deepseek-moe": ModelConfig(layout="A O S O", moe_experts=16, moe_topk=3, moe_router="sigmoid",
                                moe_router_bias=True, moe_n_group=4, moe_topk_group=2, moe_scale=2.5, moe_shared=True,
                                moe_hidden=32, moe_shared_hidden=96, **SIZES),
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


BF16 = {   # case -> (config, engine options): served in bf16 through the plugin, G on vLLM's own Gated DeltaNet (its
    # CPU kernels: heads of 64 x 64, 4 conv taps)
    "qwen3-next": (PLUGIN["qwen3-next"], {}),     # beside vLLM's attention and our MoE
    # three kinds of recurrent state in one cache: vLLM's GDN, MambaMixer2's and ours (R), pages sized by the largest
    "gdn-ssd-rodimus": (ModelConfig(layout="G M S M R M A M", attn_shared_key=False, rodimus_d_state=16, **SIZES), {}),
    # vLLM's GDN sharded over 2 ranks, a key-head group (its value heads) each
    "tp2": (ModelConfig(layout="G M A M G M", attn_shared_key=False, gdn_k_heads=2, gdn_v_heads=4, **SIZES),
            dict(tensor_parallel_size=2, distributed_executor_backend="mp")),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", BF16)
def test_plugin_gdn_on_vllms_layer_in_bf16(case, tmp_path):
    """Checked by the bf16 rule of the native Qwen3-Next export."""
    cfg, extra = BF16[case]
    m = model(cfg)
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)
    ps = prompts()
    (got,) = served(run, ps, dtype="bfloat16", **extra)
    assert_bf16_agrees(m, ps, got)


def test_gdn_served_by_vllms_layer_where_its_kernel_runs(monkeypatch):
    """G is vLLM's Gated DeltaNet in bf16 at the head dims its CPU kernel has, ours (state in vLLM's cache) in float32
    or at other head dims / conv widths, or with fewer key heads than tensor-parallel ranks."""
    from vllm.model_executor.layers.mamba.ops.cpu.gdn_attention import is_arm_bf16
    from vllm.platforms import current_platform

    from hybridlm.vllm import layers
    from hybridlm.vllm.layers import GatedDeltaNetLayer, RecurrentLayer, kind
    if not current_platform.is_cpu():
        pytest.skip("the CPU kernel's limits")
    q3n = PLUGIN["qwen3-next"]          # heads of 64 x 64
    assert kind("G", q3n, torch.bfloat16) is GatedDeltaNetLayer
    assert kind("G", q3n, None) is GatedDeltaNetLayer           # config.json's check, before the dtype is known
    assert kind("G", ModelConfig(**{**SIZES, "gdn_k_dim": 128}), torch.bfloat16) is GatedDeltaNetLayer
    assert kind("G", q3n, torch.float32) is RecurrentLayer
    assert kind("G", q3n, torch.float16) is RecurrentLayer
    assert kind("G", PLUGIN["delta-moe"], torch.bfloat16) is RecurrentLayer                # 32 x 32
    assert kind("G", ModelConfig(**{**SIZES, "gdn_v_dim": 128}), torch.bfloat16) is RecurrentLayer   # 64 x 128
    assert kind("G", ModelConfig(**{**SIZES, "head_dim": 96}), torch.bfloat16) is RecurrentLayer
    packed = torch.cpu._is_avx512_bf16_supported() or is_arm_bf16()
    assert kind("G", ModelConfig(**{**SIZES, "d_conv": 3}), torch.bfloat16) is (
        RecurrentLayer if packed else GatedDeltaNetLayer)
    monkeypatch.setattr(layers, "_tp_size", lambda: 2)          # vLLM's shards whole key heads
    assert kind("G", q3n, torch.bfloat16) is RecurrentLayer    # 1 key head
    assert kind("G", ModelConfig(**{**SIZES, "gdn_v_heads": 4}), torch.bfloat16) is GatedDeltaNetLayer


@pytest.mark.slow
def test_plugin_prefix_caching(tmp_path):
    """vLLM's prefix caching (mamba "align" mode: block-boundary states of A, S and R layers kept and copied) on the
    mixed layout: the batch twice, the second time from the states the first left in the cache."""
    m = model(PLUGIN["mixed"])
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)
    ps = prompts()
    assert served(run, ps, rounds=2, enable_prefix_caching=True) == [ours(m, ps)] * 2


VLLM_LAYERS = {   # letter -> (plugin case, the kernels vLLM's layer for it calls)
    "K": ("delta-moe", ("chunk_kda_with_fused_gate", "fused_recurrent_kda_packed_decode", "gather_initial_states")),
    "B": ("mla-mamba1", ("selective_scan_fn", "selective_state_update")),
}


@pytest.mark.slow
@pytest.mark.parametrize("letter", VLLM_LAYERS)
def test_vllm_layer_with_reference_kernels(letter, tmp_path):
    """K on vLLM's KimiGatedDeltaNetAttention, B on vLLM's MambaMixer (the layers a GPU gets): on this CPU their GPU
    kernels are swapped for torch references and the class choice is let past the platform (vllm_kernels.py), so
    vLLM's layer code runs as on a GPU: our weights cut into its parameters, its convolutions (vLLM's CPU ones), norms,
    state shapes, slots and metadata. Greedy tokens equal generate's. vLLM's GPU kernels themselves stay untested."""
    case, kernels = VLLM_LAYERS[letter]
    m = model(PLUGIN[case])
    run = str(tmp_path / "run")
    save_step_checkpoint(run, 1, m)
    ps = prompts()
    assert served(run, ps, kernels=kernels) == [ours(m, ps)]


@pytest.mark.slow
def test_native_kimi_linear_with_reference_kernels(tmp_path, monkeypatch):
    """A KimiLinear export served by vLLM's own kimi_linear model (its KDA layers, FusedMoE, its weight loader reading
    the released names, the released config fields our export writes beside transformers'), the KDA kernels swapped as
    above. Not served by the CPU build as it is: see docs/serving.md. No MLA layer here: vLLM's Kimi MLA fails on this
    CPU in process_weights_after_loading ("kv_b_proj weight (0,)"), and a dense first MLP is saved by transformers
    under block_sparse_moe.*, which vLLM's loader does not read (KeyError): docs/serving.md's table."""
    monkeypatch.setenv("VLLM_KIMI_K3_GEMM_AR", "0")        # on by default: a CUDA GEMM + all-reduce (cutlass)
    m = model(presets.get("kimi-linear", n_layers=3, layout="KO KO KO", vocab_size=V, d_model=128, max_seq_len=256))
    run, out = str(tmp_path / "run"), str(tmp_path / "hf")
    save_checkpoint(run, m)
    subprocess.run([sys.executable, "-m", "hybridlm", "convert", "--to-hf", run, "--as-native", "--out", out],
                   check=True, capture_output=True)
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["linear_attn_config"]["kda_layers"] == [1, 2, 3]
    ps = prompts()
    # prefix caching off: vLLM's CPU build turns it off for any MLA-configured model after KimiLinear's mamba block
    # size was set for it, and then refuses its own config
    assert served(out, ps, kernels=VLLM_LAYERS["K"][1], enable_prefix_caching=False) == [ours(m, ps)]


@pytest.mark.parametrize("letter, vllms", [("K", "KimiDeltaLayer"), ("B", "Mamba1Layer")])
def test_kind_of_k_and_b(letter, vllms, monkeypatch):
    """Ours with vLLM's cache on vLLM's CPU build (its kernels are not there), vLLM's layer elsewhere unless an option
    of ours has no equivalent in it."""
    from types import SimpleNamespace

    from hybridlm.vllm import layers
    cfg = PLUGIN["delta-moe" if letter == "K" else "mla-mamba1"]
    vllm_layer = getattr(layers, vllms)
    assert layers.kind(letter, cfg, torch.float32) is layers.RecurrentLayer
    assert "CPU build" in vllm_layer.refuse(cfg, letter, torch.float32)
    monkeypatch.setattr(layers, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    assert layers.kind(letter, cfg, torch.float32) is vllm_layer
    if letter == "K":
        for extra, why in ((dict(kda_rank=16), "kda_rank=16"), (dict(kda_head_dim=512), "kda_head_dim=512")):
            c = ModelConfig(**{**cfg.to_dict(), **extra})
            assert layers.kind(letter, c, torch.float32) is layers.RecurrentLayer
            assert why in vllm_layer.refuse(c, letter)


TP = {   # case -> config: tensor_parallel_size 2 gives the tokens of 1 (and of generate); O on vLLM's FusedMoE, each
    # expert's hidden dim sharded over the ranks (MoELayer), one all-reduce
    "mixed": ModelConfig(layout="A M S O R M G O", attn_shared_key=False, rodimus_d_state=16, gdn_k_heads=1,
                         gdn_v_heads=2, gdn_k_dim=32, gdn_v_dim=32, moe_experts=4, moe_topk=2, moe_hidden=64, **SIZES),
    "rodimus++": PLUGIN["rodimus++"],
    # every routing option of O at once, the shared expert with its sigmoid gate: its partial sums join the routed
    # experts' in FusedMoE's one all-reduce
    "moe": ModelConfig(layout="A O S O", moe_experts=16, moe_topk=3, moe_router="sigmoid", moe_router_bias=True,
                       moe_n_group=4, moe_topk_group=2, moe_scale=2.5, moe_shared=True, moe_shared_gate=True,
                       moe_hidden=32, moe_shared_hidden=96, **SIZES),
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


_LAYER = """
import sys, torch
from vllm.config import set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from hybridlm.vllm.model import HybridLMForCausalLM
if __name__ == "__main__":
    port, *runs = sys.argv[1:]
    for i, run in enumerate(runs):
        vc = EngineArgs(model=run, dtype="float32", skip_tokenizer_init=True, enforce_eager=True,
                        max_model_len=256).create_engine_config()
        with set_current_vllm_config(vc):
            if i == 0:
                init_distributed_environment(1, 0, f"tcp://127.0.0.1:{port}", 0, backend="gloo")
                ensure_model_parallel_initialized(1, 1)
            m = HybridLMForCausalLM(vllm_config=vc)
            saved = torch.load(run + "/moe.pt")
            m.load_weights(saved["weights"].items())
            for mod in m.modules():         # as vLLM's loader does: the CPU experts prepack their weights
                if hasattr(getattr(mod, "quant_method", None), "process_weights_after_loading"):
                    mod.quant_method.process_weights_after_loading(mod)
            x = saved["x"]
            with torch.no_grad(), set_forward_context(None, vc):
                for j, want in saved["want"].items():
                    mixer = m.blocks[j].mixer
                    err = (mixer(x, torch.arange(len(x))) - want).abs().max().item()
                    print("ERR", type(mixer).__name__, err / want.abs().max().item(), flush=True)
"""

MOE = {   # O's options FusedMoE maps beyond the served cases: softmax with groups (a zero correction bias), groups
    # of one expert, top-k weights not renormalised, gelu / gelu_tanh experts, a gated shared expert of its own width
    "softmax-groups": dict(moe_n_group=4, moe_topk_group=2, moe_topk=3, moe_shared=True, moe_shared_gate=True,
                           moe_shared_hidden=96, mlp_act="gelu"),
    "groups-of-one": dict(moe_router="sigmoid", moe_router_bias=True, moe_n_group=16, moe_topk_group=5, moe_topk=4,
                          moe_norm_topk=False, moe_scale=1.5, mlp_act="gelu_tanh"),
}


@pytest.mark.slow
def test_moe_layer_equals_ours(tmp_path):
    """MoELayer (vLLM's FusedMoE) gives our RoutedMoE's output on one batch of tokens, option by option (no engine:
    the layers built under each run's vLLM config, in one process)."""
    import socket
    runs = []
    for name, opts in MOE.items():
        m = model(ModelConfig(layout="O M O", moe_experts=16, moe_hidden=48, **{**SIZES, **opts}))
        run = str(tmp_path / name)
        save_step_checkpoint(run, 1, m)
        x = torch.randn(37, SIZES["d_model"], generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = {j: m.blocks[j].mixer(x[None])[0] for j in (0, 2)}
        torch.save(dict(weights=m.state_dict(), x=x, want=want), run + "/moe.pt")
        runs.append(run)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    r = subprocess.run([sys.executable, "-c", _LAYER, str(port), *runs], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"))
    errs = [x.split()[1:] for x in r.stdout.splitlines() if x.startswith("ERR ")]
    assert r.returncode == 0 and len(errs) == 2 * len(MOE), r.stderr[-3000:]
    assert all(k == "MoELayer" and float(e) < 1e-5 for k, e in errs), errs


@pytest.mark.parametrize("extra, why", [
    (dict(mlp_gated=False, mlp_act="relu2"), "plain relu2 experts"),       # Nemotron-H's experts
    (dict(mlp_act="relu"), "gated relu experts"),
    pytest.param(dict(d_model=80), "d_model=80", marks=pytest.mark.skipif(not current_platform.is_cpu(),
                                                                           reason="a rule of vLLM's CPU experts"))])
def test_routed_moe_falls_back_to_ours(extra, why):
    """O is vLLM's FusedMoE (MoELayer) where its experts compute the run's, else ours (ChannelLayer), at load."""
    cfg = ModelConfig(**{**dict(layout="A O", vocab_size=V, d_model=128, n_heads=2, moe_experts=4), **extra})
    assert kind("O", ModelConfig(layout="A O", vocab_size=V, d_model=128, n_heads=2, moe_experts=4)) is MoELayer
    assert why in MoELayer.refuse(cfg, "O", torch.float32)
    assert kind("O", cfg, torch.float32) is ChannelLayer
    check_servable(cfg, dtype=torch.float32)        # served all the same


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
