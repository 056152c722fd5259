"""Rich tables that fold long cells instead of cutting them, for the CLI and the demo.

A topic or group name is what people copy, and a cut number is a wrong
number: cells wrap, and fold inside long words, rather than end in an
ellipsis. Only the CLI and the demo import this module, so `import bus`
does not load rich.
"""

from __future__ import annotations

from rich import box
from rich.cells import cell_len
from rich.console import Console
from rich.table import Table

__all__ = ["fit", "table"]

# Columns are separated by two spaces (one of padding, one blank separator) and the
# table has no outer frame: more room for cells in 80 columns, and a name copies cleanly.
_GAP = 2


def table(*columns: str, numeric: tuple[str, ...] = (), title: str | None = None) -> Table:
    """A table whose cells wrap, and fold inside long words, instead of being cut with an ellipsis."""
    t = Table(title=title, box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1, 0, 0))
    for name in columns:
        t.add_column(name, overflow="fold", no_wrap=False, justify="right" if name in numeric else "left")
    return t


def fit(t: Table, rows: list[list[str]], names: tuple[int, ...] = (0,), width: int | None = None) -> Table:
    """Add `rows` to `t`, choosing column widths when the natural layout is wider than `width`.

    `width` defaults to the terminal's (rich's `Console().width`, which honours
    `$COLUMNS`). Rich alone shrinks every column alike, folding names and
    numbers as soon as the table is a little too wide. Here headers fold
    first, then free text, then long names (what people copy) down to 24
    characters, and numbers only when nothing else is left.
    """
    width = width if width is not None else Console().width
    n = len(t.columns)
    room = width - _GAP * (n - 1)
    heads = [cell_len(str(c.header)) for c in t.columns]
    data = [max((cell_len(row[i]) for row in rows), default=0) for i in range(n)]
    widths = [max(h, d, 1) for h, d in zip(heads, data, strict=True)]
    if sum(widths) > room:
        _shrink(t, widths, data, names, excess=sum(widths) - room)
    for row in rows:
        t.add_row(*row)
    return t


def _shrink(t: Table, widths: list[int], data: list[int], names: tuple[int, ...], excess: int) -> None:
    """Take `excess` cells of width from the columns, in the order they give way, and set the widths."""
    n = len(t.columns)
    numbers = [i for i, c in enumerate(t.columns) if c.justify == "right" and i not in names]
    text = [i for i in range(n) if i not in names and i not in numbers]
    # (columns, the width each may shrink to), in the order they give way.
    steps = [
        (list(range(n)), [max(d, 5) for d in data]),  # headers fold
        (text, [6] * n),
        (list(names), [24] * n),
        (text + numbers, [max(d, 3) if i in numbers else 3 for i, d in enumerate(data)]),
        (list(names), [8] * n),
        (list(range(n)), [1] * n),
    ]
    for group, floors in steps:
        while excess > 0:
            wide = [i for i in group if widths[i] > floors[i]]
            if not wide:
                break
            widest = max(wide, key=lambda i: widths[i] - floors[i])
            widths[widest] -= 1
            excess -= 1
    for column, w in zip(t.columns, widths, strict=True):
        column.width = w
