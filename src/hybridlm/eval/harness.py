"""lm-evaluation-harness adapter: any hybridlm model as an lm-eval `LM`, registered as "hybridlm".

    import hybridlm.eval.harness                       # registers the model name with lm-eval
    lm_eval.simple_evaluate(model="hybridlm", model_args="checkpoint=runs/m2a,batch_size=8,device=cpu",
                            tasks=["hellaswag"])
    lm_eval.simple_evaluate(model=HybridLMEval(model=m, tokenizer=tok), tasks=[...])   # or an object

Scoring (loglikelihood, loglikelihood_rolling) sorts requests by length, right-pads each batch (a causal model's
logits at real positions do not depend on what follows them, so no mask is needed) and runs one forward per batch,
keeping only the logits the continuations need. Long texts are scored in windows of the model's max_seq_len, each
token predicted once. Generation left-pads a batch of prompts and decodes with the model's own cache (`stream`)
until every row has produced a stop sequence, eos, or max_gen_toks tokens.
"""
import torch
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..errors import InputError

_DTYPES = {"float32": None, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _batches(items: list, size: int):
    for i in range(0, len(items), size):
        yield items[i:i + size]


@register_model("hybridlm")
class HybridLMEval(TemplateLM):
    """`checkpoint` (a run or checkpoint directory) or `model` + `tokenizer` (a CausalLM in memory).

    batch_size: requests per forward. device: cpu | cuda | cuda:N | auto. dtype: float32, or bfloat16 / float16
    autocast (weights stay float32, as in training). max_length: tokens per window (default the model's
    max_seq_len). max_gen_toks: default generation budget when a task sets none. max_batch_size (what lm-eval
    passes along with "auto") is not used.
    """

    def __init__(self, checkpoint: str | None = None, *, model=None, tokenizer=None, batch_size: int | str = 8,
                 device: str | None = "cpu", dtype: str = "float32", max_length: int | None = None,
                 max_gen_toks: int = 256, max_batch_size: int | None = None, **unknown):
        super().__init__()
        if unknown:
            raise InputError(f"unknown hybridlm model_args: {', '.join(sorted(unknown))} (known: checkpoint, "
                             "batch_size, device, dtype, max_length, max_gen_toks)")
        if (checkpoint is None) == (model is None):
            raise InputError("give the hybridlm lm-eval model either checkpoint=RUN or a model and its tokenizer")
        device = torch.device("cuda" if device == "auto" and torch.cuda.is_available() else
                              "cpu" if device in (None, "auto") else device)
        if checkpoint is not None:
            from ..checkpoint import load_pretrained
            model, tokenizer = load_pretrained(str(checkpoint), device)
        if tokenizer is None:
            raise InputError("a model given to the hybridlm lm-eval model needs its tokenizer")
        if dtype == "auto":   # bfloat16 on hardware with bf16 matmul units (hybridlm.dtypes)
            from ..dtypes import resolve_dtype
            dtype = resolve_dtype(dtype, device)[0]
        if dtype not in _DTYPES:
            raise InputError(f"dtype must be auto or one of {', '.join(_DTYPES)}, got {dtype!r}")
        if str(batch_size).startswith("auto"):
            batch_size = 8  # lm-eval's "auto" probes GPU memory; a fixed default is predictable on any device
        self.model = model.to(device).eval()
        self.tok = tokenizer
        self._device = device
        self.autocast_dtype = _DTYPES[dtype]
        self.batch_size = int(batch_size)
        self.max_length = min(int(max_length or model.config.max_seq_len), model.config.max_seq_len)
        self.max_gen_toks = int(max_gen_toks)
        if self.batch_size < 1 or self.max_length < 2:
            raise InputError(f"batch_size must be >= 1 and max_length >= 2, got {self.batch_size}, {self.max_length}")

    # --- tokenization (TemplateLM splits context/continuation by encoding them together, as HFLM does) ---
    @property
    def eot_token_id(self) -> int:
        return self.tok.eos_id

    @property
    def tokenizer_name(self) -> str:
        return f"hybridlm-{self.tok.kind}-{self.tok.vocab_size}"

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        return self.tok.encode(string)

    def tok_decode(self, ids, **kwargs) -> str:
        return self.tok.decode(ids)

    # --- scoring -------------------------------------------------------------------------------------
    def _autocast(self):
        return torch.autocast(self._device.type, dtype=self.autocast_dtype, enabled=self.autocast_dtype is not None)

    @torch.inference_mode()
    def score_tokens(self, pairs: list[tuple[list[int], list[int]]], progress: bool = False
                     ) -> list[tuple[float, bool]]:
        """[(context ids, continuation ids)] -> [(log p(continuation | context), whether greedy decoding gives the
        continuation)]. A context too long for one window loses its oldest tokens."""
        rows = []
        for ctx, cont in pairs:
            if not ctx or not cont:
                raise InputError("scoring needs a non-empty context and continuation (lm-eval passes eos for an "
                                 "empty context)")
            if len(cont) > self.max_length:
                raise InputError(f"continuation of {len(cont)} tokens exceeds max_length {self.max_length}")
            rows.append(((ctx + cont)[-(self.max_length + 1):-1], cont))
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))  # longest first: less padding
        out = [None] * len(rows)
        for idx in tqdm(list(_batches(order, self.batch_size)), disable=not progress, desc="scoring", leave=False):
            T = len(rows[idx[0]][0])
            ids = torch.zeros(len(idx), T, dtype=torch.long)
            for b, i in enumerate(idx):
                ids[b, :len(rows[i][0])] = torch.tensor(rows[i][0])
            # only the positions that predict a continuation token need logits
            keep = T - min(len(rows[i][0]) - len(rows[i][1]) for i in idx)
            with self._autocast():
                logits = self.model(ids.to(self._device), logits_to_keep=keep).logits
            for b, i in enumerate(idx):
                inp, cont = rows[i]
                end = len(inp) - T + keep  # index of this row's last real position within the kept logits
                lp = torch.log_softmax(logits[b, end - len(cont):end].float(), dim=-1)
                target = torch.tensor(cont, device=lp.device)
                out[i] = (float(lp.gather(-1, target[:, None]).sum()), bool((lp.argmax(-1) == target).all()))
        return out

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.score_tokens([(ctx, cont) for _, ctx, cont in requests], progress=not disable_tqdm)
        for (args, _, _), r in zip(requests, results):
            self.cache_hook.add_partial("loglikelihood", args, r)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Log-likelihood of whole texts, eos as the first context; texts longer than max_length are cut into
        windows that predict each token once, each with as much preceding text as fits (lm-eval's rolling windows)."""
        windows, owner = [], []
        for r, (text,) in enumerate(req.args for req in requests):
            for w in lm_utils.get_rolling_token_windows(self.tok_encode(text), prefix_token=self.prefix_token_id,
                                                        max_seq_len=self.max_length, context_len=1):
                windows.append(lm_utils.make_disjoint_window(w))
                owner.append(r)
        totals = [0.0] * len(requests)
        for r, (lp, _) in zip(owner, self.score_tokens(windows, progress=not disable_tqdm)):
            totals[r] += lp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    # --- generation ----------------------------------------------------------------------------------
    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy (or sampled, with do_sample) continuations, cut before the first of `until`."""
        out = [None] * len(requests)
        groups = {}  # requests with the same generation settings share batches
        for i, req in enumerate(requests):
            groups.setdefault(repr(sorted(req.args[1].items())), []).append(i)
        bar = tqdm(total=len(requests), disable=disable_tqdm, desc="generating", leave=False)
        for idx in groups.values():
            kwargs = dict(requests[idx[0]].args[1])
            until = kwargs.pop("until", None) or []
            until = [s for s in ([until] if isinstance(until, str) else until) if s]
            n_new = int(kwargs.pop("max_gen_toks", self.max_gen_toks))
            n_new = max(1, min(n_new, self.max_length - 1))
            sample = kwargs.pop("do_sample", False)
            temperature = float(kwargs.pop("temperature", 1.0)) if sample else 0.0
            prompts = {i: self.tok_encode(requests[i].args[0])[-(self.max_length - n_new):] or [self.prefix_token_id]
                       for i in idx}
            for batch in _batches(sorted(idx, key=lambda i: -len(prompts[i])), self.batch_size):
                texts = self.generate_ids([prompts[i] for i in batch], n_new, until, temperature=temperature,
                                          top_k=kwargs.get("top_k"), top_p=kwargs.get("top_p"))
                for i, text in zip(batch, texts):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
                bar.update(len(batch))
        bar.close()
        return out

    @torch.inference_mode()
    def generate_ids(self, prompts: list[list[int]], max_new_tokens: int, until: list[str], temperature: float = 0.0,
                     top_k: int | None = None, top_p: float | None = None) -> list[str]:
        """Decode a batch of prompts (left-padded, masked) with the model's cache; each row's text stops before
        the first stop string or at eos."""
        T = max(map(len, prompts))
        ids = torch.zeros(len(prompts), T, dtype=torch.long)
        mask = torch.zeros(len(prompts), T, dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, T - len(p):] = torch.tensor(p)
            mask[b, T - len(p):] = 1
        new = [[] for _ in prompts]
        done = [False] * len(prompts)
        with self._autocast():
            steps = self.model.stream(ids.to(self._device), max_new_tokens, temperature=temperature, top_k=top_k,
                                      top_p=top_p, attention_mask=mask.to(self._device), eos_token_id=self.eot_token_id)
            for nxt in steps:
                for b, t in enumerate(nxt.tolist()):
                    if done[b]:
                        continue
                    if t == self.eot_token_id:
                        done[b] = True
                    else:
                        new[b].append(t)
                        done[b] = any(s in self.tok_decode(new[b]) for s in until)
                if all(done):
                    break
        return [_cut(self.tok_decode(n), until) for n in new]


def _cut(text: str, until: list[str]) -> str:
    """`text` up to (not including) the earliest stop string in it."""
    return text[:min([text.find(s) for s in until if s in text], default=len(text))]
