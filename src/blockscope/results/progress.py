"""Progress of long runs: a Rich bar with an estimate of the time left from the steps after
the first (`progress_bar`), plain lines where stderr is not a terminal, and a long run's
stages, each with its own bar (`Stages`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.text import Text


@contextmanager
def progress_bar(
    console: Console, total: int, description: str, enabled: bool = True,
    reporter: Callable | None = None,
) -> Iterator[Callable[[], None]]:
    """Yield a callback: `cb()` advances the bar by one step, `cb(total=n)` resets its total.
    With an ETA; where stderr is not a terminal (piped, logged), one plain line per tenth.
    With `reporter` (where progress goes instead of a bar, the Python face's: a context
    manager of (total, description) giving the step callback), its callback instead, whether
    or not `enabled`."""
    if reporter is not None:
        with reporter(total, description) as step:
            yield step
        return
    if not enabled:
        yield lambda total=None: None
        return
    if not console.is_terminal:
        yield _plain_progress(console, total, description)
        return
    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("eta"), _Remaining())
    with Progress(*columns, console=console, transient=True) as progress:
        task = progress.add_task(description, total=total)

        def step(total: int | None = None) -> None:
            if total is None:
                progress.advance(task)
                fields = progress.tasks[task].fields
                if fields.get("first_step_at") is None:  # the estimate starts after it
                    fields["first_step_at"] = progress.get_time()
            else:
                progress.update(task, total=total)

        yield step


class _Remaining(TimeRemainingColumn):
    """The time left from the steps after the first: a sweep's first step is its clean pass
    (or a fit's first batch), not a variant, and Rich's own estimate from it alone was far
    off ("about 361 s left"). "-:--:--" until `estimate` has enough to go on."""

    def render(self, task):
        first = task.fields.setdefault("first_step_at", None)
        left = None if first is None or task.total is None else estimate(
            task.completed, task.total, task.get_time() - first)
        return Text("-:--:--" if left is None else _clock(left), style="progress.remaining")


ESTIMATE_AFTER_S = 2.0  # seconds of steps after the first before the time left is guessed


def estimate(done: int, total: int, since_first: float) -> float | None:
    """Seconds left, from the steps after the first (`since_first`: seconds since it
    ended), or None until there is enough to go on: a tenth of the steps, at least two,
    over at least ESTIMATE_AFTER_S. Variants finish in batches, several at one instant,
    so a few steps' rate read 0 ("about 0 s left") on every sweep's first line."""
    later = done - 1
    if done >= total or later < max(2, total // 10) or since_first < ESTIMATE_AFTER_S:
        return None
    return since_first / later * (total - done)


def _clock(seconds: float) -> str:
    seconds = max(0, int(round(seconds)))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Stages:
    """A long run's experiments, each said on one line (`[2/5] residual norms: ...`) with
    its own progress bar: `with stages(description, n_steps) as step: ... step()`."""

    def __init__(self, console: Console, total: int, enabled: bool = True,
                 reporter: Callable | None = None):
        self.console, self.total, self.enabled, self.done = console, total, enabled, 0
        self.reporter = reporter  # progress_bar's

    @contextmanager
    def __call__(self, description: str, n_steps: int) -> Iterator[Callable[[], None]]:
        self.done += 1
        if self.enabled:
            self.console.print(f"[{self.done}/{max(self.total, self.done)}] {description}",
                               highlight=False, soft_wrap=True)
        with progress_bar(self.console, n_steps, description.split(":")[0],
                          self.enabled, self.reporter) as step:
            yield step


def _plain_progress(console: Console, total: int, description: str) -> Callable:
    """Progress as plain lines (`description: 5/13, 12 s, about 19 s left`) each tenth."""
    import time

    state = {"done": 0, "total": max(1, total), "start": time.perf_counter(), "shown": 0,
             "first": None}

    def step(total: int | None = None) -> None:
        if total is not None:
            state["total"] = max(1, total)
            return
        state["done"] += 1
        now = time.perf_counter()
        if state["first"] is None:
            state["first"] = now  # the estimate comes from the steps after the first
        tenth = 10 * state["done"] // state["total"]
        if tenth > state["shown"]:
            state["shown"] = tenth
            spent, done, n = now - state["start"], state["done"], state["total"]
            guess = estimate(done, n, now - state["first"])
            left = "" if guess is None else f", about {guess:.0f} s left"
            console.print(f"{description}: {done}/{n}, {spent:.0f} s{left}",
                          highlight=False, soft_wrap=True)

    return step
