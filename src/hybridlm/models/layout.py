"""The layout language: a model's layers as a string of mixer letters.

    A attention   S SSD (Mamba-2)   M MLP / gated MLP   (more letters are registered by other modules)
    (...)*n  repeat a group      [...]  a two-hop block (Rodimus++)      spaces are ignored
    {...}    a parallel block: its token mixers read the same normed input, their outputs are summed (Falcon-H1)
    X@k      weight sharing: every occurrence of a letter tagged k shares the first one's parameters
             (each keeps its own layer index and cache slot), e.g. "(S*5 Z@0 S*5 Z@1)*3"

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


class Tagged(str):
    """A letter carrying a weight-sharing tag (`Z@0` -> Tagged("Z", 0, column)). It equals and hashes like its
    letter, so LETTERS lookups and `flatten` see a plain letter; `.tag` groups the occurrences that share
    parameters (models/causal_lm.py ties them) and `.col` (0-based) is where it was written, for errors."""

    def __new__(cls, letter: str, tag: int, col: int):
        s = super().__new__(cls, letter)
        s.tag, s.col = tag, col
        return s

    def __reduce__(self):
        return Tagged, (str(self), self.tag, self.col)


def parse_layout(layout: str, letters, token=None) -> list:
    """Expand a layout string into a list whose items are letters ("A"), two-hop blocks (`Hop`) or parallel blocks
    (`Parallel`), both tuples of letters. `letters` is the set of known mixer letters; `token` (optional) the token
    mixers among them, which alone may sit in braces."""
    if not isinstance(layout, str) or not layout.strip():
        raise ConfigError("layout must be a non-empty string such as '(AM)*4'")
    pos = 0
    tag_letter: dict[int, str] = {}   # weight-sharing tag -> the letter it was first given to

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

    def tagged(letter: str, at: int, in_hop: bool) -> str:
        """The letter, or a Tagged one when `@k` follows it."""
        nonlocal pos
        skip_ws()
        if pos >= len(layout) or layout[pos] != "@":
            return letter
        if in_hop:
            _fail(layout, pos, "weight sharing '@k' is not available inside a two-hop block '[...]'")
        pos += 1
        start = pos
        while pos < len(layout) and layout[pos].isdigit():
            pos += 1
        if start == pos:
            _fail(layout, start, "expected a tag number after '@' (e.g. 'Z@0')")
        tag = int(layout[start:pos])
        first = tag_letter.setdefault(tag, letter)
        if first != letter:
            _fail(layout, at, f"tag @{tag} is already given to {first!r}: one tag shares one letter's parameters")
        return Tagged(letter, tag, at)

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
                at = pos
                pos += 1
                out += repeat([tagged(ch, at, in_hop)])
            elif ch == "*":
                _fail(layout, pos, "'*' must follow a letter, ')', ']' or '}'")
            elif ch == "@":
                _fail(layout, pos, "'@' must follow a letter (a weight-sharing tag such as 'Z@0')")
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


def fold_layout(tokens: list[str], max_period: int = 16, _inner: bool = False) -> str:
    """Per-layer tokens ("KM", "LO", "S", "Z@0", ...) -> a layout string: at each point the repeat covering most
    tokens (periods up to `max_period`, ties to the shorter) is written (...)*n; inside a repeated unit only runs of
    one token fold (of one letter, or of 4 or more). ["KM", "KO", "KO", "LO"] -> "KM (KO)*2 LO", ["S"] * 5 + ["Z@0", "S"] -> "S*5 Z@0 S",
    list("SMSMSA") -> "(SM)*2 SA". Converters and presets use it to write the layouts they build."""
    letters = all(len(t) == 1 for t in tokens)             # one letter per layer: units written without spaces
    out, i = [], 0
    while i < len(tokens):
        p, r = 1, 1                                       # best (period, repeats)
        for q in range(1, 2 if _inner else max_period + 1):
            n = 1
            while tokens[i + n * q: i + (n + 1) * q] == tokens[i: i + q] and i + (n + 1) * q <= len(tokens):
                n += 1
            if n > 1 and q * n > p * r and (not _inner or len(tokens[i]) == 1 or n >= 4):
                p, r = q, n
        unit = fold_layout(tokens[i: i + p], max_period, True) if p > 1 else tokens[i]
        seg = unit if r == 1 else (f"{unit}*{r}" if len(unit) == 1 else f"({unit})*{r}")
        if letters and out and r == 1 and p == 1 and "*" not in out[-1]:
            out[-1] += seg                                # "S", "A" -> "SA"
        else:
            out.append(seg)
        i += p * r
    return " ".join(out)


def shared_groups(items: list) -> dict[int, list[int]]:
    """Weight-sharing tag -> the positions in `items` (top-level blocks) of its occurrences, in order (the parser
    refuses `@k` inside a two-hop or parallel block, so tagged letters stand on their own)."""
    groups: dict[int, list[int]] = {}
    for i, it in enumerate(items):
        if isinstance(it, Tagged):
            groups.setdefault(it.tag, []).append(i)
    return groups
