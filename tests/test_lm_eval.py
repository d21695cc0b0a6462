"""The lm-evaluation-harness adapter (eval/harness.py) and `hybridlm eval --tasks` on the shipped local tasks."""
import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lm_eval")
from lm_eval.api.instance import Instance  # noqa: E402

from hybridlm import CausalLM, InputError, presets  # noqa: E402
from hybridlm.data.tokenizer import BPETokenizer, ByteTokenizer  # noqa: E402
from hybridlm.eval.harness import HybridLMEval  # noqa: E402
from hybridlm.eval.harness_tasks import TASKS_DIR, local_task_names, run_tasks  # noqa: E402
from hybridlm.checkpoint import save_checkpoint  # noqa: E402

from conftest import assert_close  # noqa: E402

TINY = dict(n_layers=1, d_model=32, ssd_headdim=16, ssd_d_state=16, n_heads=2, max_seq_len=64)


def tiny_model(preset="mamba2-attention", vocab_size=257, **over):
    torch.manual_seed(0)
    return CausalLM(presets.get(preset, vocab_size=vocab_size, **{**TINY, **over})).eval()


@pytest.fixture(scope="module", autouse=True)
def _one_thread():
    """Every tensor here is tiny: a second intra-op thread only adds barriers (35x slower on a busy machine)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def byte_lm():
    return HybridLMEval(model=tiny_model(), tokenizer=ByteTokenizer(), batch_size=4)


def ll(lm, pairs):
    return lm.loglikelihood([Instance("loglikelihood", {}, p, i) for i, p in enumerate(pairs)], disable_tqdm=True)


def direct_logprob(model, ids: list[int], n_cont: int) -> float:
    """log p of the last `n_cont` of `ids` given the rest, from one plain forward of ids[:-1]."""
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids[:-1]])).logits[0].float(), -1)
    return sum(lp[t - 1, ids[t]].item() for t in range(len(ids) - n_cont, len(ids)))


PAIRS = [("The box holds kqzv.\nQ: What does the box hold?\nA:", " kqzv"), ("def add(a, b):", "\n    return a + b"),
         ("x", " y"), ("", "hello world"), ("trailing space ", "moves"), ("a" * 90, " long context, cut on the left")]


def test_loglikelihood_equals_direct_logits(byte_lm):
    m, tok = byte_lm.model, byte_lm.tok
    for (ctx, cont), (got, greedy) in zip(PAIRS, ll(byte_lm, PAIRS)):
        n_space = len(ctx) - len(ctx.rstrip())  # trailing spaces of the context are scored with the continuation
        ctx, cont = ctx[:len(ctx) - n_space], ctx[len(ctx) - n_space:] + cont
        ids = (tok.encode(ctx) or [tok.eos_id]) + tok.encode(cont)  # an empty context conditions on eos
        expect = direct_logprob(m, ids[-(m.config.max_seq_len + 1):], len(tok.encode(cont)))  # oldest tokens cut
        assert got == pytest.approx(expect, rel=1e-5, abs=1e-4)
        assert isinstance(greedy, bool)
    # the model's own greedy continuation is greedy, and scores higher than any other
    prompt = tok.encode("def f(x):")
    ids = m.generate(torch.tensor([prompt]), 5, temperature=0)[0].tolist()
    cont = tok.decode(ids[len(prompt):])
    (lp, greedy), (lp2, greedy2) = ll(byte_lm, [("def f(x):", cont), ("def f(x):", cont[:-1] + "#")])
    assert greedy and not greedy2 and lp > lp2


def test_bpe_boundary_splits_like_hflm():
    """Context and continuation are encoded together and split; the trailing space moves to the continuation."""
    tok = BPETokenizer.train(["the cat sat on the mat. " * 50, "def add(a, b): return a + b\n" * 50], 300)
    lm = HybridLMEval(model=tiny_model(vocab_size=tok.vocab_size), tokenizer=tok, batch_size=3)
    for ctx, cont in [("the cat sat on the", " mat"), ("the cat sat on the ", "mat"), ("def add(a, b):", " return")]:
        c, k = lm._encode_pair(ctx, cont)
        assert c + k == tok.encode(ctx + cont) and tok.decode(k) == " " + cont.strip()
    pairs = [("the cat sat on the", " mat"), ("def add(a,", " b): return a + b")]
    for (ctx, cont), (got, _) in zip(pairs, ll(lm, pairs)):
        c, k = lm._encode_pair(ctx, cont)
        assert got == pytest.approx(direct_logprob(lm.model, c + k, len(k)), rel=1e-5)


@pytest.mark.parametrize("preset", ["mamba2-attention", "rodimus++", "doge", "deepseek-sparse"])
def test_batching_does_not_change_results(preset):
    """Right-padded batches score like single requests; left-padded batched generation decodes like single prompts."""
    m, tok = tiny_model(preset), ByteTokenizer()
    one, many = (HybridLMEval(model=m, tokenizer=tok, batch_size=b) for b in (1, 4))
    a, b = ll(one, PAIRS), ll(many, PAIRS)
    assert_close(torch.tensor([x for x, _ in a]), torch.tensor([x for x, _ in b]), rtol=1e-5, atol=1e-4)
    assert [g for _, g in a] == [g for _, g in b]
    texts = ["def add(a, b):\n    return a + b\n" * 4, "short", "x = 1\n" * 30]
    reqs = [Instance("loglikelihood_rolling", {}, (t,), i) for i, t in enumerate(texts)]
    assert_close(torch.tensor(one.loglikelihood_rolling(reqs, True)),
                 torch.tensor(many.loglikelihood_rolling(reqs, True)), rtol=1e-5, atol=1e-4)
    gen = [Instance("generate_until", {}, (p, {"until": ["\n"], "max_gen_toks": 6}), i)
           for i, p in enumerate(["def ", "import os", "The box holds", ""])]
    assert one.generate_until(gen, True) == many.generate_until(gen, True)


def test_rolling_windows_predict_each_token_once(byte_lm):
    m, tok = byte_lm.model, byte_lm.tok
    short = "def add(a, b):\n    return a + b\n"
    ids = [tok.eos_id] + tok.encode(short)
    (got,) = byte_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (short,), 0)], True)
    assert got == pytest.approx(direct_logprob(m, ids, len(ids) - 1), rel=1e-5)
    long = short * 7  # 217 bytes: four windows of max_seq_len 64
    seen = []
    score = byte_lm.score_tokens
    byte_lm.score_tokens = lambda pairs, progress=False: seen.extend(pairs) or score(pairs)
    try:
        byte_lm.loglikelihood_rolling([Instance("loglikelihood_rolling", {}, (long,), 0)], True)
    finally:
        del byte_lm.score_tokens
    assert len(seen) == 4 and sum(len(c) for _, c in seen) == len(tok.encode(long))
    assert [t for _, c in seen for t in c] == tok.encode(long)


def test_generate_until_stops(byte_lm):
    m, tok = byte_lm.model, byte_lm.tok
    prompt = "def add(a, b):"
    full = tok.decode(m.generate(torch.tensor([tok.encode(prompt)]), 12, temperature=0)[0, len(prompt):].tolist())
    stop = full[3]  # a character the greedy continuation produces: the text must end right before it
    (plain, cut) = byte_lm.generate_until([Instance("generate_until", {}, (prompt, {"until": u, "max_gen_toks": 12}), 0)
                                           for u in (["@@@"], [stop])], True)
    assert plain == full and cut == full[:full.index(stop)]


def test_each_shipped_task_runs_through_simple_evaluate(byte_lm):
    names = {"hybridlm_copy", "hybridlm_copy_gen", "hybridlm_recall", "hybridlm_code_ppl"}
    assert names == set(local_task_names())
    r = run_tasks(byte_lm, "hybridlm_local", limit=4, bootstrap_iters=0)["results"]
    assert set(r) == names
    assert 0 <= r["hybridlm_recall"]["acc,none"] <= 1 and r["hybridlm_recall"]["sample_len"] == 4
    assert 0 <= r["hybridlm_copy"]["acc,none"] <= 1 and 0 <= r["hybridlm_copy_gen"]["exact_match,none"] <= 1
    assert 1 < r["hybridlm_code_ppl"]["byte_perplexity,none"] < 1e3  # an untrained byte model: near 257


def test_include_path_task_reads_data_next_to_its_yaml(byte_lm, tmp_path, monkeypatch):
    lines = open(os.path.join(TASKS_DIR, "hybridlm_copy.yaml")).read().splitlines()
    yaml = "\n".join(ln for ln in lines if not ln.startswith("tag:")).replace("task: hybridlm_copy", "task: my_copy")
    (tmp_path / "tasks").mkdir()
    (tmp_path / "tasks" / "my_copy.yaml").write_text(yaml.replace("words_", "my_words_"))
    for split in ("train", "test"):
        rows = open(os.path.join(TASKS_DIR, f"words_{split}.jsonl")).readlines()[:3]
        (tmp_path / "tasks" / f"my_words_{split}.jsonl").write_text("".join(rows))
    monkeypatch.chdir(tmp_path)  # not the YAML's directory
    r = run_tasks(byte_lm, "my_copy", include_path=["tasks"], bootstrap_iters=0)["results"]
    assert r["my_copy"]["sample_len"] == 3
    with pytest.raises(InputError, match="is not a directory"):
        run_tasks(byte_lm, "my_copy", include_path=["no_such_dir"])


def copy_rows(tok):
    """Training rows in the copy tasks' format from their train split; the loss is on the answer and its newline."""
    docs = [json.loads(line) for line in open(os.path.join(TASKS_DIR, "words_train.jsonl"))]
    rows = [(tok.encode(f"Word: {d['target']}\nAgain:"), tok.encode(f" {d['target']}\n")) for d in docs]
    T = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), T), tok.eos_id)
    labels = torch.full((len(rows), T), -100)
    for i, (p, a) in enumerate(rows):
        ids[i, :len(p) + len(a)] = torch.tensor(p + a)
        labels[i, len(p):len(p) + len(a)] = torch.tensor(a)
    return ids, labels


def test_tiny_model_trained_here_beats_chance_on_in_context_copy():
    """A 2-layer transformer trained for 500 steps (a few seconds) answers the shipped in-context task far above
    chance, scored and generated through lm-eval."""
    tok = ByteTokenizer()
    torch.manual_seed(0)
    m = CausalLM(presets.get("transformer++", n_layers=2, d_model=64, n_heads=4, vocab_size=257, max_seq_len=64))
    ids, labels = copy_rows(tok)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    # warmup and decay: at a constant 3e-3 the final loss ranged 0.007..1.2 over seeds (and CPUs), and greedy copying
    # with it; with the schedule three seeds end near 0.01 and copy every word
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 30) * max(0.1, 1 - s / 500))
    g = torch.Generator().manual_seed(0)
    for _ in range(500):
        idx = torch.randint(0, len(ids), (16,), generator=g)
        loss = m(ids[idx], labels=labels[idx]).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    r = run_tasks(HybridLMEval(model=m.eval(), tokenizer=tok, batch_size=16), ["hybridlm_copy", "hybridlm_copy_gen"],
                  limit=50, bootstrap_iters=0)["results"]
    assert r["hybridlm_copy"]["acc,none"] > 0.6, r  # chance is 0.25; 50 questions: 0.6 is > 5 standard errors above
    assert r["hybridlm_copy_gen"]["exact_match,none"] > 0.5, r


def hybridlm(*args, cwd=None):
    src = os.path.dirname(os.path.dirname(sys.modules["hybridlm"].__file__))  # this checkout, from any cwd
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src)  # tiny model: one thread, as above
    return subprocess.run([sys.executable, "-m", "hybridlm", *map(str, args)], capture_output=True, text=True,
                          timeout=240, env=env, cwd=cwd)


def test_cli_runs_local_tasks_and_names_unknown_ones(tmp_path):
    save_checkpoint(str(tmp_path / "run"), tiny_model(), tokenizer=ByteTokenizer())
    # from another directory: the tasks' data_files are found next to their YAML
    r = hybridlm("eval", "--checkpoint", tmp_path / "run", "--tasks", "hybridlm_recall,hybridlm_code_ppl",
                 "--limit", 3, "--output", tmp_path / "res.json", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "hybridlm_recall" in r.stdout and "byte_perplexity" in r.stdout
    res = json.load(open(tmp_path / "res.json"))["results"]
    assert set(res) == {"hybridlm_recall", "hybridlm_code_ppl"}
    # lm-eval's own way in: the registered name and a model_args string
    from lm_eval.api.registry import get_model
    lm = get_model("hybridlm").create_from_arg_string(f"checkpoint={tmp_path / 'run'},batch_size=2,device=cpu,"
                                                      "dtype=bfloat16", {"batch_size": None, "max_batch_size": None})
    assert lm.batch_size == 2 and lm.autocast_dtype == torch.bfloat16 and lm.max_length == 64
    assert ll(lm, PAIRS[:2])[0][0] < 0
    with pytest.raises(InputError, match="unknown hybridlm model_args: pretrained"):
        get_model("hybridlm").create_from_arg_string(f"checkpoint={tmp_path / 'run'},pretrained=x")
    r = hybridlm("eval", "--checkpoint", tmp_path / "run", "--tasks", "hybridlm_recal")
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert r.returncode == 2 and len(lines) == 1, r.stderr
    assert lines[0].startswith("hybridlm: error: unknown lm-eval task 'hybridlm_recal'")
    assert "hybridlm_recall" in lines[0]  # the nearest names


def test_tasks_dir_tasks_load_from_any_directory(tmp_path, monkeypatch):
    """`hybridlm eval --tasks-dir DIR` writes the shipped tasks with absolute data_files: lm-eval reads them from a
    working directory that is neither DIR nor the package's."""
    from lm_eval.tasks import TaskManager, get_task_dict
    r = hybridlm("eval", "--tasks-dir", tmp_path / "tasks", cwd=tmp_path)
    assert r.returncode == 0 and "--include_path" in r.stdout, r.stderr
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    tm = TaskManager(include_defaults=False, include_path=[str(tmp_path / "tasks")])
    assert set(local_task_names()) <= set(tm.all_tasks)
    docs = list(get_task_dict(["hybridlm_copy"], tm)["hybridlm_copy"].test_docs())
    assert len(docs) == sum(1 for _ in open(os.path.join(TASKS_DIR, "words_test.jsonl")))


@pytest.mark.slow
@pytest.mark.parametrize("where", ["root", "tmp"])
def test_lm_eval_cli_runs_written_tasks(tmp_path, where):
    """lm-eval's own CLI (transformers' AutoModel through the checkpoint's remote code) runs hybridlm_copy from the
    repository root and from a temporary directory."""
    pytest.importorskip("transformers")
    save_checkpoint(str(tmp_path / "run"), tiny_model(), tokenizer=ByteTokenizer())
    assert hybridlm("eval", "--tasks-dir", tmp_path / "tasks").returncode == 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    src = os.path.dirname(os.path.dirname(sys.modules["hybridlm"].__file__))
    r = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                        f"pretrained={tmp_path / 'run' / 'checkpoint'},trust_remote_code=True", "--tasks",
                        "hybridlm_copy", "--include_path", str(tmp_path / "tasks"), "--limit", "3", "--device", "cpu"],
                       capture_output=True, text=True, timeout=600, cwd=root if where == "root" else tmp_path,
                       env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=src))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "hybridlm_copy" in r.stdout and "acc" in r.stdout
