"""Multi-query associative recall (MQAR) data, as zoology generates it, and the papers' harder variant.

An example of length T holds `num_pairs` key-value pairs, then each key once more as a query; the model must
emit the key's value right after the query. Keys come from the lower half of the vocabulary (token 0 excluded:
it is the placeholder), values from the upper half, both drawn without replacement, so no key repeats within an
example except as its own query. Queries sit in the query section at two-token slots drawn without replacement
with probability ∝ a·j^(a-1) (power law, a = 0.01: short gaps are likely; zoology's generator).

  zoology (hard=False): pairs packed at the start (2·P tokens), every other position is the placeholder 0.
  hard (hard=True, the Wonderful Matrices paper C.1 / the Mamba-2 paper D.1): the first half of the
    sequence holds the pairs at random two-token slots in their order, and every position that is not a key,
    value or query is a random token (never one of the example's keys); the papers use T/4 pairs.

Labels follow `CausalLM`'s convention (it shifts them): labels[b, t] is the token expected at position t, so
the answer sits one position after its query and is predicted from the query's logits; -100 elsewhere.
"""
import math

import torch
from torch import Tensor

from ..errors import InputError

IGNORE = -100


def pairs_divisor(hard: bool) -> int:
    """Key-value pairs are T / this: zoology's (64, 4), (128, 8), (256, 16) -> 16; the papers' harder task -> 4."""
    return 4 if hard else 16


def default_pairs(seq_len: int, hard: bool, divisor: int | None = None) -> int:
    """The key-value pairs of an example of `seq_len` tokens: T / `divisor` (default `pairs_divisor(hard)`)."""
    return max(1, seq_len // (divisor or pairs_divisor(hard)))


def check_sizes(seq_len: int, num_pairs: int, vocab_size: int):
    """One clear error for sizes no example can have (also used by the sweep before it trains anything)."""
    if num_pairs < 1:
        raise InputError(f"MQAR needs at least 1 key-value pair, got {num_pairs}")
    if seq_len < 4 * num_pairs:
        raise InputError(f"MQAR sequence length {seq_len} is too short for {num_pairs} key-value pairs: "
                         f"pairs and queries need 4 tokens each (seq_len >= {4 * num_pairs})")
    if vocab_size // 2 - 1 < num_pairs:
        raise InputError(f"MQAR vocab_size {vocab_size} is too small for {num_pairs} distinct keys and values "
                         f"(needs vocab_size >= {2 * num_pairs + 2})")


def _choose(scores: Tensor, k: int) -> Tensor:
    """k distinct column indices per row, in the random order of their scores (ties impossible in practice)."""
    return scores.topk(k, dim=-1).indices


def _slots_in_order(n: int, num_slots: int, k: int, g: torch.Generator) -> Tensor:
    """[n, k] distinct sorted slot indices in [0, num_slots), uniformly chosen."""
    return _choose(torch.rand(n, num_slots, generator=g), k).sort(-1).values


def _filler(keys: Tensor, shape: tuple, vocab_size: int, g: torch.Generator) -> Tensor:
    """Uniform random tokens from the vocabulary minus each row's keys [n, P]: draw u < V - P and map it to the
    u-th token that is not a key (u + the number of sorted keys k_j with k_j - j <= u)."""
    ks = keys.sort(-1).values
    adj = ks - torch.arange(ks.shape[1])
    u = torch.randint(0, vocab_size - ks.shape[1], shape, generator=g)
    return u + torch.searchsorted(adj.contiguous(), u, right=True)


def _chunk(n: int, seq_len: int, num_pairs: int, vocab_size: int, power_a: float, hard: bool,
           g: torch.Generator) -> tuple[Tensor, Tensor]:
    P, half = num_pairs, vocab_size // 2
    rows = torch.arange(n)[:, None]
    keys = _choose(torch.rand(n, half - 1, generator=g), P) + 1             # [n, P] in [1, V/2)
    values = _choose(torch.rand(n, vocab_size - half, generator=g), P) + half  # [n, P] in [V/2, V)
    ctx = seq_len // 2 if hard else 2 * P                                    # length of the pairs' section
    pair_pos = 2 * (_slots_in_order(n, ctx // 2, P, g) if hard else torch.arange(P).expand(n, P))
    # query slots: Gumbel top-k on log p draws P slots without replacement with probability ∝ p
    n_q = (seq_len - ctx) // 2
    j = torch.arange(1, n_q + 1, dtype=torch.float64)
    logp = math.log(power_a) + (power_a - 1) * j.log()
    gumbel = -torch.empty(n, n_q, dtype=torch.float64).exponential_(generator=g).log()
    query_pos = ctx + 2 * _choose(logp + gumbel, P)                          # [n, P], key i asked at query_pos[:, i]

    inputs = _filler(keys, (n, seq_len), vocab_size, g) if hard else torch.zeros(n, seq_len, dtype=torch.long)
    inputs[rows, pair_pos] = keys
    inputs[rows, pair_pos + 1] = values
    inputs[rows, query_pos] = keys
    labels = torch.full((n, seq_len), IGNORE, dtype=torch.long)
    labels[rows, query_pos + 1] = values
    return inputs, labels


def mqar(num_examples: int, seq_len: int, num_pairs: int, vocab_size: int, *, seed: int = 0,
         power_a: float = 0.01, hard: bool = False, chunk: int = 2048) -> tuple[Tensor, Tensor]:
    """MQAR examples -> (input_ids [N, T] long, labels [N, T] long; -100 except at the answers).

    Deterministic in `seed` (and independent of the machine's global RNG); generated `chunk` rows at a time so
    the [rows, V/2] key draws stay small at vocab 8192."""
    check_sizes(seq_len, num_pairs, vocab_size)
    if num_examples < 1:
        raise InputError(f"MQAR needs num_examples >= 1, got {num_examples}")
    if not 0 < power_a <= 1:
        raise InputError(f"MQAR power_a must be in (0, 1], got {power_a}")
    g = torch.Generator().manual_seed(seed)
    parts = [_chunk(min(chunk, num_examples - i), seq_len, num_pairs, vocab_size, power_a, hard, g)
             for i in range(0, num_examples, chunk)]
    return torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])


def curriculum(num_pairs: int, stages: int = 4) -> list[int]:
    """Pair counts of a curriculum ending at `num_pairs`, halving backwards: T/4 -> (T/32, T/16, T/8, T/4)
    as in the Mamba-2 paper appendix D.1 (duplicates dropped for small counts)."""
    counts = [max(1, num_pairs >> s) for s in range(stages - 1, -1, -1)]
    return sorted(set(counts))
