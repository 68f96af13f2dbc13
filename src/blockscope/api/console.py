"""The two consoles every command prints on, and literal styled text."""

from __future__ import annotations

from rich.console import Console

# Literal consoles: a path or model name may contain "[", which must print as itself.
# Styles come from Text objects (`styled`), never from markup in strings.
out = Console(markup=False)
err = Console(stderr=True, markup=False)


def styled(label: str, style: str, rest: str = ""):
    """`label` in `style`, then `rest`, as literal text."""
    from rich.text import Text

    return Text.assemble((label, style), rest)
