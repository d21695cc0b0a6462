"""`hybridlm bench --suite parallel`: training tokens/s and peak memory per rank under DDP or FSDP2
(train/parallel.py), on random tokens.

    OMP_NUM_THREADS=1 hybridlm bench --suite parallel                              # one process
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m hybridlm.bench.parallel --parallel fsdp
    OMP_NUM_THREADS=1 torchrun --nproc_per_node 2 -m hybridlm.bench.parallel --context-parallel --batch 1 --seq-len 16384

`--batch` is the global batch (split over the ranks), so every run does the same work per step; with
`--context-parallel` every rank reads the whole batch and runs its 1/world of each sequence (train/context_parallel.py),
so the peak per rank at a sequence length, against one process's, is what bounds the longest trainable sequence.
Rank 0 prints one JSON line and writes it (--out, default runs/bench/parallel.json): median tokens/s over the timed steps (measure.clock), and per rank (measure.peak_memory) the
process's peak resident memory (CPU) or peak allocated CUDA memory, the peak of the training steps alone (after
the model was built and sharded), and the peak before the model was built.
"""
import json
import sys

import torch
import torch.distributed as dist

from . import measure as ms


def parallel_suite(s: dict, log=print) -> dict | None:
    """The bench suite (settings: registry.py). -> the result on rank 0 (also logged as one JSON line), None on the
    other ranks."""
    from types import SimpleNamespace
    args = SimpleNamespace(**s)
    from ..models import CausalLM, presets
    from ..optim import make_optimizer
    from ..train.context_parallel import all_reduce_grads, context_parallel_forward
    from ..train.parallel import parallelize
    from ..train.trainer import setup_distributed
    from ..runtime import allocator_in_force, allocator_policy, set_allocator
    set_allocator(allocator_policy(args.parallel))      # the allocator `hybridlm train` runs with
    rank, world, device, _ = setup_distributed("auto")
    cp = args.context_parallel and world > 1
    if args.batch % world and not cp:
        from ..errors import ConfigError
        raise ConfigError(f"--batch {args.batch} must be divisible by the {world} ranks")
    before = ms.peak_memory(lambda: None, device)["process_peak_bytes"] / 2 ** 20
    torch.manual_seed(0)
    cfg = presets.get(args.preset, n_layers=args.n_layers, d_model=args.d_model, vocab_size=args.vocab_size,
                      max_seq_len=max(args.seq_len, 2048))
    with torch.device("meta"):      # allocated and initialised by parallelize (under FSDP2: shards only)
        model = CausalLM(cfg)
    par = parallelize(model, args.parallel, world=1 if cp else world, device=device, dtype=args.dtype,
                      compile=args.compile, checkpointing=args.grad_checkpointing)
    opt = make_optimizer(model, 1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16,
                              enabled=args.dtype == "bfloat16" and not par.mixed_precision)
    g = torch.Generator().manual_seed(0 if cp else rank)      # context parallel: one batch on every rank

    def batch():                    # untimed: the batch, and every rank at the start line
        ids = torch.randint(0, cfg.vocab_size, (args.batch if cp else args.batch // world, args.seq_len),
                            generator=g).to(device)
        if world > 1:
            dist.barrier()
        return ids

    def step(ids):
        with autocast:
            loss = (context_parallel_forward(model, ids, labels=ids) if cp else par.module(ids, labels=ids)).loss
        loss.backward()
        if cp:
            all_reduce_grads(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if world > 1:
            dist.barrier()
    times = {}
    mem = ms.peak_memory(lambda: times.update(ms.clock({"step": (batch, step)}, args.steps, args.warmup_steps)),
                         device)             # the training peak: from here on
    mine = (before, mem["process_peak_bytes"] / 2 ** 20, (mem["before_bytes"] + mem["peak_bytes"]) / 2 ** 20)
    times = times["step"]
    peaks = [mine]
    if world > 1:
        peaks = [None] * world
        dist.all_gather_object(peaks, mine)
        dist.destroy_process_group()
    if rank != 0:
        return None
    res = {"preset": args.preset, "d_model": args.d_model, "n_layers": args.n_layers,
                          "params": model.num_parameters(), "world": world,
                          "parallel": "context" if cp else par.mode,
                          "allocator": allocator_in_force(), "compile": args.compile, "dtype": args.dtype, "batch": args.batch, "seq_len": args.seq_len,
                          "tokens_per_s": round(args.batch * args.seq_len / ms.median(times)),
                          "step_s": [round(t, 3) for t in times],
                          "peak_mb_per_rank": [round(b) for _, b, _ in peaks],
                          "train_peak_mb_per_rank": [c and round(c) for _, _, c in peaks],
                          "before_model_mb_per_rank": [round(a) for a, _, _ in peaks]}
    log(json.dumps(res))
    return res


def main(argv: list[str] | None = None) -> int:
    """`python -m hybridlm.bench.parallel` (and under torchrun): `hybridlm bench --suite parallel`."""
    from .registry import main as suite_main
    return suite_main("parallel", argv)


if __name__ == "__main__":
    sys.exit(main())
