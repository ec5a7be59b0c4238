"""Live progress for `specjax search`: a search runs for many minutes, so the user should see at a
glance where it is (round, measurements, incumbent speedup) without scrolling through the log.

On a terminal with `rich` installed the summary is a panel kept at the bottom of the screen and the
log scrolls above it; anywhere else (a pipe, a CI log, no rich) every message and every summary is
a plain flushed line, so logs stay greppable.
"""

from __future__ import annotations

import json
import sys
from typing import IO, Any


def _elapsed(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _fields(summary: dict) -> dict[str, str]:
    """The summary as display strings; missing keys show as '?' because callers may send partial
    summaries (e.g. before the first round)."""
    speedup, best = summary.get("speedup"), summary.get("best_predicted")
    elapsed = summary.get("elapsed_s")
    return {"round": f"{summary.get('round', '?')}/{summary.get('rounds', '?')}",
            "measured": str(summary.get("measurements", "?")),
            "speedup": "?" if speedup is None else f"{speedup:.2f}x AR",
            "elapsed": "?" if elapsed is None else _elapsed(elapsed),
            "phase": str(summary.get("phase", "")),
            "incumbent": json.dumps(summary.get("incumbent") or {}, sort_keys=True),
            "best predicted": "-" if best is None else f"{best:.2f} tok/s"}


def summary_line(summary: dict) -> str:
    """One line such as `[round 2/6 | 11 measured | 1.34x AR | 42s] measuring`."""
    f = _fields(summary)
    return f"[round {f['round']} | {f['measured']} measured | {f['speedup']} | {f['elapsed']}] {f['phase']}"


class LiveProgress:
    """`progress(msg)` logs a message; `status(summary)` updates the summary; `close()` ends the
    live display (also on leaving a `with` block). Pass `console` (a rich Console) to force the
    rich display, e.g. onto a StringIO in tests."""

    def __init__(self, stream: IO[str] | None = None, force_plain: bool = False, console: Any = None):
        self.stream = stream if stream is not None else sys.stdout
        self._console = console if console is not None else (None if force_plain else self._rich_console())
        self._live = None

    def _rich_console(self):
        """A rich Console on the stream, or None when the stream is not a terminal or rich is absent."""
        try:
            if not self.stream.isatty():
                return None
            from rich.console import Console
        except (AttributeError, ValueError, ImportError):  # no isatty / closed stream / no rich
            return None
        return Console(file=self.stream)

    def __call__(self, msg: str) -> None:
        if self._console is None:
            print(msg, file=self.stream, flush=True)
        else:  # markup off: messages contain config dicts and [brackets] that are not rich markup
            self._console.print(msg, markup=False, highlight=False)

    def status(self, summary: dict) -> None:
        if self._console is None:
            print(summary_line(summary), file=self.stream, flush=True)
            return
        panel = self._panel(summary)
        if self._live is None:
            from rich.live import Live
            self._live = Live(panel, console=self._console, auto_refresh=False)
            self._live.start(refresh=True)
        else:
            self._live.update(panel, refresh=True)

    @staticmethod
    def _panel(summary: dict):
        from rich.panel import Panel
        from rich.table import Table
        from rich.text import Text

        table = Table.grid(padding=(0, 2))
        table.add_column(style="bold")
        table.add_column()
        fields = _fields(summary)
        phase = fields.pop("phase")
        for key, value in fields.items():
            table.add_row(key, Text(value))  # Text: no number highlighting splitting "1.34x"
        return Panel(table, title="specjax search", subtitle=Text(phase), expand=False)

    def close(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def __enter__(self) -> "LiveProgress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
