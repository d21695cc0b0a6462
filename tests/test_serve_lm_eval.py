"""lm-eval's own `local-completions` model against a running `hybridlm serve` (loopback) gives the numbers
`hybridlm eval` gives in process: a loglikelihood task (multiple choice) and a generate-until task of the shipped
tasks, per sample."""
import pytest
import torch

pytest.importorskip("starlette")
pytest.importorskip("lm_eval")
pytest.importorskip("tenacity")          # lm-eval's api extra
pytest.importorskip("aiohttp")

from hybridlm.checkpoint import save_checkpoint  # noqa: E402
from hybridlm.data.tokenizer import ByteTokenizer  # noqa: E402
from serve_helpers import live_server, tiny  # noqa: E402

TASKS = ["hybridlm_recall", "hybridlm_copy_gen"]
LIMIT = 24


def evaluate(model, model_args=None):
    import lm_eval
    import lm_eval.models.openai_completions  # noqa: F401   (registers local-completions)
    from hybridlm.eval.harness_tasks import task_manager, task_specs
    tm = task_manager(TASKS)
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=task_specs(tm, TASKS), task_manager=tm,
                                   limit=LIMIT, bootstrap_iters=0, log_samples=True, random_seed=0,
                                   numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def responses(res, task):
    return [s["filtered_resps"] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


@pytest.mark.slow
def test_lm_eval_local_completions_equals_hybridlm_eval(tmp_path):
    from hybridlm.eval.harness import HybridLMEval
    torch.set_num_threads(1)
    model = tiny("mamba2-attention", max_seq_len=256)
    ckpt = save_checkpoint(str(tmp_path), model, tokenizer=ByteTokenizer())
    local = evaluate(HybridLMEval(ckpt, batch_size=4, device="cpu", dtype="float32"))
    with live_server(model, ByteTokenizer(), max_slots=4, block=16) as (url, _):
        served = evaluate("local-completions",
                          f"model=tiny,base_url={url}/v1/completions,tokenizer={ckpt},tokenizer_backend=huggingface,"
                          "num_concurrent=2,max_retries=1,tokenized_requests=True")
    for task in TASKS:
        a, b = local["results"][task], served["results"][task]
        metrics = [k for k in a if k.endswith(",none") and "stderr" not in k]
        assert metrics and all(a[k] == b[k] for k in metrics), (task, a, b)
    for (la, ga), (lb, gb) in zip(*(sum(responses(r, "hybridlm_recall"), []) for r in (local, served))):
        assert la == pytest.approx(lb, abs=1e-3) and ga == gb
    assert responses(local, "hybridlm_copy_gen") == responses(served, "hybridlm_copy_gen")


@pytest.mark.slow
def test_docs_lm_eval_command_with_a_relative_path(tmp_path, monkeypatch):
    """docs/serving.md's `lm_eval --model local-completions --model_args model=RUN,...,tokenizer=RUN` as typed, RUN a
    relative path: `hybridlm serve --checkpoint RUN` answers to RUN (and to its directory's name)."""
    import argparse
    import threading
    import time

    import httpx
    import uvicorn
    from hybridlm.cli import build_parser
    from hybridlm.commands.serve import build
    from serve_helpers import free_port
    monkeypatch.chdir(tmp_path)
    save_checkpoint("runs/m2a", tiny("mamba2", max_seq_len=256), tokenizer=ByteTokenizer())
    args = build_parser().parse_args(["serve", "--checkpoint", "runs/m2a", "--dtype", "float32", "--max-slots", "2"])
    app, _ = build(argparse.Namespace(**vars(args)))
    sock = free_port()
    server = uvicorn.Server(uvicorn.Config(app, log_level="error"))
    server.install_signal_handlers = lambda: None
    th = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    th.start()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    try:
        while not server.started:
            time.sleep(0.01)
        assert [m["id"] for m in httpx.get(url + "/v1/models").json()["data"]] == ["runs/m2a", "m2a"]
        r = httpx.post(url + "/v1/completions", json={"model": "m2a", "prompt": "x", "max_tokens": 1})
        assert r.status_code == 200 and r.json()["model"] == "m2a"
        import lm_eval
        import lm_eval.models.openai_completions  # noqa: F401
        from hybridlm.eval.harness_tasks import task_manager, task_specs
        tm = task_manager(["hybridlm_recall"])
        res = lm_eval.simple_evaluate(
            model="local-completions", tasks=task_specs(tm, ["hybridlm_recall"]), task_manager=tm, limit=4,
            model_args=f"model=runs/m2a,base_url={url}/v1/completions,tokenizer=runs/m2a/checkpoint,max_retries=1",
            bootstrap_iters=0)
        assert 0 <= res["results"]["hybridlm_recall"]["acc,none"] <= 1
    finally:
        server.should_exit = True
        th.join(20)
        sock.close()
