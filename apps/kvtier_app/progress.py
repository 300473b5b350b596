"""The terminal progress bar the simulator front-ends hand to `kvtier.sim`."""

from __future__ import annotations

import sys

from kvtier.sim.loop import Progress, ProgressFactory


def tqdm_progress(total: int, label: str) -> Progress:
    from tqdm import tqdm

    return tqdm(total=total, unit="req", mininterval=0.5, desc=label)


def terminal_progress(disabled: bool) -> ProgressFactory | None:
    """A bar on stderr when it is a terminal and the user did not turn it off."""
    return None if disabled or not sys.stderr.isatty() else tqdm_progress
