"""Run lm-evaluation-harness tasks on a hybridlm model: the shipped local tasks, your own, or lm-eval's.

    results = run_tasks(HybridLMEval(model=m, tokenizer=tok), ["hybridlm_recall"], limit=50)
    print(results_table(results))
    evaluate_checkpoint("runs/m2a", "hybridlm_local", output="results.json")   # what `hybridlm eval --tasks` runs

Task YAMLs are looked up in TASKS_DIR (tasks shipped with hybridlm, all tagged `hybridlm_local`), then in
`include_path`, then in lm-eval's own task collection (indexed only when a name needs it: it takes seconds).
Relative `dataset_kwargs.data_files` in a task's YAML are read relative to that YAML, not the working directory.
lm-eval's own CLI reads them against the working directory instead: `write_tasks(DIR)` (`hybridlm eval --tasks-dir
DIR`) writes the shipped tasks with their data and absolute data_files, runnable from anywhere:

    lm_eval --model hf --model_args pretrained=RUN,trust_remote_code=True --tasks hybridlm_copy --include_path DIR
"""
import json
import os
import re
import shutil
from difflib import get_close_matches

from ..errors import ConfigError, InputError

TASKS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tasks")


def _lm_eval():
    try:
        import lm_eval
    except ImportError:
        raise ConfigError("lm-evaluation-harness tasks need lm-eval: pip install 'hybridlm[eval]'") from None
    return lm_eval


def task_manager(names: list[str], include_path: list[str] | None = None):
    """A TaskManager that knows every name in `names`; an unknown name is an InputError naming it."""
    from lm_eval.tasks import TaskManager
    paths = [TASKS_DIR] + [os.path.abspath(p) for p in include_path or []]
    for p in paths:
        if not os.path.isdir(p):
            raise InputError(f"--include-path {p} is not a directory")
    tm = TaskManager(include_defaults=False, include_path=paths)
    if any(n not in tm.all_tasks for n in names):
        tm = TaskManager(include_path=paths)
    for n in names:
        if n not in tm.all_tasks and not os.path.isfile(n):
            near = get_close_matches(n, tm.all_tasks, n=3)
            raise InputError(f"unknown lm-eval task {n!r}" + (f" (did you mean {', '.join(near)}?)" if near else
                             "; local tasks: " + ", ".join(local_task_names())))
    return tm


def local_task_names() -> list[str]:
    return sorted(f[:-5] for f in os.listdir(TASKS_DIR) if f.endswith(".yaml"))


def write_tasks(directory: str) -> list[str]:
    """The shipped task YAMLs and their data copied into `directory`, each relative data_files entry rewritten as
    the absolute path of its copy. -> the YAML paths written."""
    directory = os.path.abspath(directory)
    os.makedirs(directory, exist_ok=True)
    written = []
    for name in sorted(os.listdir(TASKS_DIR)):
        if not name.endswith(".yaml"):
            shutil.copy2(os.path.join(TASKS_DIR, name), os.path.join(directory, name))
            continue
        text = open(os.path.join(TASKS_DIR, name)).read()
        # "    train: words_train.jsonl" -> "    train: '/abs/dir/words_train.jsonl'" (the data_files entries)
        text = re.sub(r"^(\s+\w+: )([\w.-]+\.jsonl)\s*$",
                      lambda m: m.group(1) + json.dumps(os.path.join(directory, m.group(2))), text, flags=re.M)
        path = os.path.join(directory, name)
        with open(path, "w") as f:
            f.write("# written by `hybridlm eval --tasks-dir`: data_files are absolute, so lm-eval's CLI runs this "
                    "task from any directory\n" + text)
        written.append(path)
    return written


def _with_local_data(entry) -> dict:
    """A task's full config with relative data_files made absolute against its YAML's directory."""
    from lm_eval.tasks._yaml_loader import load_yaml
    cfg = load_yaml(entry.yaml_path, resolve_func=True)
    files = (cfg.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        return cfg

    def resolve(p):
        return p if os.path.isabs(p) or "://" in p else os.path.join(os.path.dirname(entry.yaml_path), p)

    if isinstance(files, dict):
        files = {k: [resolve(p) for p in v] if isinstance(v, list) else resolve(v) for k, v in files.items()}
    else:
        files = [resolve(p) for p in files] if isinstance(files, list) else resolve(files)
    cfg["dataset_kwargs"] = {**cfg["dataset_kwargs"], "data_files": files}
    return cfg


def task_specs(tm, names: list[str]) -> list:
    """What simple_evaluate should load for `names`: tags expand to their tasks; a task from a YAML with relative
    data_files becomes its resolved config dict; anything else (groups, lm-eval's tasks) stays a name."""
    from lm_eval.tasks._index import Kind
    specs = []
    for n in names:
        entry = tm.task_index.get(n)
        if entry is not None and entry.kind == Kind.TAG:
            specs += task_specs(tm, sorted(k for k, e in tm.task_index.items() if n in e.tags and e.kind == Kind.TASK))
        elif entry is not None and entry.kind == Kind.TASK and entry.yaml_path is not None:
            specs.append(_with_local_data(entry))
        else:
            specs.append(n)
    return specs


def run_tasks(lm, names: str | list[str], *, include_path: list[str] | None = None, limit: float | None = None,
              num_fewshot: int | None = None, bootstrap_iters: int = 1000, seed: int = 1234) -> dict:
    """lm_eval.simple_evaluate over `names` (a list, or one comma-separated string) -> lm-eval's results dict."""
    lm_eval = _lm_eval()
    names = [n.strip() for n in names.split(",")] if isinstance(names, str) else list(names)
    names = [n for n in names if n]
    if not names:
        raise InputError("no lm-eval task named")
    tm = task_manager(names, include_path)
    if limit is not None and limit >= 1:
        limit = int(limit)  # lm-eval reads a float limit as a fraction of each task
    return lm_eval.simple_evaluate(model=lm, tasks=task_specs(tm, names), task_manager=tm, limit=limit,
                                   num_fewshot=num_fewshot, bootstrap_iters=bootstrap_iters, log_samples=False,
                                   random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                   fewshot_random_seed=seed)


def results_table(results: dict) -> str:
    from lm_eval.utils import make_table
    return make_table(results) + (("\n" + make_table(results, "groups")) if results.get("groups") else "")


def evaluate_checkpoint(checkpoint: str, tasks: str | list[str], *, include_path: list[str] | None = None,
                        limit: float | None = None, num_fewshot: int | None = None, batch_size: int = 8,
                        device: str = "auto", dtype: str = "auto", output: str | None = None) -> str:
    """Load a checkpoint, run the tasks, write the results JSON to `output` if given -> the results table."""
    _lm_eval()
    from lm_eval.utils import handle_non_serializable
    from .harness import HybridLMEval
    lm = HybridLMEval(checkpoint, batch_size=batch_size, device=device, dtype=dtype)
    results = run_tasks(lm, tasks, include_path=include_path, limit=limit, num_fewshot=num_fewshot)
    if output:
        os.makedirs(os.path.dirname(os.path.abspath(output)), exist_ok=True)
        with open(output, "w") as f:
            json.dump(results, f, indent=2, default=handle_non_serializable)
    return results_table(results)
