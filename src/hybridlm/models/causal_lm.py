"""The one model class: embedding -> residual blocks built from the layout -> norm -> lm_head.

forward = `_check_input` (one InputError before any work) -> `_context` (SeqContext: positions, masks, segments;
advances the cache's bookkeeping) -> `_hidden` (embedding, blocks, final norm) -> lm_head, or the head fused with the
loss. Mixers leave auxiliary losses on themselves (`aux_loss`: MoE load balance; `indexer_kl`: the lightning
indexers' KL, averaged over `I` layers); forward collects and weights them, so no mixer returns extra values.

Construction is always on the meta device, then `to_empty` + `init_weights()` unless the caller itself builds under
`torch.device("meta")` (training initialises after sharding): a meta build initialised later is the eager build,
number for number. Weight sharing (`X@k`): every occurrence is its own module (own layer index and cache slot);
`tie_weights()` points later occurrences' parameters at the first's (skipping parts marked `_unshared`), again after
`to_empty` or `load_state_dict(assign=True)`; `init_weights` draws a shared tensor once. The state dict keeps every
name (safetensors stores the shared tensor once; the transformers wrapper reports the names as tied).

Decoding: `stream` prefills a cache sized for prompt + new tokens, then `decode_step` runs one token with no checks
and no host syncs (one graph under torch.compile). On CUDA with `compile=True`, `static_decode_step` instead: fixed
shapes over the whole preallocated cache, compiled once as a CUDA graph. CPUs keep the growing step: it reads only
the tokens seen, and the static step measured 1.03-1.3x slower per token there.
"""
import math
from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from ..cache import InferenceCache
from ..context import SeqContext
from ..errors import ConfigError, InputError
from ..layers import cpu_steps
from ..layers.init import normal_, reset_
from ..layers.norm import make_norm
from ..layers.residual import Fed, ParallelResidual, Residual
from ..layers.short_conv import old_conv_names
from ..ops.cpu_kernels import cxx_compiler
from ..ops.loss import cross_entropy, linear_cross_entropy
from .config import ModelConfig
from .layout import Hop, Parallel, parse_layout, shared_groups
from .registry import LETTERS, lazy


@dataclass
class CausalLMOutput:
    logits: Tensor | None            # [B, T, vocab] (or the last `logits_to_keep` positions); None when the
                                     # loss was fused with the LM head (labels given, return_logits not asked)
    loss: Tensor | None = None       # mean next-token cross-entropy (+ weighted auxiliary losses)
    cache: InferenceCache | None = None
    aux_loss: Tensor | None = None   # sum of the mixers' auxiliary losses (MoE load balancing); training/labels only
    indexer_kl: Tensor | None = None  # mean over `I` layers of their indexer's KL to the main attention (training
                                      # only; added to `loss` × dsa_kl_weight)


_COMPILED = {}   # torch.compile'd functions, built on first use


# builders for residual schemes, keyed by ("letter" | "hop" | "parallel"); other modules may add kinds of their own
BLOCKS = {}


def _build_plain(cfg: ModelConfig, letter: str, idx: int) -> nn.Module:
    lcfg = cfg.for_layer(idx)
    spec = LETTERS[letter]
    if not spec.residual:       # Z: takes the raw stream and is added nowhere (its output feeds the next letter)
        return spec.build(lcfg, idx)
    return Residual(make_norm(lcfg.norm, lcfg.d_model, lcfg.norm_eps), spec.build(lcfg, idx), spec.token,
                    lcfg.d_model, learnable_scale=lcfg.residual_scale)


def _build_parallel(cfg: ModelConfig, letters: tuple, idx: int) -> nn.Module:
    """`{...}`: token mixers at layer indices idx, idx+1, ... (one cache slot each) behind one norm (the first
    letter's config sizes it)."""
    cfgs = [cfg.for_layer(idx + j) for j in range(len(letters))]
    mods = [LETTERS[letter].build(c, idx + j) for j, (letter, c) in enumerate(zip(letters, cfgs))]
    return ParallelResidual(make_norm(cfgs[0].norm, cfgs[0].d_model, cfgs[0].norm_eps), mods, cfgs[0].d_model,
                            learnable_scale=cfgs[0].residual_scale)


BLOCKS["letter"] = _build_plain
BLOCKS["parallel"] = _build_parallel
BLOCKS["hop"] = lazy("mixers_rodimus:_build_hop")      # Rodimus++'s two-hop residual [token, attention, channel]


def _shared_slots(src: nn.Module, dst: nn.Module):
    """(dst submodule, name, src parameter) for every parameter `dst` shares with `src` (same structure), except
    those of submodules or parameters marked `_unshared` (per-occurrence parts, e.g. Zamba2's LoRA adapters and
    output projection)."""
    if getattr(dst, "_unshared", False):
        return
    for name, p in src._parameters.items():
        q = dst._parameters.get(name)
        if p is None or q is None or getattr(q, "_unshared", False):
            continue
        if p.shape != q.shape:
            raise ConfigError(f"weight-shared layers differ in the shape of {name!r}: {tuple(p.shape)} vs "
                              f"{tuple(q.shape)}")
        yield dst, name, p
    for name, m in src._modules.items():
        if m is not None and dst._modules.get(name) is not None:
            yield from _shared_slots(m, dst._modules[name])


def tie_parameters(src: nn.Module, dst: nn.Module):
    """Make `dst`'s parameters `src`'s (see _shared_slots for what is not shared)."""
    for mod, name, p in list(_shared_slots(src, dst)):
        mod._parameters[name] = p


@contextmanager
def _untied(src: nn.Module, dst: nn.Module):
    """`dst` with scratch tensors in place of those it shares with `src` (so that initialising `dst` draws its own
    parts only), tied again on exit."""
    slots = list(_shared_slots(src, dst))
    for mod, name, p in slots:
        mod._parameters[name] = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        for mod, name, p in slots:
            mod._parameters[name] = p


def fold_feeds(blocks: list) -> list:
    """A block marked `feeds_next` (Zamba2's shared transformer `Z`) adds its output to the input of the next
    block's branch instead of to the residual stream: the pair becomes one `Fed` block (layers/residual.py). The
    layout check of `Z` (models/mixers_zamba.py) guarantees a plain letter follows."""
    out, i = [], 0
    while i < len(blocks):
        if getattr(blocks[i], "feeds_next", False):
            out.append(Fed(blocks[i], blocks[i + 1]))
            i += 2
        else:
            out.append(blocks[i])
            i += 1
    return out


class CausalLM(nn.Module):
    """A causal language model assembled from `config.layout`.

    forward(input_ids [B, T], attention_mask [B, T] | None, cache | None, labels [B, T] | None)
    -> CausalLMOutput. Labels are aligned with input_ids (shifted inside); -100 is ignored. With labels the LM
    head and the loss run fused in token chunks (`ops.loss.linear_cross_entropy`: no [B·T, vocab] float32
    logits, their exp or their gradient) and `logits` is None, unless `return_logits=True`.
    """

    def __init__(self, config: ModelConfig):
        super().__init__()
        config.validate()
        self.config = config
        device = torch.empty(0).device     # where the caller builds: `with torch.device("meta")` skips the init
        with torch.device("meta"):         # no allocation and no init work (nn.Linear's own) until the end
            self._build(config)
        if device.type != "meta":
            self.to_empty(device=device)
            self.init_weights()

    def _build(self, config: ModelConfig):
        items = parse_layout(config.layout, LETTERS.keys())
        self.embed = nn.Embedding(config.vocab_size, config.d_model)
        self.embed_norm = make_norm(config.norm, config.d_model, config.norm_eps) if config.embed_norm else None
        self.pos_embed = nn.Embedding(config.max_seq_len, config.d_model) if config.pos_embedding == "learned" \
            else None
        self.drop = nn.Dropout(config.dropout) if config.dropout else nn.Identity()
        blocks, idx = [], 0
        for it in items:
            if isinstance(it, (Hop, Parallel)):
                kind = "hop" if isinstance(it, Hop) else "parallel"
                if kind not in BLOCKS:
                    raise ConfigError(f"{kind} blocks are not available in this build")
                blocks.append(BLOCKS[kind](config, it, idx))
                idx += len(it)
            else:
                blocks.append(BLOCKS["letter"](config, it, idx))
                idx += 1
        # `X@k`: occurrences after the first take its parameters (distinct modules, tied tensors; see tie_weights)
        self._shared = [[blocks[i] for i in pos] for pos in shared_groups(items).values() if len(pos) > 1]
        blocks = fold_feeds(blocks)
        self.hc_head = None
        if config.hyper_connections:  # n residual streams around every block (layers/hyper_connections.py)
            from ..layers.hyper_connections import hyper_connect
            blocks, self.hc_head = hyper_connect(blocks, config.hyper_connections, config.d_model,
                                                 manifold=config.hc_manifold, dynamic=config.hc_dynamic,
                                                 sinkhorn_iters=config.hc_sinkhorn_iters, init_std=config.init_std)
        self.blocks = nn.ModuleList(blocks)
        self.num_layers = idx                 # letters = residual branches = cache slots
        self.norm = make_norm(config.norm, config.d_model, config.norm_eps)
        self.lm_head = nn.Linear(config.d_model, config.vocab_size, bias=False)
        self.gradient_checkpointing = False
        self.tie_weights()
        self._register_load_state_dict_pre_hook(old_conv_names)   # checkpoints from before layers/short_conv.py

    def tie_weights(self):
        """Tie the LM head to the embedding (tie_embeddings) and every weight-shared occurrence (`X@k`) to the first.
        Called after building and again after `load_state_dict(assign=True)` or `to_empty`, which make one Parameter
        per name."""
        if self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear):   # (a quantized head keeps its own)
            self.lm_head.weight = self.embed.weight
        for first, *others in self._shared:
            for other in others:
                tie_parameters(first, other)

    # ------------------------------------------------------------------------------------------------
    @torch.no_grad()
    def init_weights(self, part=None):
        """GPT-2/Mamba-style init, in place, of a model built on the meta device and moved with `to_empty` (the
        constructor does this for a model built anywhere else): N(0, init_std) embeddings and projections, zero
        biases, norms 1, projections that write to the residual stream N(0, init_std / sqrt(number of residual
        branches)), and every mixer's own rules (A_log, dt_bias, D, conv, gates: each module's `init_weights`).
        A tied LM head and the tensors `X@k` occurrences share are drawn once, by their first owner.

        `part(module)`, if given, is a context entered around the init of each top-level part (embeddings, each
        block, final norm, LM head): FSDP2 makes one part's parameters whole in it (train/parallel.py)."""
        part = part or (lambda m: nullcontext())
        self.tie_weights()
        std = self.config.init_std
        out_std = std / math.sqrt(max(1, self.num_layers))
        later = {id(other): first for first, *others in self._shared for other in others}
        for m in (self.embed, self.pos_embed, self.embed_norm):
            if m is not None:
                with part(m):
                    normal_(std, m) if isinstance(m, nn.Embedding) else reset_(m)
        for blk in self.blocks:
            with part(blk):
                with self._later_occurrences(blk, later):
                    blk.init_weights(std, out_std)
        with part(self.norm):
            reset_(self.norm)
        if not self.config.tie_embeddings:
            with part(self.lm_head):
                normal_(std, self.lm_head)
        if self.hc_head is not None:
            with part(self.hc_head):
                self.hc_head.init_weights(std, out_std)

    @contextmanager
    def _later_occurrences(self, blk: nn.Module, later: dict):
        """Every later `X@k` occurrence inside `blk` untied from its first (see _untied) while `blk` is initialised."""
        with ExitStack() as stack:
            for m in blk.modules():
                if id(m) in later:
                    stack.enter_context(_untied(later[id(m)], m))
            yield

    def reset_parameters(self):
        """nn.Module's name for `init_weights`."""
        self.init_weights()

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.embed.weight.numel() + (self.pos_embed.weight.numel() if self.pos_embed is not None else 0)
            if not self.config.tie_embeddings and isinstance(self.lm_head, nn.Linear):
                n -= self.lm_head.weight.numel()
        return n

    def make_cache(self, batch_size: int, max_tokens: int | None = None) -> InferenceCache:
        """An empty cache; `max_tokens` (prompt + new tokens) lets K/V buffers be allocated once at that size."""
        return InferenceCache(batch_size, self.num_layers, device=self.embed.weight.device, max_tokens=max_tokens)

    # ------------------------------------------------------------------------------------------------
    def _check_input(self, input_ids: Tensor, attention_mask: Tensor | None, cache: InferenceCache | None):
        """One clear error for bad input, before anything runs (two host syncs: min/max token id)."""
        B, T = input_ids.shape
        cfg = self.config
        if input_ids.dtype not in (torch.long, torch.int32, torch.int64):
            raise InputError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if T == 0:
            raise InputError("input_ids is empty")
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= cfg.vocab_size:
            bad = hi if hi >= cfg.vocab_size else lo
            raise InputError(f"token id {bad} is out of range for vocab_size {cfg.vocab_size}")
        seen = cache.seen if cache is not None else 0
        if seen + T > cfg.max_seq_len:
            raise InputError(f"sequence length {seen + T} exceeds the model's max_seq_len {cfg.max_seq_len}")
        if cache is not None and cache.batch_size != B:
            raise InputError(f"cache was made for batch {cache.batch_size}, got batch {B}")
        if attention_mask is not None and attention_mask.shape != input_ids.shape:
            raise InputError(f"attention_mask shape {tuple(attention_mask.shape)} != input_ids shape "
                             f"{tuple(input_ids.shape)}")

    def _context(self, input_ids: Tensor, attention_mask: Tensor | None, cache: InferenceCache | None,
                 resets: Tensor | None) -> SeqContext:
        """Positions and masks of this call; advances the cache's bookkeeping (seen, next_pos, key_mask)."""
        B, T = input_ids.shape
        dev = input_ids.device
        pad = None
        if attention_mask is not None:
            am = attention_mask.bool()
            pad = None if bool(am.all()) else am
        start = cache.next_pos if cache is not None else torch.zeros(B, dtype=torch.long, device=dev)
        if cache is not None and cache.lengths is not None:
            return self._ragged_context(input_ids, pad, cache, resets)
        if pad is None:
            positions = start[:, None] + torch.arange(T, device=dev)
        else:  # left padding: real tokens count positions from 0
            positions = start[:, None] + (pad.long().cumsum(1) - 1).clamp(min=0)
        key_mask = pad
        if cache is not None:
            if cache.key_mask is not None or pad is not None:
                prev = cache.key_mask if cache.key_mask is not None else \
                    torch.ones(B, cache.seen, dtype=torch.bool, device=dev)
                cur = pad if pad is not None else torch.ones(B, T, dtype=torch.bool, device=dev)
                key_mask = torch.cat((prev, cur), 1)
                cache.key_mask = key_mask
            cache.next_pos = start + (pad.sum(1) if pad is not None else T)
            cache.seen += T
        seg = None
        if resets is not None:
            if cache is not None and cache.segments is None:
                raise InputError("resets (packed documents) are for training/scoring, not with a cache")
            resets = resets.bool()
            ids = resets.long().cumsum(1)
            # positions restart at every document start; before the first one they go on from the cache's
            idx = torch.arange(T, device=dev).expand(B, T)
            starts = torch.where(resets, idx, torch.full_like(idx, -1)).cummax(1).values
            positions = torch.where(starts >= 0, idx - starts, start[:, None] + idx)
            seg = (ids, ids)
            if cache is not None:     # the tokens before this call hold documents 0..last: the first one goes on
                prev = cache.segments
                ids = ids + (prev[:, -1:] if prev.shape[1] else 0)
                seg = (ids, torch.cat((prev, ids), 1))
                cache.segments, cache.next_pos = seg[1], positions[:, -1] + 1
        return SeqContext(positions=positions, pad_mask=pad, key_mask=key_mask, resets=resets, segment_ids=seg)

    @staticmethod
    def _ragged_context(input_ids: Tensor, pad: Tensor | None, cache: InferenceCache, resets) -> SeqContext:
        """A call on a cache whose rows hold their own lengths (the serving batch): row b's T new tokens are its
        tokens lengths[b] .. lengths[b] + T - 1 at positions next_pos[b] + t, and its query t sees its first
        lengths[b] + t + 1 keys of the S = seen + T columns ([B, S] for one query, [B, T, S] for several)."""
        if pad is not None or resets is not None:
            raise InputError("a cache whose rows hold their own lengths takes no padding or resets")
        T, dev = input_ids.shape[1], input_ids.device
        before, t = cache.lengths, torch.arange(T, device=dev)
        cols = torch.arange(cache.seen + T, device=dev)
        if T == 1:
            key_mask = cols < before[:, None] + 1
        else:
            key_mask = cols <= (before[:, None] + t)[:, :, None]
        positions = cache.next_pos[:, None] + t
        cache.next_pos = cache.next_pos + T
        cache.lengths = before + T
        cache.seen += T
        return SeqContext(positions=positions, key_mask=key_mask, lengths=before)

    def _hidden(self, input_ids: Tensor, ctx: SeqContext, cache: InferenceCache | None) -> Tensor:
        """Embedding -> blocks -> final norm: the last hidden states [B, T, d]."""
        x = self.embed(input_ids)
        if self.config.embed_scale != 1.0:
            x = x * self.config.embed_scale
        if self.embed_norm is not None:
            x = self.embed_norm(x)
        if self.pos_embed is not None:
            x = x + self.pos_embed(ctx.positions)
        x = self.drop(x)
        ctx.embeddings = x                        # what Zamba2's shared blocks concatenate to their input
        # a CPU decode step: the blocks hand each mixer to its whole C++ step (layers/cpu_steps.py), decided once here
        ctx.cpu_steps = ctx.cache_pos is None and cpu_steps.serves(x, cache)
        if self.hc_head is not None:
            x = self.hc_head.expand(x)            # [B, T, n, d]: n residual streams
        for blk in self.blocks:
            if self.gradient_checkpointing and self.training and cache is None:
                x = checkpoint(blk, x, ctx, None, use_reentrant=False)
            else:
                x = blk(x, ctx, cache)
        if self.hc_head is not None:
            x = self.hc_head(x)                   # collapse the streams before the final norm
        return self.norm(x)

    def hidden_states(self, input_ids: Tensor, attention_mask: Tensor | None = None) -> Tensor:
        """input_ids [B, T] -> the final-norm hidden states [B, T, d] the LM head reads (score a few positions
        without [B, T, vocab] logits)."""
        self._check_input(input_ids, attention_mask, None)
        return self._hidden(input_ids, self._context(input_ids, attention_mask, None, None), None)

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None = None, cache: InferenceCache | None = None,
                labels: Tensor | None = None, *, resets: Tensor | None = None,
                logits_to_keep: int | None = None, aux_loss_weight: float = 0.01,
                return_logits: bool | None = None, shift_labels: Tensor | None = None) -> CausalLMOutput:
        self._check_input(input_ids, attention_mask, cache)
        if shift_labels is not None:    # targets already aligned with positions (a chunk whose last target is not in
            labels = shift_labels       # input_ids: context parallelism), transformers' name
        x = self._hidden(input_ids, self._context(input_ids, attention_mask, cache, resets), cache)
        if logits_to_keep:
            x = x[:, -logits_to_keep:]
        if return_logits is None:   # the fused head + loss needs the head's float matrix (not a quantized one's)
            return_logits = labels is None or not isinstance(self.lm_head, nn.Linear)
        logits = self.lm_head(x) if return_logits else None
        # auxiliary losses matter to training and scoring; a plain inference call skips the module walk
        aux = self._aux_loss() if self.training or labels is not None else None
        loss = None
        if labels is not None:
            # shift the labels, not the logits: slicing [B, T, V] logits would copy them (and their gradient)
            shifted = (shift_labels if shift_labels is not None else F.pad(labels[:, 1:], (0, 1), value=-100)).flatten()
            if logits is not None:
                loss = cross_entropy(logits.flatten(0, 1).float(), shifted, ignore_index=-100)
            else:
                loss = linear_cross_entropy(x.flatten(0, 1), self.lm_head.weight, shifted, ignore_index=-100)
            if aux is not None and aux_loss_weight:
                loss = loss + aux_loss_weight * aux
        kl = self._indexer_kl() if self.training else None
        if loss is not None and kl is not None:
            loss = loss + self.config.dsa_kl_weight * kl
        return CausalLMOutput(logits=logits, loss=loss, cache=cache, aux_loss=aux, indexer_kl=kl)

    def decode_step(self, ids: Tensor, cache: InferenceCache) -> Tensor:
        """One generated token per row, ids [B, 1] -> next-token logits [B, V]. No input checks (the ids come
        from our own sampler and `stream` checked the length up front) and no host syncs, so that
        `torch.compile` sees one graph. Generated tokens are real: a padded prompt's key mask just grows."""
        return self.lm_head(self._hidden(ids, self._context(ids, None, cache, None), cache)[:, -1])

    def check_step(self, ids: Tensor, cache: InferenceCache) -> Tensor:
        """`decode_step` for T tokens per row, ids [B, T] -> logits [B, T, V] at every position (speculative
        decoding checks T - 1 drafts at once: models/speculative.py). No input checks, as decode_step."""
        return self.lm_head(self._hidden(ids, self._context(ids, None, cache, None), cache))

    def compiled_decode_step(self):
        """`decode_step` under torch.compile (dynamic shapes: the cache grows every step). The first calls
        compile (seconds to tens of seconds on a CPU); later ones run the fused graph. One compiled function is
        shared by all models (a module global, so models stay picklable and collectable); dynamo keeps a graph
        per model structure."""
        if self.embed.weight.device.type == "cpu" and cxx_compiler() is None:
            raise ConfigError("compile=True needs a C++ compiler on a CPU (torch.compile generates C++ kernels): "
                              "install g++ or clang++, or decode without compiling")
        if "decode" not in _COMPILED:
            _COMPILED["decode"] = torch.compile(CausalLM.decode_step, dynamic=True)
        return partial(_COMPILED["decode"], self)

    def _static_decode_step(self, ids: Tensor, cache: InferenceCache) -> Tensor:
        """`decode_step` with fixed shapes and buffer addresses (after `cache.make_static()`): the token is written
        at slot `cache.static_pos` of the preallocated buffers, attention reads all max_tokens slots with the
        static key mask hiding the unwritten tail, and the position, slot and mask advance in place. Host-side
        counters are left to `cache.advance()`, so the graph is the same at every step. ids [B, 1] -> [B, V]."""
        pos = cache.static_pos
        cache.static_mask.index_fill_(1, pos, True)     # generated tokens are real
        ctx = SeqContext(positions=cache.next_pos[:, None].clone(), key_mask=cache.static_mask, cache_pos=pos)
        logits = self.lm_head(self._hidden(ids, ctx, cache)[:, -1])
        cache.next_pos.add_(1)
        pos.add_(1)
        return logits

    def static_decode_step(self, compile: bool = False, graph: bool = False):
        """A decode function step(ids [B, 1], cache) -> logits [B, V] over fixed shapes (`_static_decode_step`).
        `compile`: torch.compile it, with CUDA graphs (mode "reduce-overhead") on CUDA. `graph` (CUDA): capture the
        eager step once as a CUDA graph (`_graphed`) and replay it: one launch per token, no compile time. The first
        call switches the cache to static decoding (`InferenceCache.make_static`)."""
        fn = partial(CausalLM._static_decode_step, self)
        cuda = self.embed.weight.device.type == "cuda"
        if graph and (not cuda or compile):
            raise ConfigError("graph=True captures the eager step as a CUDA graph: the model must be on a CUDA "
                              "device, and compile=True (which makes its own CUDA graphs) must be off")
        if compile:
            if not cuda and cxx_compiler() is None:
                raise ConfigError("compile=True needs a C++ compiler on a CPU (torch.compile generates C++ "
                                  "kernels): install g++ or clang++, or decode without compiling")
            key = "static_cuda" if cuda else "static"
            if key not in _COMPILED:
                _COMPILED[key] = torch.compile(CausalLM._static_decode_step, dynamic=False,
                                               mode="reduce-overhead" if cuda else None)
            fn = partial(_COMPILED[key], self)
        captured = [None, None]     # (cache, replay): one captured cache at a time, held so it cannot be freed

        def step(ids: Tensor, cache: InferenceCache) -> Tensor:
            if cache.static_pos is None:
                cache.make_static()
            if cache.seen >= cache.max_tokens:
                raise InputError(f"the cache is full: max_tokens {cache.max_tokens}")
            if graph:
                if captured[0] is not cache:     # a graph replays on its cache's buffers: capture anew per cache
                    captured[:] = cache, self._graphed(fn, ids, cache)
                logits = captured[1](ids)
            else:
                logits = fn(ids, cache)
            cache.advance()
            # a CUDA graph's output buffer is overwritten by its next replay
            return logits.clone() if (compile or graph) and cuda else logits
        return step

    @staticmethod
    def _graphed(fn, ids: Tensor, cache: InferenceCache):
        """fn(ids, cache) captured as a CUDA graph over a static ids buffer -> replay(ids) -> logits buffer.
        Capture needs warm-up runs on a side stream, which write into the cache: its static tensors are saved
        before and restored after, so capturing leaves the cache as it found it."""
        saved = [t.clone() for t in cache.static_tensors()]
        ids_buf = ids.clone()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.inference_mode():
            for _ in range(2):
                fn(ids_buf, cache)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g), torch.inference_mode():
            out = fn(ids_buf, cache)
        with torch.inference_mode():
            for t, v in zip(cache.static_tensors(), saved):
                t.copy_(v)

        def replay(x: Tensor) -> Tensor:
            ids_buf.copy_(x)
            g.replay()
            return out
        return replay

    def _aux_loss(self) -> Tensor | None:
        """Sum of auxiliary losses that mixers left in `.aux_loss` during this forward."""
        total = None
        for m in self.modules():
            a = m.__dict__.get("aux_loss")
            if isinstance(a, Tensor):
                total = a if total is None else total + a
        return total

    def _indexer_kl(self) -> Tensor | None:
        """Mean of the KL losses the lightning indexers left in `.indexer_kl` during this forward."""
        kls = [m.__dict__["indexer_kl"] for m in self.modules()
               if isinstance(m.__dict__.get("indexer_kl"), Tensor)]
        return torch.stack(kls).mean() if kls else None

    # ------------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def stream(self, input_ids: Tensor, max_new_tokens: int, *, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, attention_mask: Tensor | None = None, eos_token_id: int | None = None,
               generator: torch.Generator | None = None, compile: bool = False, static: bool | None = None,
               json_schema=None, regex: str | None = None, grammar: str | None = None, tokenizer=None,
               speculative=None):
        """Yield the next token ids [B] one step at a time (prefill once, then one-token decode). The cache is
        sized for prompt + max_new_tokens up front, so decode never reallocates it; `compile` runs the decode
        step under torch.compile (see `compiled_decode_step`). `static` decodes with fixed shapes over the whole
        preallocated cache (`static_decode_step`); default: when compiling on CUDA, where it runs as a CUDA graph.
        On a CPU the decode steps run the project's matrix-vector kernels (`quantize.cpu_kernels_by_default_`; they
        leave training as it was; HYBRIDLM_CPU_KERNELS=0 turns them off).
        `json_schema` (a dict or its text), `regex` or `grammar` (EBNF / GBNF) constrains every row's output
        (models/structured.py; needs the `tokenizer`): a row ends at its end-of-text token once the grammar is
        complete. `speculative` ("ngram[:K]", {"model": draft CausalLM, "k": K}, see models/speculative.py): each
        step checks K drafted tokens in one forward and yields the accepted ones; the output distribution is
        unchanged (greedy: the same tokens)."""
        from .generation import sample_next
        from .quantize import cpu_kernels_by_default_
        from .structured import constraints_for, mask_logits
        cpu_kernels_by_default_(self)
        held = constraints_for(tokenizer, self.config.vocab_size, input_ids.shape[0], json_schema=json_schema,
                               regex=regex, grammar=grammar)
        if held is not None and eos_token_id is None:
            eos_token_id = tokenizer.eos_id
        if max_new_tokens < 0:
            raise InputError("max_new_tokens must be >= 0")
        if input_ids.shape[1] + max_new_tokens > self.config.max_seq_len:
            raise InputError(f"prompt ({input_ids.shape[1]}) + max_new_tokens ({max_new_tokens}) exceeds "
                             f"max_seq_len {self.config.max_seq_len}")
        if speculative is not None:
            if held is not None:
                raise ConfigError("speculative decoding does not combine with json_schema / regex / grammar yet")
            yield from self._stream_speculative(input_ids, max_new_tokens, speculative, temperature=temperature,
                                                top_k=top_k, top_p=top_p, attention_mask=attention_mask,
                                                eos_token_id=eos_token_id, generator=generator,
                                                compiled=compile or bool(static))
            return
        cache = self.make_cache(input_ids.shape[0], max_tokens=input_ids.shape[1] + max_new_tokens)
        logits = self(input_ids, attention_mask=attention_mask, cache=cache, logits_to_keep=1).logits[:, -1]
        if static is None:   # CUDA graphs need fixed shapes; on a CPU the growing cache is faster (README)
            static = compile and input_ids.device.type == "cuda"
        if static:
            step = self.static_decode_step(compile)
        else:
            step = self.compiled_decode_step() if compile else self.decode_step
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for i in range(max_new_tokens):
            if held is not None:      # rows still running: their matchers' masks
                live = [b for b, d in enumerate(done.tolist()) if not d]
                logits = mask_logits(logits.float(), [held[b] for b in live], live)
            nxt = sample_next(logits, temperature=temperature, top_k=top_k, top_p=top_p, generator=generator)
            if held is not None:
                for c, t, d in zip(held, nxt.tolist(), done.tolist()):
                    if not d:
                        c.accept(t)
            if eos_token_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                done |= nxt == eos_token_id
            yield nxt
            if i + 1 == max_new_tokens or (eos_token_id is not None and bool(done.all())):
                return
            logits = step(nxt[:, None], cache)

    def _stream_speculative(self, input_ids, max_new_tokens, speculative, *, eos_token_id, compiled, **kw):
        """`stream` with speculative decoding (models/speculative.py): the tokens of each check, one at a time."""
        from .speculative import decode
        if compiled:
            raise ConfigError("speculative decoding runs the eager forward: it does not combine with compile or "
                              "static decoding")
        if max_new_tokens == 0:
            return
        done = torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)
        for tokens in decode(self, input_ids, max_new_tokens, speculative, **kw):
            for nxt in tokens:
                if eos_token_id is not None:
                    nxt = torch.where(done, torch.full_like(nxt, eos_token_id), nxt)
                    done |= nxt == eos_token_id
                yield nxt
                if eos_token_id is not None and bool(done.all()):
                    return

    def generate(self, input_ids: Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float | None = None, *, attention_mask: Tensor | None = None,
                 eos_token_id: int | None = None, generator: torch.Generator | None = None,
                 compile: bool = False, static: bool | None = None, json_schema=None, regex: str | None = None,
                 grammar: str | None = None, tokenizer=None, speculative=None) -> Tensor:
        """Prompt + new ids [B, T + n]. temperature 0 is greedy. json_schema / regex / grammar (with the
        `tokenizer`): constrained decoding; `speculative`: drafted tokens checked in one forward (see `stream`)."""
        new = list(self.stream(input_ids, max_new_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                               attention_mask=attention_mask, eos_token_id=eos_token_id, generator=generator,
                               compile=compile, static=static, json_schema=json_schema, regex=regex,
                               grammar=grammar, tokenizer=tokenizer, speculative=speculative))
        return torch.cat([input_ids] + [t[:, None] for t in new], dim=1) if new else input_ids
