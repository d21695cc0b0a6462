"""The one markdown table writer (results pages, bench suites' .md files, the GPU check's report).

    markdown_table(["preset", "tok/s"], [["mamba2", "1,234"]])
    -> ["| preset | tok/s |", "|---|---|", "| mamba2 | 1,234 |"]
"""


def markdown_table(header: list[str], rows: list[list]) -> list[str]:
    """The table's lines: header, separator, one line per row (cells as str())."""
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)] + \
           ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
