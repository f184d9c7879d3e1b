"""Where people read syntorch's summaries: the terminal, or a pipe into a file or another program."""
import sys

from rich.console import Console

PIPED_WIDTH = 240  # rich would wrap at 80 columns, splitting paths from their arrows and cutting headers


def console() -> Console:
    """A rich Console that never breaks a line of text; when piped, tables get room for their full headers."""
    piped = not sys.stdout.isatty()
    return Console(soft_wrap=True, width=PIPED_WIDTH if piped else None)
