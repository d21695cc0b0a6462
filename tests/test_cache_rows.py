"""Each cache kind's row operations and rows at their own lengths: a batch whose rows hold different lengths (no
padding) decodes and checks several tokens per row exactly as each row's own cache does; rows taken, placed, freed,
trimmed, snapshot and restored keep that true; decode attention over per-row lengths equals the masked reference."""
import pytest
import torch

from conftest import assert_close
from hybridlm.cache import InferenceCache
from hybridlm.ops.attention import attention_ref, decode_attention
from serve_helpers import tiny_layout

LAYOUTS = ["AM WM", "SM RM", "LM IM", "FM AO AE", "ZM SM", "GM CM", "KM BM"]


def prefilled(m, n: int, g) -> InferenceCache:
    c = m.make_cache(1)
    m(torch.randint(0, 256, (1, n), generator=g), cache=c)
    return c


def step(m, ids, batch: InferenceCache, own: list[InferenceCache], msg=""):
    """ids [B, T] through the batch and through each row's own cache: the same logits."""
    got = m(ids, cache=batch).logits
    ref = torch.cat([m(ids[i:i + 1], cache=c).logits for i, c in enumerate(own)])
    assert_close(got, ref, atol=1e-5, msg=msg)


@pytest.mark.parametrize("S,lengths", [(9, [9, 1, 5, 0]), (700, [700, 3, 0, 41])])    # masked; row by row
@pytest.mark.parametrize("H,Hk,Hv", [(4, 4, 4), (4, 2, 2), (4, 1, 4)])
def test_decode_attention_over_per_row_lengths_is_the_masked_reference(H, Hk, Hv, S, lengths):
    g = torch.Generator().manual_seed(0)
    B, D = 4, 8
    q = torch.randn(B, 1, H, D, generator=g)
    k, v = torch.randn(B, S, Hk, D, generator=g), torch.randn(B, S, Hv, D, generator=g)
    lengths = torch.tensor(lengths)
    got = decode_attention(q, k, v, lengths=lengths)
    mask = torch.arange(S) < lengths[:, None]
    ref = attention_ref(q, k.repeat_interleave(Hv // Hk, 2), v, causal=False, key_mask=mask)
    assert_close(got, ref, atol=1e-5)
    assert got[lengths == 0].abs().max() == 0                         # a row with no keys gives 0
    assert_close(decode_attention(q, k, v, lengths=torch.full((B,), S)), decode_attention(q, k, v), atol=1e-6)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_rows_at_their_own_lengths_decode_and_check_like_their_own_caches(layout):
    """concat (no padding: row b at columns [0, n_b)), one-token steps past a window's size, then a three-token
    call (what speculative decoding checks), then rows taken out: each row as its own cache all along."""
    m = tiny_layout(layout)
    g = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        own = [prefilled(m, n, g) for n in (3, 11, 6, 20)]
        batch = InferenceCache.concat([(c, [0]) for c in own], cap=48)
        assert batch.lengths.tolist() == [3, 11, 6, 20] and batch.key_mask is None
        for _ in range(10):
            step(m, torch.randint(0, 256, (4, 1), generator=g), batch, own, layout)
        step(m, torch.randint(0, 256, (4, 3), generator=g), batch, own, layout)
        sub = batch.take([3, 0])
        assert sub.lengths.tolist() == [33, 16] and sub.seen == 33
        step(m, torch.randint(0, 256, (2, 1), generator=g), sub, [own[3], own[0]], layout)


@pytest.mark.parametrize("layout", ["AM WM", "SM RM", "LM IM"])
def test_a_left_padded_batch_taken_apart_and_placed_into_free_rows(layout):
    """Rows of a left-padded prefill (as `generate` and the engine's fresh prompts run) lose their padding when taken;
    placed into a freed row of a running batch at column 0, the row decodes as its own cache does."""
    m = tiny_layout(layout)
    g = torch.Generator().manual_seed(2)
    with torch.inference_mode():
        ids = torch.randint(0, 256, (2, 12), generator=g)
        mask = torch.ones(2, 12, dtype=torch.bool)
        mask[0, :9] = False                                           # row 0: 3 tokens after 9 pads
        padded = m.make_cache(2)
        m(ids, attention_mask=mask, cache=padded)
        rows = [padded.take([0], cap=40), padded.take([1], cap=40)]
        assert [r.seen for r in rows] == [3, 12] and all(r.key_mask is None for r in rows)
        alone = m.make_cache(1)
        m(ids[:1, 9:], cache=alone)
        step(m, torch.randint(0, 256, (1, 1), generator=g), rows[0], [alone], layout)
        batch = InferenceCache.concat([(prefilled(m, 7, g), [0]), (prefilled(m, 25, g), [0])], cap=40)
        own = [batch.take([0], cap=40), batch.take([1], cap=40)]
        batch.free([1])                     # a free row runs a dummy token (its output is dropped)
        ids = torch.randint(0, 256, (2, 1), generator=g)
        assert_close(m(ids, cache=batch).logits[:1], m(ids[:1], cache=own[0]).logits, atol=1e-5, msg=layout)
        assert batch.lengths.tolist() == [8, 1]
        batch.place([1], rows[1])
        ref = rows[1].take([0], cap=40)
        for _ in range(3):
            ids = torch.randint(0, 256, (2, 1), generator=g)
            got = m(ids, cache=batch).logits
            assert_close(got[1:], m(ids[1:], cache=ref).logits, atol=1e-5, msg=layout)
            assert_close(got[:1], m(ids[:1], cache=own[0]).logits, atol=1e-5, msg=layout)


@pytest.mark.parametrize("layout", ["AM WM", "SM RM", "LM IM", "KM BM"])
def test_snapshot_and_restore_roll_rows_back_exactly(layout):
    """After a snapshot of some rows, tokens written and then rolled back leave those rows (rings and recurrent
    states included) where they were: the next tokens give what they give without the detour."""
    m = tiny_layout(layout)
    g = torch.Generator().manual_seed(3)
    with torch.inference_mode():
        own = [prefilled(m, n, g) for n in (4, 13, 9)]
        batch = InferenceCache.concat([(c, [0]) for c in own], cap=48)
        snap = batch.snapshot([0, 2])
        m(torch.randint(0, 256, (3, 4), generator=g), cache=batch)   # a detour of four tokens in every row
        m(torch.randint(0, 256, (3, 1), generator=g), cache=batch)
        batch.restore(snap)
        assert batch.lengths.tolist() == [4, 18, 9]
        ids = torch.randint(0, 256, (3, 2), generator=g)
        got = m(ids, cache=batch).logits
        assert_close(got[[0, 2]], torch.cat([m(ids[i:i + 1], cache=own[i]).logits for i in (0, 2)]), atol=1e-5,
                     msg=layout)


def test_trim_rolls_attention_rows_back_and_refuses_state_without_history():
    m = tiny_layout("AM LM")
    g = torch.Generator().manual_seed(4)
    with torch.inference_mode():
        own = [prefilled(m, n, g) for n in (6, 10)]
        batch = InferenceCache.concat([(c, [0]) for c in own], cap=32)
        m(torch.randint(0, 256, (2, 3), generator=g), cache=batch)
        batch.trim([0, 1], [6, 11])                                   # row 0 back to its prompt, row 1 keeps one
        assert batch.lengths.tolist() == [6, 11] and batch.next_pos.tolist() == [6, 11]
        ids = torch.randint(0, 256, (2, 1), generator=g)
        keep = batch.take([1])                                        # row 1's own state, with the kept token
        got = m(ids, cache=batch).logits
        assert_close(got[:1], m(ids[:1], cache=own[0]).logits, atol=1e-5)
        assert_close(got[1:], m(ids[1:], cache=keep).logits, atol=1e-5)
    for layout in ("AM WM", "AM SM"):
        hybrid = tiny_layout(layout)
        with torch.inference_mode():
            c = prefilled(hybrid, 5, g)
        with pytest.raises(ValueError, match="snapshot and restore"):
            c.trim([0], 2)


def test_memory_of_rows_counts_their_tokens_and_what_is_allocated():
    m = tiny_layout("AM SM")
    g = torch.Generator().manual_seed(5)
    with torch.inference_mode():
        a, b = prefilled(m, 4, g), prefilled(m, 12, g)
        batch = InferenceCache.concat([(a, [0]), (b, [0])], cap=20)
    assert batch.nbytes == a.nbytes + b.nbytes                        # tokens held, not 2 x the longest
    from hybridlm.cache import allocated_bytes
    assert allocated_bytes([batch]) >= batch.nbytes and batch.room == 20 - 12
    assert a.cut_bytes(0) == a.cut(0).nbytes + a.next_pos.nbytes
