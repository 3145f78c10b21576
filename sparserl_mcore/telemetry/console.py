"""What a run prints: human-formatted figures, and library noise kept off the console.

The ranks' own output goes to per-rank logs (parallel.launch.run_ranks), which also drop
megatron-core's missing-backend warnings (parallel.rank_entry). What is left is the process a user
started: transformers draws a progress bar for every checkpoint it reads or writes (make-tiny, the
warm start, the benchmarks' evals), nothing a user can act on. `quiet_library_output()` turns
those off, and filters the megatron warnings the same way should this process import megatron.

    quiet_library_output()                 # first thing in `sparserl demo` and the benchmarks
    human_bytes(16384) -> "16.4 KB"; times(3.2) -> "3.2x"
"""

from __future__ import annotations

import math


def quiet_library_output() -> None:
    """transformers' per-checkpoint progress bars off, megatron's backend warnings filtered."""
    from sparserl_mcore.parallel.rank_entry import quiet_optional_backend_warnings

    quiet_optional_backend_warnings()
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def human_bytes(n: float) -> str:
    """Decimal units, three significant figures: 16384 -> '16.4 KB', 83968 -> '84.0 KB'."""
    if not math.isfinite(n):
        return str(n)
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            break
        n /= 1000
    if unit == "B":
        return f"{n:.0f} B"
    return f"{n:.3g} {unit}" if abs(n) >= 100 else f"{n:.1f} {unit}"


def times(ratio: float) -> str:
    """A ratio as '3.2x' (one decimal below 10x, none above)."""
    if not math.isfinite(ratio):
        return "-"
    return f"{ratio:.1f}x" if ratio < 10 else f"{ratio:.0f}x"
