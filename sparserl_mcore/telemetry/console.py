"""What a run prints: human-formatted figures, and library noise filtered once per process.

megatron-core warns at import and at model build that Transformer Engine / Apex are missing (once
per module, on every rank), transformers draws a progress bar for every checkpoint it reads or
writes: nothing a user can act on in a CPU run. `quiet_library_output()` drops exactly those
messages (matched by text, so any other warning still shows), and `backend_note()` is the one line
that says what runs instead.

    quiet_library_output()                 # first thing on every rank / in the demo process
    human_bytes(16384) -> "16.4 KB"; times(3.2) -> "3.2x"
"""

from __future__ import annotations

import importlib.util
import math
import warnings

# (message regex, category): warnings that tell a user nothing actionable. Matched from the start
# of the message text; the module is not checked, so a relocation inside megatron stays filtered.
LIBRARY_NOISE: tuple[tuple[str, type[Warning]], ...] = (
    (r"Transformer Engine and Apex are not installed", UserWarning),
    (r"Apex is not installed", UserWarning),
    (r"full scope is deprecated", UserWarning),  # megatron's own default config value
    (r"When using async grad allreduce it is recommended", UserWarning),  # a CUDA-only hint
)


def quiet_library_output() -> None:
    """Filter LIBRARY_NOISE and transformers' per-checkpoint progress bars (idempotent)."""
    for message, category in LIBRARY_NOISE:
        warnings.filterwarnings("ignore", message=message, category=category)
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def backend_note() -> str | None:
    """One line on what megatron-core uses without Transformer Engine / Apex; None when both exist."""
    missing = [name for name in ("transformer_engine", "apex") if importlib.util.find_spec(name) is None]
    if not missing:
        return None
    return (
        "megatron-core without Transformer Engine/Apex: torch norms, Adam and multi-tensor ops "
        "(all features work; install transformer-engine for fused GPU kernels)"
    )


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
