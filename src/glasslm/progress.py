"""Progress on stderr: a tqdm bar where someone watches a terminal (or a notebook), plain lines elsewhere.

A tqdm bar redraws itself with carriage returns; written to a file (`glasslm train ... 2> log`, a CI
log, nohup) those frames pile up into one line of tens of kilobytes. Where stderr is not a
terminal, `progress_bar` gives a `PlainProgress` instead: the same calls, but it prints a whole line
at most every `interval_s` seconds, and one when it closes.

Example (stderr is not a terminal under doctest):
    >>> import sys
    >>> bar = progress_bar(total=3, desc="train", interval_s=0.0, file=sys.stdout)
    >>> bar.set_postfix(loss="2.5000"); bar.update(1)
    train 1/3 (33%), 0:00:00 elapsed, 0:00:00 left, loss=2.5000
    >>> bar.update(2); bar.close()
    train 3/3 (100%), 0:00:00 elapsed, 0:00:00 left, loss=2.5000
"""

from __future__ import annotations

import sys
import time
from datetime import timedelta
from typing import Any, TextIO

PLAIN_INTERVAL_S = 15.0  # a line every 15 s: a 15-minute run writes about 60 lines


def progress_bar(total: int | None = None, initial: int = 0, desc: str = "", unit: str = "it",
                 unit_scale: bool = False, disable: bool = False, interval_s: float = PLAIN_INTERVAL_S,
                 file: TextIO | None = None, **tqdm_options: Any) -> Any:
    """A tqdm bar on an interactive stderr (or in a notebook), else a `PlainProgress` with the same calls."""
    from tqdm.auto import tqdm
    from tqdm.autonotebook import tqdm as chosen
    from tqdm.std import tqdm as console_tqdm

    stream = file or sys.stderr
    in_notebook = chosen is not console_tqdm  # a notebook draws a widget, not `\r` frames
    interactive = in_notebook or getattr(stream, "isatty", lambda: False)()
    if interactive or disable:
        return tqdm(total=total, initial=initial, desc=desc, unit=unit, unit_scale=unit_scale, disable=disable,
                    file=file, **tqdm_options)
    return PlainProgress(total, initial, desc, unit, unit_scale, interval_s, stream)


class PlainProgress:
    """tqdm's calls (update, set_postfix, set_description, write, close) as whole lines, never `\\r`."""

    def __init__(self, total: int | None, initial: int, desc: str, unit: str, unit_scale: bool,
                 interval_s: float, file: TextIO):
        self.total, self.initial, self.n, self.desc, self.unit, self.unit_scale = total, initial, initial, desc, unit, unit_scale
        self.interval_s, self.file = interval_s, file
        self.postfix: dict[str, Any] = {}
        self.started = self.last_line = time.monotonic()
        self.shown = initial  # the count in the last line printed
        self.closed = False

    def update(self, n: int = 1) -> None:
        self.n += n
        self._maybe_print()

    def set_postfix(self, refresh: bool = True, **values: Any) -> None:
        self.postfix = dict(values)
        self._maybe_print()

    def set_description(self, desc: str, refresh: bool = True) -> None:
        self.desc = desc

    def write(self, text: str) -> None:
        print(text, file=self.file, flush=True)

    def close(self) -> None:
        if not self.closed and self.n != self.shown:
            self._print()
        self.closed = True

    def __enter__(self) -> "PlainProgress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _maybe_print(self) -> None:
        if time.monotonic() - self.last_line >= self.interval_s and self.n != self.shown:
            self._print()

    def _print(self) -> None:
        now = time.monotonic()
        parts = [f"{self.desc} {self._count(self.n)}" + (f"/{self._count(self.total)}" if self.total else "")
                 + (f" ({self.n / self.total:.0%})" if self.total else ""),
                 f"{timedelta(seconds=round(now - self.started))} elapsed"]
        if self.total and self.n > self.initial and now > self.started:
            rate = (self.n - self.initial) / (now - self.started)
            parts[-1] += f", {timedelta(seconds=round((self.total - self.n) / rate))} left"
        if self.postfix:
            parts.append(" ".join(f"{k}={v}" for k, v in self.postfix.items()))
        self.write(", ".join(parts))
        self.last_line, self.shown = now, self.n

    def _count(self, n: int | float | None) -> str:
        if n is None:
            return "?"
        if not self.unit_scale:
            return f"{n:,}"
        for size, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
            if abs(n) >= size:
                return f"{n / size:.1f}{suffix}{self.unit}"
        return f"{n:g}{self.unit}"
