"""Forward FLOPs per token of the chunked sequence ops (SSD, GLA, the gated delta rule): the work MFU counts for the
linear-time mixers beyond their projections' 2 x parameters (a Transformer's formula leaves it out, or counts
attention that is not there: flame's MFU has shown 133% on linear models, fla-org/flame #7).

Counted as the chunked algorithm's matmuls with chunks of `chunk` tokens (FLA's 64), a multiply-add as 2 FLOPs, the
in-chunk blocks causal (a query meets chunk/2 keys on average, as attention's T/2):
    in-chunk scores q·k and outputs (scores)·v    chunk·K + chunk·V   per head (scores once per group where shared)
    reading and writing the state S [K, V]         4·K·V               per head
The delta rule adds its in-chunk k·k scores, the triangular solve over [V | K] columns and the state's correction
of the writes (W = U - Kb·S): chunk·K + chunk·(V + K) + 2·K·V more per head. Training counts 3x forward.
"""
CHUNK = 64


def gla_flops(heads: int, k: int, v: int, chunk: int = CHUNK, score_heads: int | None = None) -> float:
    """Gated linear attention (and SSD): `heads` heads of key dim k and value dim v; the q·k scores computed for
    `score_heads` heads (SSD: its B/C groups; default every head)."""
    score_heads = heads if score_heads is None else score_heads
    return chunk * k * score_heads + chunk * v * heads + 4 * k * v * heads


def delta_rule_flops(heads: int, k: int, v: int, chunk: int = CHUNK) -> float:
    """The gated delta rule (Gated DeltaNet, KDA): GLA's work plus the WY transform per chunk."""
    return gla_flops(heads, k, v, chunk) + heads * (chunk * k + chunk * (v + k) + 2 * k * v)
