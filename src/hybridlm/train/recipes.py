"""Ablation recipes: TOML files naming a paper's table, a shared training budget and the configurations to compare.

    recipe = load_recipe("mamba2-attention-ratio")        # shipped in hybridlm/recipes/, or a path to a .toml
    for c in recipe.configs: cfg, params = recipe.model_config(c, vocab_size=256)

A recipe file:

    title = "..."; source = "the Mamba-2 paper, table 2"; minutes_per_model = 2
    [budget]   steps, batch_size, seq_len, lr, warmup, seeds, max_bytes, eval_every, eval_tokens (0: whole split),
               params ("1M": every configuration sized to it), size_by ("width" | "depth"), tolerance, active,
               eval_seq_lens (also validate the final model at these lengths, e.g. 4x the training length)
    [model]    ModelConfig fields shared by every configuration (d_model when not sized, heads, state sizes, ...)
    [[config]] name, preset and/or layout (a "{n}" in the layout is the repeat count sized by depth), n_layers,
               params (overrides the budget's), any ModelConfig field, train = {TrainConfig fields of this one}
    [[claim]]  text, better, worse (configuration names), paper (the paper's figures, for the results page),
               varies (the ModelConfig fields, or "layout", in which the two differ: a test holds every recipe to it),
               pairing ("isolated": varies is what the claim names; "paper": the paper's own comparison, which
               changes several things at once; the recipe then also holds the isolated pairing),
               paper_delta (the paper's effect in nats, for the scale estimate), at (a length of eval_seq_lens:
               judge the claim on the loss there)
    measure    extra figures of each trained model: ["captured_mass"] (the attention mass an `I` layer's top-k
               keeps, with the trained indexer and with the indexer at its initialisation; eval/attention_recall.py)

Sizing by width searches d_model over multiples of `width_step` (default 32); by depth, the `{n}` of the layout
(or a preset's n_layers) from 1 up. `scale` K multiplies the batch by K, depth by K (the layout is repeated K
times, a preset's n_layers ×K) and width by K (a fixed d_model ×K, a parameter budget ×K³).
"""
import dataclasses
import os
import sys
from dataclasses import dataclass, field
from importlib import resources

from ..errors import ConfigError
from ..models.config import RENAMED, ModelConfig, quiet_unread, renamed, warn_unread
from ..models.sizing import count_parameters, fit_params, parse_count

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

TOP_KEYS = {"title", "source", "minutes_per_model", "note", "budget", "model", "config", "claim", "measure"}
MEASURES = {"captured_mass"}   # extra figures per configuration (train/ablate.py)
BUDGET_KEYS = {"steps", "batch_size", "seq_len", "lr", "min_lr", "warmup", "schedule", "weight_decay", "seeds",
               "max_bytes", "eval_every", "eval_tokens", "log_every", "params", "size_by", "tolerance", "active",
               "width_step", "eval_seq_lens"}
CONFIG_KEYS = {"name", "preset", "layout", "n_layers", "params", "note", "train"}
CLAIM_KEYS = {"text", "better", "worse", "paper", "varies", "pairing", "paper_delta", "at"}
MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}
DEFAULT_BUDGET = dict(steps=300, batch_size=8, seq_len=128, lr=2e-3, warmup=30, seeds=[0], max_bytes=1_000_000,
                      eval_every=0, eval_tokens=0, log_every=10, size_by="width", tolerance=0.05,
                      active=False, width_step=32)


@dataclass
class RunConfig:
    """One named configuration of a recipe."""
    name: str
    preset: str | None = None
    layout: str | None = None
    n_layers: int | None = None
    params: int | None = None
    fields: dict = field(default_factory=dict)
    note: str = ""
    train: dict = field(default_factory=dict)    # TrainConfig fields for this configuration only


@dataclass
class Recipe:
    name: str
    title: str
    source: str
    minutes_per_model: float
    budget: dict
    model: dict
    configs: list[RunConfig]
    claims: list[dict]
    note: str = ""
    path: str = ""
    measure: list[str] = field(default_factory=list)

    def scaled(self, k: int) -> "Recipe":
        """Batch ×k, depth ×k, width ×k (a parameter budget ×k³); k = 1 returns self."""
        if k == 1:
            return self
        if k < 1:
            raise ConfigError(f"scale must be >= 1, got {k}")
        b = dict(self.budget, batch_size=self.budget["batch_size"] * k)
        if b.get("params"):
            b["params"] = b["params"] * k ** 3
        model = dict(self.model)
        if "d_model" in model:
            model["d_model"] *= k
        configs = [dataclasses.replace(
            c, layout=f"({c.layout})*{k}" if c.layout else None,
            n_layers=c.n_layers * k if c.n_layers else None, params=c.params * k ** 3 if c.params else None,
            fields=dict(c.fields, **({"d_model": c.fields["d_model"] * k} if "d_model" in c.fields else {})))
            for c in self.configs]
        return dataclasses.replace(self, budget=b, model=model, configs=configs)

    def build(self, c: RunConfig, vocab_size: int, *, d_model: int | None = None, n: int | None = None) -> ModelConfig:
        """The ModelConfig of configuration `c` at width d_model / repeat count n (None: as written)."""
        from ..models import presets
        over = dict(self.model, **c.fields, vocab_size=vocab_size)
        over["max_seq_len"] = max(over.get("max_seq_len", 0), self.budget["seq_len"],
                                  *self.budget.get("eval_seq_lens") or [0])
        if d_model is not None:
            over["d_model"] = d_model
        if c.layout is not None:
            over["layout"] = c.layout.replace("{n}", str(n if n is not None else 1))
        try:
            with quiet_unread():      # the recipe's [model] fields serve every configuration, whatever its letters
                if c.preset is not None:
                    cfg = presets.get(c.preset, n_layers=n if n is not None and c.layout is None else c.n_layers,
                                      **over)
                else:
                    cfg = ModelConfig(**over)
        except ConfigError as e:
            raise ConfigError(f"recipe {self.name!r}, configuration {c.name!r}: {str(e).splitlines()[0]}") from None
        warn_unread(cfg, c.fields)
        return cfg

    def model_config(self, c: RunConfig, vocab_size: int) -> tuple[ModelConfig, int]:
        """-> (config sized to the budget when the recipe or `c` sets params, its parameter count)."""
        target = c.params or self.budget.get("params")
        active = bool(self.budget["active"])
        if not target:
            cfg = self.build(c, vocab_size)
            return cfg, count_parameters(cfg)
        tol = float(self.budget["tolerance"])
        by = self.budget["size_by"]
        try:
            if by == "width":
                step = int(self.budget["width_step"])
                cfg, _ = fit_params(lambda d: self.build(c, vocab_size, d_model=d), target,
                                    range(step, 64 * step + 1, step), tolerance=tol, active=active, what="d_model")
            else:
                fixed = c.layout is None or "{n}" in c.layout
                if not fixed:
                    raise ConfigError("size_by = 'depth' needs a layout with '{n}' (the repeat count) or a preset")
                cfg, _ = fit_params(lambda n: self.build(c, vocab_size, n=n), target, range(1, 257),
                                    tolerance=tol, active=active, what="repeat count")
        except ConfigError as e:
            msg = str(e).splitlines()[0]
            raise ConfigError(msg if msg.startswith("recipe ") else
                              f"recipe {self.name!r}, configuration {c.name!r}: {msg}") from None
        return cfg, count_parameters(cfg)


def recipe_dir():
    return resources.files("hybridlm") / "recipes"


def list_recipes() -> dict[str, str]:
    """Shipped recipe name -> title."""
    out = {}
    for f in sorted(recipe_dir().iterdir(), key=lambda p: p.name):
        if f.name.endswith(".toml"):
            out[f.name[:-5]] = tomllib.loads(f.read_text()).get("title", "")
    return out


def _check_keys(where: str, got: dict, allowed: set[str]):
    unknown = sorted(set(got) - allowed)
    if unknown:
        import difflib
        hint = difflib.get_close_matches(unknown[0], sorted(allowed), n=1)
        raise ConfigError(f"{where}: unknown field {unknown[0]!r}" + (f" (did you mean {hint[0]!r}?)" if hint else ""))


def load_recipe(spec: str) -> Recipe:
    """A shipped recipe by name, or a path to a TOML file."""
    if spec.endswith(".toml") or os.sep in spec:
        if not os.path.exists(spec):
            raise ConfigError(f"recipe file {spec} does not exist")
        with open(spec, "rb") as f:
            text, name, path = f.read().decode(), os.path.basename(spec)[:-5], spec
    else:
        f = recipe_dir() / f"{spec}.toml"
        if not f.is_file():
            raise ConfigError(f"unknown recipe {spec!r}; shipped recipes: {', '.join(list_recipes())}")
        text, name, path = f.read_text(), spec, f"hybridlm/recipes/{spec}.toml"
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"recipe {name!r} is not valid TOML: {e}") from None
    return parse_recipe(raw, name, path)


def parse_recipe(raw: dict, name: str, path: str = "") -> Recipe:
    where = f"recipe {name!r}"
    _check_keys(where, raw, TOP_KEYS)
    for key in ("title", "source", "minutes_per_model", "config"):
        if key not in raw:
            raise ConfigError(f"{where}: missing {key!r}")
    budget = dict(DEFAULT_BUDGET)
    _check_keys(f"{where} [budget]", raw.get("budget", {}), BUDGET_KEYS)
    budget.update(raw.get("budget", {}))
    if budget.get("params") is not None:
        budget["params"] = parse_count(budget["params"])
    if budget["size_by"] not in ("width", "depth"):
        raise ConfigError(f"{where}: size_by must be 'width' or 'depth', got {budget['size_by']!r}")
    if isinstance(budget["seeds"], int):
        budget["seeds"] = [budget["seeds"]]
    model = renamed(raw.get("model", {}), f"{where} [model]")    # old field names (RENAMED) still read
    _check_keys(f"{where} [model]", model, MODEL_FIELDS - {"layout", "vocab_size"})
    configs, seen = [], set()
    for i, c in enumerate(raw["config"]):
        c = renamed(c, f"{where}, configuration {i + 1}")
        cname = c.get("name")
        if not cname:
            raise ConfigError(f"{where}: configuration {i + 1} has no name")
        if cname in seen:
            raise ConfigError(f"{where}: two configurations are named {cname!r}")
        seen.add(cname)
        _check_keys(f"{where}, configuration {cname!r}", c, CONFIG_KEYS | (MODEL_FIELDS - {"vocab_size"}))
        if not c.get("preset") and not c.get("layout"):
            raise ConfigError(f"{where}, configuration {cname!r}: give a preset or a layout")
        fields = {k: v for k, v in c.items() if k not in CONFIG_KEYS}
        from .trainer import TrainConfig
        _check_keys(f"{where}, configuration {cname!r}, train", c.get("train", {}),
                    {f.name for f in dataclasses.fields(TrainConfig)} - {"seed", "device", "init_from"})
        configs.append(RunConfig(name=cname, preset=c.get("preset"), layout=c.get("layout"), n_layers=c.get("n_layers"),
                                 params=parse_count(c["params"]) if c.get("params") else None, fields=fields,
                                 note=c.get("note", ""), train=dict(c.get("train", {}))))
    claims = raw.get("claim", [])
    for cl in claims:
        _check_keys(f"{where} [[claim]]", cl, CLAIM_KEYS)
        if "varies" in cl:
            cl["varies"] = [RENAMED.get(v, v) for v in cl["varies"]]
        if cl.get("pairing", "isolated") not in ("isolated", "paper"):
            raise ConfigError(f"{where}: claim {cl.get('text', '')!r}: pairing must be 'isolated' or 'paper'")
        if cl.get("at") is not None and cl["at"] not in (budget.get("eval_seq_lens") or []):
            raise ConfigError(f"{where}: claim {cl.get('text', '')!r} is judged at length {cl['at']}, which is not "
                              f"in the budget's eval_seq_lens")
        for side in ("better", "worse"):
            if cl.get(side) not in seen:
                raise ConfigError(f"{where}: claim {cl.get('text', '')!r} names unknown configuration "
                                  f"{cl.get(side)!r}")
    measure = list(raw.get("measure", []))
    for m in measure:
        if m not in MEASURES:
            raise ConfigError(f"{where}: unknown measure {m!r} (known: {', '.join(sorted(MEASURES))})")
    r = Recipe(name=name, title=raw["title"], source=raw["source"], minutes_per_model=float(raw["minutes_per_model"]),
               budget=budget, model=model, configs=configs, claims=claims, note=raw.get("note", ""), path=path,
               measure=measure)
    from ..models.layout import parse_layout
    from ..models.registry import LETTERS
    for c in configs:                                   # a bad layout is reported now, not after other runs
        if c.layout:
            try:
                parse_layout(c.layout.replace("{n}", "1"), LETTERS.keys())
            except ConfigError as e:
                raise ConfigError(f"{where}, configuration {c.name!r}: {str(e).splitlines()[0]}") from None
    return r
