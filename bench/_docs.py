"""Write a benchmark's results into its marked block of docs/benchmarks.md."""

from __future__ import annotations

from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"


def write_block(section: str, name: str, body: str) -> None:
    """Put *body* between the ``<!-- name results: begin/end -->`` markers of *section*.

    The file is read right before writing and only the marked block changes, so the
    text around it and every other section survive a re-run. Without markers the block
    goes at the top of *section* (a ``## `` heading), or at the end of the file.
    """
    begin, end = f"<!-- {name} results: begin -->", f"<!-- {name} results: end -->"
    text = DOCS.read_text() if DOCS.exists() else "# Benchmarks\n"
    block = f"{begin}\n{body.strip()}\n{end}"
    if begin in text and end in text:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    elif section + "\n" in text:
        head, rest = text.split(section + "\n", 1)
        text = f"{head}{section}\n\n{block}\n{rest}"
    else:
        text = f"{text.rstrip()}\n\n{section}\n\n{block}\n"
    DOCS.write_text(text)
