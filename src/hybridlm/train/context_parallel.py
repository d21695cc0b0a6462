"""Context parallelism: one long sequence split across ranks, for every layer but the gated short conv (`C`) and
the routed MoE (`O`); `hybridlm train --context-parallel N` runs it (train/trainer.py).

    out = context_parallel_forward(model, ids, labels=ids)     # ids [B, T] on every rank; T % world == 0
    out.loss.backward(); all_reduce_grads(model)                # = the single-rank loss and gradients

Rank r runs positions [r·T/W, (r+1)·T/W) of every layer. A recurrent layer is a linear recurrence, so its
chunk only needs the final state (and the short-conv tail, the last K-1 conv inputs) of the chunk before:
they pass rank to rank, the state passing of the chunked SSD algorithm lifted to devices
(the Mamba-2 paper, section 8.2). Attention layers see the all-gathered keys and values of ranks
0..r, their queries being the last T/W positions (the bottom-right aligned causal mask of ops/attention.py).

The model is not changed: it runs its chunk with an `InferenceCache` whose slots, instead of holding state,
receive it from the previous rank (`.state`/`.conv` reads), send it to the next (`.state` write) and gather
keys and values (`update`), exactly where a prefill reads and writes its cache; the position offset is the
cache's `next_pos`. Every message is an autograd function whose backward sends the gradient the other way
(the gradient of a received state goes back to the rank that computed it; a gathered key's gradient is summed
over the ranks that attended to it). Messages are chained through a zero scalar "token" added to the loss,
so backward runs them in exactly the reverse order on every rank and the point-to-point and collective
calls of different ranks always match. Layers run as a wavefront: rank r starts layer l when rank r-1 has
finished it, so ranks overlap across layers rather than within one.

Packed documents (`resets`, the whole sequence's on every rank): the cache carries the document index of every
earlier token and the position reached in the document that goes on into this chunk, so positions restart and
attention stops at document starts as on one rank; a recurrent layer's received state and conv tail belong to
the chunk's first document, which a reset ends (the ops zero the decay and the conv taps there).

Layers (`check_layout`): a layer keeping a `RecurrentCache` with a state (S, R, G, K, B) relays it; one keeping
keys (A, W with or without a window, F, Z's shared attention: `KVCache`/`WindowKVCache`; L: MLA's `LatentCache`;
I: the indexer's keys and those of the attention under it) gathers them; channel mixers (M, E) need nothing.
The letters say which they refuse and why (models/registry.py `no_context_parallel`): C and O, and I while its
indexer trains (dsa_kl_weight > 0).
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..cache import InferenceCache
from ..errors import ConfigError, InputError


def check_layout(cfg):
    """A ConfigError naming the first layer letter of `cfg.layout` that context parallelism cannot run, and why
    (models/registry.py `no_context_parallel`)."""
    from ..models.registry import LETTERS, layer_configs, trait
    for letter, c in layer_configs(cfg):
        why = trait(LETTERS[letter].no_context_parallel, c)
        if why:
            raise ConfigError(f"--context-parallel does not support layer {letter!r} in layout {cfg.layout!r}: {why}")


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
_HEADER = 12        # per tensor: ndim (0 = none), dtype code, 4 sizes


def _header(tensors, device) -> Tensor:
    """Shapes and dtypes of the tensors about to be sent, on `device` (nccl sends device tensors only)."""
    h = [0] * _HEADER
    for i, t in enumerate(tensors):
        if t is not None:
            h[6 * i: 6 * i + 2 + t.dim()] = [t.dim(), _DTYPES.index(t.dtype), *t.shape]
    return torch.tensor(h, dtype=torch.long, device=device)


def _empty_from(h: Tensor, i: int, device) -> Tensor | None:
    ndim, code = int(h[6 * i]), int(h[6 * i + 1])
    return torch.empty(h[6 * i + 2: 6 * i + 2 + ndim].tolist(), dtype=_DTYPES[code], device=device) if ndim else None


class _RecvState(torch.autograd.Function):
    """token -> (token, conv tail, state) from rank `src`; backward sends their gradients back to `src`."""

    @staticmethod
    def forward(ctx, token, src, group):
        h = torch.empty(_HEADER, dtype=torch.long, device=token.device)
        dist.recv(h, group=group, group_src=src)
        h = h.cpu()
        got = [_empty_from(h, i, token.device) for i in range(2)]
        for t in got:
            if t is not None:
                dist.recv(t, group=group, group_src=src)
        ctx.src, ctx.group, ctx.present = src, group, [t is not None for t in got]
        empty = token.new_empty(0)
        return (token.detach().clone(), *(t if t is not None else empty for t in got))

    @staticmethod
    def backward(ctx, g_token, *grads):
        for present, g in zip(ctx.present, grads):
            if present:
                dist.send(g.contiguous(), group=ctx.group, group_dst=ctx.src)
        return g_token, None, None


class _SendState(torch.autograd.Function):
    """(token, conv tail, state) -> token, sending both to rank `dst`; backward receives their gradients."""

    @staticmethod
    def forward(ctx, token, conv, state, dst, group):
        sent = [conv, state]
        dist.send(_header(sent, token.device), group=group, group_dst=dst)
        for t in sent:
            if t is not None:
                dist.send(t.detach().contiguous(), group=group, group_dst=dst)
        ctx.dst, ctx.group = dst, group
        ctx.like = [(t.shape, t.dtype) if t is not None else None for t in sent]
        return token.detach().clone()

    @staticmethod
    def backward(ctx, g_token):
        grads = []
        for like in ctx.like:
            g = None
            if like is not None:
                g = torch.empty(like[0], dtype=like[1], device=g_token.device)
                dist.recv(g, group=ctx.group, group_src=ctx.dst)
            grads.append(g)
        return g_token, *grads, None, None


class _GatherKV(torch.autograd.Function):
    """(token, *xs) each [B, t, ...] -> (token, *gathered) each [B, (rank+1)·t, ...] of ranks 0..rank (keys and
    values; MLA's latents; indexer keys); backward sums each key's gradient over the ranks that read it (an
    all-reduce of the zero-padded gradients)."""

    @staticmethod
    def forward(ctx, token, rank, world, group, *xs):
        ctx.rank, ctx.world, ctx.group, ctx.t = rank, world, group, xs[0].shape[1]
        out = []
        for x in xs:
            parts = [torch.empty_like(x) for _ in range(world)]
            dist.all_gather(parts, x.contiguous(), group=group)
            out.append(torch.cat(parts[: rank + 1], 1))
        return (token.detach().clone(), *out)

    @staticmethod
    def backward(ctx, g_token, *gs):
        t, r = ctx.t, ctx.rank
        mine = []
        for g in gs:
            full = g.new_zeros(g.shape[0], ctx.world * t, *g.shape[2:])
            full[:, : (r + 1) * t] = g
            dist.all_reduce(full, group=ctx.group)
            mine.append(full[:, r * t: (r + 1) * t])
        return g_token, None, None, None, *mine


class _Relay:
    """A recurrent layer's slot: reading `conv`/`state` receives them from the previous rank (once), writing
    `state` sends the conv tail written before it and the state to the next rank."""

    def __init__(self, cp: "ContextParallelCache"):
        self.cp, self._received, self._conv, self._state, self._tail = cp, False, None, None, None

    def _receive(self):
        if not self._received:
            self._received = True
            self._conv, self._state = self.cp.recv()

    @property
    def conv(self):
        self._receive()
        return self._conv

    @conv.setter
    def conv(self, tail):
        self._tail = tail

    @property
    def state(self):
        self._receive()
        return self._state

    @state.setter
    def state(self, final):
        self.cp.send(self._tail, final)

    nbytes = 0


class _Gather:
    """An attention layer's slot: `update` returns the keys/values of this rank's chunk and every earlier one."""

    def __init__(self, cp: "ContextParallelCache"):
        self.cp = cp

    def update(self, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        return self.cp.gather(k, v)

    nbytes = 0


class _GatherLatent(_Gather):
    """An MLA layer's slot (as `LatentCache.update`): [latent | roped key] of this chunk and every earlier one."""

    def update(self, latent: Tensor, k_rope: Tensor, at=None, n: int = 0) -> Tensor:
        return self.cp.gather(torch.cat((latent, k_rope), -1))[0]


class _GatherIndexer(_Gather):
    """A lightning-indexer layer's slot (as `IndexerCache`): its keys gathered, and the slot of the attention it
    masks (`layer`), itself gathering."""

    main = None

    def layer(self, idx: int, factory):
        if self.main is None:
            self.main = self.cp.slot_for(factory(), idx)
        return self.main

    def update_keys(self, k: Tensor, at=None, n: int = 0) -> Tensor:
        return self.cp.gather(k)[0]


_SLOTS = {"carry": _Relay, "keys": _Gather, "latent": _GatherLatent, "indexer": _GatherIndexer}   # by chunk_join


class ContextParallelCache(InferenceCache):
    """The cache a rank's chunk runs with: slots that talk to the neighbouring ranks, positions from `offset`."""

    def __init__(self, batch_size: int, num_layers: int, *, offset: int, device, group=None):
        super().__init__(batch_size, num_layers, device=device)
        self.group = group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.next_pos += offset
        # the message chain; requires grad so that backward reaches every message's backward
        self.token = torch.zeros((), device=device, requires_grad=torch.is_grad_enabled())

    def layer(self, idx: int, factory):
        if self.layers[idx] is None:
            self.layers[idx] = self.slot_for(factory(), idx)
        return self.layers[idx]

    def slot_for(self, kind, idx: int):
        """The slot standing in for a cache like `kind`, by how its chunks join (its `chunk_join`)."""
        slot = _SLOTS.get(getattr(kind, "chunk_join", None))
        if slot is None:
            raise ConfigError(f"context parallelism does not support layer {idx} ({type(kind).__name__} state)")
        return slot(self)

    def recv(self) -> tuple[Tensor | None, Tensor | None]:
        if self.rank == 0:
            return None, None
        self.token, conv, state = _RecvState.apply(self.token, self.rank - 1, self.group)
        return (conv if conv.numel() else None), (state if state.numel() else None)

    def send(self, conv: Tensor | None, state: Tensor):
        if self.rank < self.world - 1:
            self.token = _SendState.apply(self.token, conv, state, self.rank + 1, self.group)

    def gather(self, *xs: Tensor) -> tuple[Tensor, ...]:
        self.token, *out = _GatherKV.apply(self.token, self.rank, self.world, self.group, *xs)
        return tuple(out)


@dataclass
class ContextParallelOutput:
    logits: Tensor | None     # [B, T/W, V]: this rank's positions (None when the loss was fused with the head)
    loss: Tensor | None       # this rank's share: the sum over ranks is the mean next-token loss of the sequence
    start: int                # first position of this rank's chunk


def context_parallel_forward(model: nn.Module, input_ids: Tensor, labels: Tensor | None = None, *,
                             resets: Tensor | None = None, group=None,
                             return_logits: bool | None = None) -> ContextParallelOutput:
    """Run `model` on this rank's chunk of input_ids [B, T] (the same full sequence on every rank of `group`).
    labels [B, T] are aligned with input_ids as in `CausalLM.forward` (-100 ignored); resets [B, T] bool mark
    document starts (packed documents), as in `CausalLM.forward`. With labels the loss is fused with the LM head
    (no [B, T/W, vocab] logits) unless return_logits."""
    check_layout(model.config)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    B, T = input_ids.shape
    if T % world or T // world < 2:
        raise InputError(f"context parallelism needs a sequence length divisible by the {world} ranks with at "
                         f"least 2 tokens each, got {T}")
    if T > model.config.max_seq_len:
        raise InputError(f"sequence length {T} exceeds the model's max_seq_len {model.config.max_seq_len}")
    t = T // world
    start = rank * t
    cache = ContextParallelCache(B, model.num_layers, offset=start, device=input_ids.device, group=group)
    chunk_resets = None
    if resets is not None:
        resets = resets.bool()
        idx = torch.arange(T, device=resets.device).expand(B, T)
        pos = idx - torch.where(resets, idx, torch.zeros_like(idx)).cummax(1).values   # position in its document
        cache.segments = resets.long().cumsum(1)[:, :start]
        cache.next_pos = pos[:, start - 1] + 1 if start else torch.zeros_like(cache.next_pos)
        chunk_resets = resets[:, start: start + t]
    target = None
    if labels is not None:  # position i predicts labels[i + 1]; the chunk's last predicts the next chunk's first
        target = torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100)[:, start: start + t]
    out = model(input_ids[:, start: start + t], cache=cache, resets=chunk_resets, shift_labels=target,
                return_logits=return_logits, aux_loss_weight=0.0)
    logits, loss = out.logits, None
    if labels is not None:
        n_local, n_all = (target != -100).sum(), (labels[:, 1:] != -100).sum().clamp(min=1)
        loss = out.loss * (n_local / n_all) + cache.token     # zero token: ties the message chain into backward
    elif cache.token.requires_grad:
        logits = logits + cache.token
    return ContextParallelOutput(logits=logits, loss=loss, start=start)


def all_reduce_grads(model: nn.Module, group=None):
    """Sum parameter gradients over the ranks of a context-parallel group (each rank's loss is a share). A parameter
    this rank's chunk did not reach gets a zero gradient first, so every rank reduces the same tensors in order."""
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, group=group)
