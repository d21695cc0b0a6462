import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hybridlm.errors import ConfigError
from hybridlm.models.layout import flatten, parse_layout

LET = frozenset("ASMRWEFLIO")


@pytest.mark.parametrize("layout,expected", [
    ("(AM)*3", list("AMAMAM")),
    ("S*4", list("SSSS")),
    ("((SE)*2 AE)*2", list("SESEAESESEAE")),
    ("A M  S", list("AMS")),
    ("SMSMSMA", list("SMSMSMA")),
])
def test_expansion(layout, expected):
    assert parse_layout(layout, LET) == expected


def test_two_hop_blocks():
    items = parse_layout("[RWM]*2 S", LET)
    assert items == [("R", "W", "M"), ("R", "W", "M"), "S"]
    assert flatten(items) == list("RWMRWMS")


@pytest.mark.parametrize("layout,col,what", [
    ("(AM", 4, "missing ')'"),
    ("AM)", 3, "unexpected ')'"),
    ("AXM", 2, "unknown mixer letter 'X'"),
    ("A*", 3, "repeat count"),
    ("A*0", 3, "at least 1"),
    ("()", 1, "empty group"),
    ("*3", 1, "must follow"),
    ("[A[M]]", 3, "cannot be nested"),
    ("a", 1, "unknown mixer letter"),
])
def test_errors_point_at_the_character(layout, col, what):
    with pytest.raises(ConfigError) as e:
        parse_layout(layout, LET)
    assert f"column {col}" in str(e.value) and what in str(e.value)


def test_empty():
    with pytest.raises(ConfigError):
        parse_layout("   ", LET)


letters = st.sampled_from(sorted(LET))


@st.composite
def layouts(draw, depth=0):
    parts = []
    for _ in range(draw(st.integers(1, 3))):
        if depth < 2 and draw(st.booleans()):
            inner, exp = draw(layouts(depth + 1))
            n = draw(st.integers(1, 3))
            parts.append((f"({inner})*{n}", exp * n))
        else:
            c = draw(letters)
            n = draw(st.integers(1, 3))
            parts.append((f"{c}*{n}" if n > 1 else c, [c] * n))
    return " ".join(p[0] for p in parts), [x for p in parts for x in p[1]]


@settings(max_examples=200, deadline=None)
@given(layouts())
def test_generated_layouts_expand_correctly(pair):
    text, expected = pair
    assert parse_layout(text, LET) == expected


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ASM()[]*0123 xQ", max_size=12))
def test_random_strings_parse_or_raise_config_error(text):
    try:
        out = parse_layout(text, frozenset("ASM"))
    except ConfigError:
        return
    assert all(isinstance(i, (str, tuple)) for i in out)


def test_fold_layout_writes_what_parse_layout_reads_back():
    from hybridlm.models.layout import fold_layout
    from hybridlm.models.registry import LETTERS
    cases = {("KM", "KO", "KO", "LO"): "KM (KO)*2 LO", tuple("SMSMSMSASMSM"): "(SM)*3 SA (SM)*2",
             tuple(["GO", "GO", "GO", "AO"] * 12): "(GO GO GO AO)*12",
             tuple((["S"] * 5 + ["Z@0", "S"] + ["S"] * 5 + ["Z@1", "S"]) * 2): "(S*5 Z@0 S*6 Z@1 S)*2"}
    for tokens, want in cases.items():
        got = fold_layout(list(tokens))
        assert got == want
        assert [str(x) for x in parse_layout(got, set(LETTERS))] == \
            [str(x) for x in parse_layout(" ".join(tokens), set(LETTERS))]
