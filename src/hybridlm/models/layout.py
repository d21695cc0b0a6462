"""The layout language: a model's layers as a string of mixer letters.

    A attention   S SSD (Mamba-2)   M MLP / gated MLP   (more letters are registered by other modules)
    (...)*n  repeat a group      [...]  a two-hop block (Rodimus++)      spaces are ignored
    {...}    a parallel block: its token mixers read the same normed input, their outputs are summed (Falcon-H1)

"(AM)*12" is Transformer++, "S*24" Mamba-2, "((SE)*7 AE)*3" Cheems. `*n` also repeats a single letter
or a bracketed block: "S*4", "[RWM]*12", "({AS}M)*8" (Falcon-H1). Errors name the offending character and its
column.
"""
from ..errors import ConfigError


class Hop(tuple):
    """A two-hop block `[...]`: its letters in order."""


class Parallel(tuple):
    """A parallel block `{...}`: token-mixer letters that share one norm and whose outputs are summed."""


def _fail(layout: str, pos: int, msg: str):
    pointer = " " * pos + "^"
    raise ConfigError(f"bad layout {layout!r} at column {pos + 1}: {msg}\n  {layout}\n  {pointer}")


def parse_layout(layout: str, letters, token=None) -> list:
    """Expand a layout string into a list whose items are letters ("A"), two-hop blocks (`Hop`) or parallel blocks
    (`Parallel`), both tuples of letters. `letters` is the set of known mixer letters; `token` (optional) the token
    mixers among them, which alone may sit in braces."""
    if not isinstance(layout, str) or not layout.strip():
        raise ConfigError("layout must be a non-empty string such as '(AM)*4'")
    pos = 0

    def number() -> int:
        nonlocal pos
        start = pos
        while pos < len(layout) and layout[pos].isdigit():
            pos += 1
        if start == pos:
            _fail(layout, pos, "expected a repeat count after '*'")
        n = int(layout[start:pos])
        if n < 1:
            _fail(layout, start, "repeat count must be at least 1")
        return n

    def skip_ws():
        nonlocal pos
        while pos < len(layout) and layout[pos].isspace():
            pos += 1

    def repeat(items: list) -> list:
        nonlocal pos
        skip_ws()
        if pos < len(layout) and layout[pos] == "*":
            pos += 1
            skip_ws()
            return items * number()
        return items

    def parallel() -> Parallel:
        """`{` at pos: token-mixer letters up to `}` (no groups, blocks or repeats inside)."""
        nonlocal pos
        open_at = pos
        pos += 1
        inner = []
        while True:
            skip_ws()
            if pos >= len(layout):
                _fail(layout, pos, "missing '}'")
            ch = layout[pos]
            if ch == "}":
                break
            if ch in "([{":
                _fail(layout, pos, "a parallel block '{...}' holds only mixer letters (no nesting)")
            if not (ch.isalpha() and ch in letters):
                known = "".join(sorted(letters))
                _fail(layout, pos, f"unknown mixer letter {ch!r} (known: {known})" if ch.isalpha()
                      else f"unexpected {ch!r} in a parallel block")
            if token is not None and ch not in token:
                _fail(layout, pos, f"{ch!r} is a channel mixer: a parallel block '{{...}}' sums token mixers only")
            inner.append(ch)
            pos += 1
        if not inner:
            _fail(layout, open_at, "empty parallel block '{}'")
        pos += 1
        return Parallel(inner)

    def sequence(closer: str | None, in_hop: bool) -> list:
        nonlocal pos
        out: list = []
        while True:
            skip_ws()
            if pos >= len(layout):
                if closer:
                    _fail(layout, pos, f"missing '{closer}'")
                return out
            ch = layout[pos]
            if closer and ch == closer:
                pos += 1
                return out
            if ch in ")]}":
                _fail(layout, pos, f"unexpected '{ch}'")
            if ch == "(":
                open_at = pos
                pos += 1
                inner = sequence(")", in_hop)
                if not inner:
                    _fail(layout, open_at, "empty group '()'")
                out += repeat(inner)
            elif ch == "[":
                if in_hop:
                    _fail(layout, pos, "two-hop blocks '[...]' cannot be nested")
                open_at = pos
                pos += 1
                inner = sequence("]", True)
                if not inner:
                    _fail(layout, open_at, "empty two-hop block '[]'")
                out += repeat([Hop(inner)])
            elif ch == "{":
                if in_hop:
                    _fail(layout, pos, "parallel blocks '{...}' cannot sit inside a two-hop block")
                out += repeat([parallel()])
            elif ch.isalpha() and ch in letters:
                pos += 1
                out += repeat([ch])
            elif ch == "*":
                _fail(layout, pos, "'*' must follow a letter, ')', ']' or '}'")
            else:
                known = "".join(sorted(letters))
                _fail(layout, pos, f"unknown mixer letter {ch!r} (known: {known})")

    items = sequence(None, False)
    if not items:
        raise ConfigError(f"layout {layout!r} has no layers")
    return items


def flatten(items: list) -> list[str]:
    """All letters in order (two-hop and parallel blocks expanded): one per layer index / cache slot."""
    out = []
    for it in items:
        out.extend(it if isinstance(it, (Hop, Parallel)) else [it])
    return out


def fold_layout(tokens: list[str]) -> str:
    """Per-layer tokens ("KM", "LO", ...) -> a layout string, the longest repeat at each point folded as (...)*n
    (periods up to 8 tokens): ["KM", "KO", "KO", "LO"] -> "KM (KO)*2 LO". Converters use it to print layouts."""
    out, i = [], 0
    while i < len(tokens):
        best = (1, 1)                                     # (period, repeats)
        for p in range(1, 9):
            r = 1
            while tokens[i + r * p: i + (r + 1) * p] == tokens[i: i + p] and i + (r + 1) * p <= len(tokens):
                r += 1
            if r > 1 and p * r > best[0] * best[1]:
                best = (p, r)
        p, r = best
        unit = " ".join(tokens[i: i + p])
        out.append(unit if r == 1 else (f"({unit})*{r}" if p > 1 or len(unit) > 1 else f"{unit}*{r}"))
        i += p * r
    return " ".join(out)
