"""The MQAR sweep engine behind `hybridlm mqar`: layout specs, one point's runs over the learning rates, the rows
(best lr per seed, mean over seeds), resuming from mqar.json and merging sweeps made elsewhere.

The protocol is zoology's (eval/mqar.py): per point, a fresh 2-layer model trained on a fixed set of 100k examples
(too many to memorise) with AdamW (weight decay on matrices only), warmup + cosine over a large step budget, early
stopping once held-out accuracy reaches 0.99, and a learning-rate sweep keeping the best (lrs run in the given
order; once one reaches the target the rest are skipped, as they cannot do better, and once a run is still rising
at the end of its budget the smaller lrs are skipped: they learn slower still, so only a run that plateaued or
collapsed below the target gets a smaller lr). Why: recall is a phase change after thousands of steps, so a short
budget reports 1/pairs for every architecture; early stopping makes the large budget cheap where recall is easy.

The default rows name their position encoding: `attention` (and `inner-fn-dynmask`) use zoology's learned absolute
positions, the baseline every MQAR paper draws; `attention-rope` is the library's default RoPE. The recurrent mixers
get no position embedding (their recurrence orders tokens), as in zoology. The curriculum is for `--hard` (the
Mamba-2 / Wonderful Matrices variant), off by default.

A layout spec is NAME=VALUE[:FIELD=JSON...]: VALUE is a preset name, a layout string, or one token-mixer letter X,
which becomes zoology's mixer + MLP stack `(XM)*LAYERS`; FIELD=JSON sets any ModelConfig field.
"""
import csv
import json
import math
import os
import statistics

from ..jsonio import parse_sets
from ..runtime import load_average


# the sweep's families: each a token mixer + gated MLP per layer, 2 layers (zoology's MQAR models)
DEFAULT_LAYOUTS = ("attention=A:pos_embedding=\"learned\","
                   "attention-rope=A,"
                   "mamba2-n16=S:ssd_d_state=16,"
                   "mamba2-n64=S:ssd_d_state=64,"
                   "rodimus-n16=R:rodimus_d_state=16,"
                   "rodimus-n64=R:rodimus_d_state=64,"
                   "inner-fn-dynmask=F:wm_dyn_mask=\"position\":wm_inner_values=2:pos_embedding=\"learned\","
                   "cheems-ssd-n16=S:ssd_d_state=16:wm_ssd_rope=true,"
                   "gated-deltanet=G,"
                   "kda=K")


ROW_KEYS = ("name", "layout", "d_model", "seq_len", "num_pairs", "accuracy", "accuracy_min", "accuracy_max", "seeds",
            "params", "state_bytes", "lr", "steps", "rising", "devices")


RISING = 0.02   # a run that gained more than this over the last quarter of its budget was cut by the budget


# settings that define the protocol: a resumed sweep must match them (the sweep's axes may grow)
PROTOCOL_KEYS = ("layers", "pairs", "hard", "vocab_size", "curriculum", "steps", "batch_size", "train_examples",
                 "test_examples", "eval_every", "target", "weight_decay", "warmup")


def parse_layouts(text: str, layers: int) -> list[tuple[str, str, dict]]:
    """'attention=A,m2=S:ssd_d_state=16' -> [(name, layout or preset, field overrides)]."""
    from ..models import presets
    from ..errors import InputError
    from ..models.layout import parse_layout
    from ..models.registry import LETTERS
    specs, seen = [], set()
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, eq, rest = item.partition("=")
        value, *sets = rest.split(":")
        name, value = name.strip(), value.strip()
        if not eq or not name or not value:
            raise InputError(f"--layouts expects NAME=SPEC entries, got {item!r}")
        if name in seen:
            raise InputError(f"--layouts names {name!r} twice")
        seen.add(name)
        if value not in presets.PRESETS:
            if len(value) == 1 and value in LETTERS:
                value = f"({value}M)*{layers}"
            try:
                parse_layout(value, LETTERS.keys())
            except Exception as e:
                raise InputError(f"--layouts {name}: {value!r} is neither a preset nor a layout ({e})") from None
        specs.append((name, value, parse_sets(sets)))
    if not specs:
        raise InputError("--layouts is empty")
    return specs


def build_config(value: str, over: dict, *, d_model: int, seq_len: int, vocab_size: int, layers: int):
    """ModelConfig of one sweep point: the spec at this width; single attention heads (the Wonderful Matrices paper
    table 6) and SSD head dims that divide the SSD width, unless the spec sets them."""
    from ..errors import ConfigError
    from ..models import ModelConfig, presets
    from ..models.config import quiet_unread, warn_unread
    if value in presets.PRESETS:
        fields = {**presets.PRESETS[value].fields(layers)}
    else:
        fields = {"layout": value, "n_heads": 1}
    fields.update(d_model=d_model, max_seq_len=seq_len, vocab_size=vocab_size)
    fields["ssd_headdim"] = math.gcd(64, fields.get("ssd_expand", 2) * d_model)
    fields.update(over)
    try:
        with quiet_unread():            # n_heads and ssd_headdim are set for whichever letters the spec uses
            cfg = ModelConfig(**fields)
    except TypeError as e:  # an unknown field
        raise ConfigError(f"--layouts: {e}") from None
    warn_unread(cfg, over)              # what the spec itself sets must be read by one of its letters
    return cfg


def trial_key(t: dict) -> tuple:
    return (t["name"], t["layout"], t["d_model"], t["seq_len"], t["num_pairs"], t["lr"], t["seed"])


def run_point(job: dict) -> list[dict]:
    """One sweep point and seed: its learning rates in order, stopping once one reaches the target (also the
    worker of --jobs: one thread per process). Skips the trials of `job["done"]` (a resumed sweep)."""
    import torch
    from ..eval.mqar import train_mqar
    from ..models.sizing import cache_bytes
    if job["threads"]:
        torch.set_num_threads(job["threads"])
    cfg, task = job["cfg"], job["task"]
    state = cache_bytes(cfg, [task.seq_len])[0]
    trials, rising_at = [], 0.0
    for lr in job["lrs"]:
        if lr < rising_at:                 # smaller than an lr still rising at its budget's end: slower still
            continue
        base = {"name": job["name"], "layout": cfg.layout, "d_model": cfg.d_model, "seq_len": task.seq_len,
                "num_pairs": task.num_pairs, "lr": lr, "seed": job["seed"]}
        prev = job["done"].get(trial_key(base))
        if prev is None:
            res = train_mqar(cfg, task, steps=job["steps"], warmup=job["warmup"], batch_size=job["batch_size"], lr=lr,
                             seed=job["seed"], weight_decay=job["weight_decay"], eval_every=job["eval_every"], target=job["target"],
                             device=job["device"], progress=job["progress"], desc=f"{job['desc']} lr={lr:g}")
            prev = dict(base, accuracy=res["accuracy"], params=res["params"], state_bytes=state, steps=res["steps"],
                        stopped_early=res["stopped_early"], rising=still_rising(res["curve"], job["steps"]),
                        loss=res["loss"], wall_s=res["wall_s"], curve=res["curve"], fields=job["fields"],
                        device=job["device_name"], load_avg=load_average())   # load > cores: it shared its core
            job["report"](prev)
        trials.append(prev)
        if prev["accuracy"] >= job["target"]:
            break
        if prev.get("rising"):
            rising_at = max(rising_at, lr)
    return trials


def still_rising(curve: list, steps: int) -> bool:
    """Whether held-out accuracy gained more than RISING over the last quarter of the step budget: the run ended
    below the target because the budget ran out, not because the model cannot do better (report it as such)."""
    if not curve or curve[-1][0] < steps:                  # stopped early, or no evaluation yet
        return False
    before = [a for s, a in curve if s <= 0.75 * steps]
    return bool(before) and curve[-1][1] - before[-1] > RISING


def best_rows(trials: list[dict]) -> list[dict]:
    """Per (name, d_model, seq_len): each seed's best learning rate (ties: the lower loss), then the mean accuracy
    over seeds (min/max beside it); lr and steps are those of the first seed's best run."""
    best = {}
    for t in trials:
        key = (t["name"], t["d_model"], t["seq_len"], t["seed"])
        if key not in best or (t["accuracy"], -t["loss"]) > (best[key]["accuracy"], -best[key]["loss"]):
            best[key] = t
    points = {}
    for (name, d, T, _), t in sorted(best.items(), key=lambda kv: kv[0][3]):     # seeds in order; points as run
        points.setdefault((name, d, T), []).append(t)
    rows = []
    for runs in points.values():
        accs = [r["accuracy"] for r in runs]
        first = runs[0]
        rows.append({**{k: first[k] for k in ROW_KEYS if k in first}, "accuracy": statistics.fmean(accs),
                     "accuracy_min": min(accs), "accuracy_max": max(accs), "seeds": [r["seed"] for r in runs],
                     "devices": sorted({r.get("device", "cpu") for r in runs})})
    return rows


def write_results(out_dir: str, meta: dict, trials: list[dict]):
    """Write mqar.json / mqar.csv. Trials that another sweep of the same protocol wrote to out_dir meanwhile are
    merged into `trials` (in place) first, so two sweeps over different axes may share one --out; meta["commands"]
    lists every command behind the file."""
    disk = _read_json(out_dir)
    commands = [meta["command"]]
    if disk is not None and not _protocol_diff(disk["meta"].get("settings", {}), meta["settings"]):
        ours = {trial_key(t) for t in trials}
        trials += [t for t in disk["meta"].get("trials", []) if "seed" in t and trial_key(t) not in ours]
        commands = disk["meta"].get("commands") or [disk["meta"].get("command", "")]
        commands += [meta["command"]] * (meta["command"] not in commands)
    return _write(out_dir, dict(meta, commands=commands), trials)


def _write(out_dir: str, meta: dict, trials: list[dict]) -> list[dict]:
    """mqar.json ({"meta": meta + trials, "rows"}, atomically) and mqar.csv from these trials alone -> rows."""
    trials.sort(key=lambda t: (t["seq_len"], t["d_model"]))          # stable: a sweep's own order within a point
    rows = best_rows(trials)
    os.makedirs(out_dir, exist_ok=True)
    tmp = os.path.join(out_dir, f"mqar.json.{os.getpid()}.tmp")     # per process: sweeps may share out_dir
    with open(tmp, "w") as f:
        json.dump({"meta": {**meta, "trials": trials}, "rows": rows}, f, indent=1)
    os.replace(tmp, os.path.join(out_dir, "mqar.json"))
    with open(os.path.join(out_dir, "mqar.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_KEYS)
        w.writeheader()
        w.writerows(dict(r, seeds=" ".join(map(str, r["seeds"])), devices=" ".join(r["devices"])) for r in rows)
    return rows


def _read_json(out_dir: str) -> dict | None:
    from ..errors import InputError
    path = os.path.join(out_dir, "mqar.json")
    if not os.path.exists(path):
        return None
    try:
        with open(path) as f:
            res = json.load(f)
        res["meta"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise InputError(f"{path} is not a readable mqar.json ({e}); remove it or pick another --out") from None
    return res


def _protocol_diff(old: dict, new: dict) -> list[str]:
    from ..eval.mqar import warmup_steps
    # settings written before --warmup had the default warmup only
    old, new = ({"warmup": warmup_steps(s["steps"]), **s} if "steps" in s else s for s in (old, new))
    return [f"{k}: {old.get(k)!r} there, {new.get(k)!r} here" for k in PROTOCOL_KEYS if old.get(k) != new.get(k)]


def read_done(out_dir: str, settings: dict) -> dict:
    """Trials of an earlier sweep in out_dir with the same protocol, by key (empty when there is none)."""
    from ..errors import InputError
    disk = _read_json(out_dir)
    if disk is None:
        return {}
    meta = disk["meta"]
    diff = _protocol_diff(meta.get("settings", {}), settings)
    if diff:
        raise InputError(f"{os.path.join(out_dir, 'mqar.json')} was written with another protocol ({'; '.join(diff)}); "
                         f"pick another --out to start a new sweep")
    return {trial_key(t): t for t in meta.get("trials", []) if "seed" in t}


FAMILIES = {"rodimus": "Rodimus (n)", "mamba2": "Mamba-2 (N)"}     # sweep names FAMILY-nSIZE: the state-size figure


def _family(name: str) -> tuple[str, int] | None:
    fam, _, n = name.rpartition("-n")
    return (fam, int(n)) if fam in FAMILIES and n.isdigit() else None


def state_size_points(rows: list[dict]) -> dict:
    """(d_model, seq_len) -> rows of the points where both families ran at 3 or more state sizes: the sweeps of
    Rodimus' figure 1b (accuracy against the expansion factor n, Rodimus against Mamba-2's N)."""
    by = {}
    for r in rows:
        if _family(r["name"]):
            by.setdefault((r["d_model"], r["seq_len"]), []).append(r)
    return {k: v for k, v in sorted(by.items())
            if all(len({_family(r["name"])[1] for r in v if _family(r["name"])[0] == f}) >= 3 for f in FAMILIES)}


def merge(sources: list[str], out_dir: str) -> tuple[list, list, dict, int]:
    """-> (rows, trials, settings, runs added). Add the runs of other sweeps (their mqar.json, same protocol) to out_dir's: a sweep run elsewhere joins the
    results. Runs out_dir already holds win; a source's commands are recorded with their --out set to out_dir, and
    its runs without a `device` get the device its meta names."""
    import re
    from ..errors import InputError
    base = _read_json(out_dir)
    srcs = []
    for d in sources:
        src = _read_json(d)
        if src is None:
            raise InputError(f"--merge: {os.path.join(d, 'mqar.json')} does not exist")
        srcs.append(src)
    meta = dict((base or srcs[0])["meta"])
    trials = list(meta.pop("trials", [])) if base else []
    commands = (meta.get("commands") or [meta.get("command", "")]) if base else []
    keys = {trial_key(t) for t in trials}
    for d, src in zip(sources, srcs):
        diff = _protocol_diff(meta.get("settings", {}), src["meta"].get("settings", {}))
        if diff:
            raise InputError(f"--merge: {os.path.join(d, 'mqar.json')} was written with another protocol "
                             f"({'; '.join(diff)})")
        for c in src["meta"].get("commands") or [src["meta"].get("command", "")]:
            c = re.sub(r"--out \S+", f"--out {out_dir}", c)   # what reruns it here: no path of the other machine
            commands += [c] * (c not in commands)
        for t in src["meta"].get("trials", []):
            if "seed" in t and trial_key(t) not in keys:
                keys.add(trial_key(t))
                trials.append(dict(t, device=t.get("device") or src["meta"].get("device", "cpu")))
    rows = _write(out_dir, dict(meta, command=commands[-1], commands=commands), trials)
    return rows, trials, meta["settings"], len(trials) - (len(base["meta"].get("trials", [])) if base else 0)
