"""Rich progress bars and summaries shared by the data-pipeline CLIs.

rich.progress is imported only when a bar is shown: its import alone costs ~0.03
CPU-s, which a `--no-progress` run (scripts, benchmarks) need not pay.
"""

from __future__ import annotations


def rates(text_bytes: float, documents: float, tokens: float, seconds: float) -> str:
    """'12.30 MB/s, 4.6k docs/s, 3.21M tok/s' (MB = 10^6 bytes of UTF-8 text)."""
    seconds = max(seconds, 1e-9)
    return (f"{text_bytes / seconds / 1e6:.2f} MB/s, {_si(documents / seconds)} docs/s, "
            f"{_si(tokens / seconds)} tok/s")


def _si(value: float) -> str:
    for scale, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= scale:
            return f"{value / scale:.3g}{unit}"
    return f"{value:.3g}"


class NoProgress:
    """What byte_progress returns when disabled: the calls a bar takes, doing nothing."""

    def __enter__(self) -> "NoProgress":
        return self

    def __exit__(self, *exc) -> None:
        return None

    def add_task(self, description: str, **fields) -> int:
        return 0

    def update(self, task: int, **fields) -> None:
        return None


def byte_progress(console, enabled: bool):
    """A progress bar over input bytes, with throughput columns (a rich Progress), or a
    NoProgress when not `enabled`."""
    if not enabled:
        return NoProgress()
    from rich.progress import (
        BarColumn,
        Progress,
        ProgressColumn,
        TaskProgressColumn,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )
    from rich.text import Text

    class ThroughputColumn(ProgressColumn):
        """MB/s, docs/s and tokens/s averaged since the task started (stable, unlike a window)."""

        def render(self, task) -> Text:
            elapsed = task.elapsed or 0.0
            fields = task.fields
            if not elapsed or "text_bytes" not in fields:
                return Text("")
            return Text(rates(fields["text_bytes"], fields["documents"], fields["tokens"], elapsed),
                        style="progress.data.speed")

    return Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TaskProgressColumn(),
        ThroughputColumn(),
        TimeElapsedColumn(),
        TextColumn("eta"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )
