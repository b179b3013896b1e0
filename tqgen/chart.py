"""Draw `tqgen bench` JSON as a PNG: achieved bandwidth against context, one line per preset.

One panel per batch size; the copy ceiling measured in the same run and 80% of
it (the target for the 3/4-bit presets) are drawn as horizontal lines. matplotlib is optional
(`pip install 'tqgen[chart]'`); everything else in tqgen works without it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .errors import TqgenError
from .files import write_failure_reason


def require_matplotlib():
    """pyplot with a file-only backend, or a one-line error saying how to get it."""
    try:
        import matplotlib
    except ImportError:
        raise TqgenError("drawing the chart needs matplotlib: pip install matplotlib "
                         "(or install tqgen with its [chart] extra)") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def read_bench_json(path) -> dict:
    try:
        payload = json.loads(Path(path).read_text())
        rows, ceiling = payload["rows"], float(payload["copy_ceiling_gbps"])
        for row in rows:
            row["config"], row["batch"], row["context"], row["gbps"]  # noqa: B018 (schema check)
    except FileNotFoundError:
        raise TqgenError(f"{path}: no such file") from None
    except OSError as exc:
        raise TqgenError(f"{path}: cannot be read ({exc.strerror or exc})") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise TqgenError(f"{path}: not a tqgen bench JSON file ({type(exc).__name__}: {exc})") from None
    if not rows:
        raise TqgenError(f"{path}: has no decode rows to draw")
    payload["copy_ceiling_gbps"] = ceiling
    return payload


def draw(payload: dict, path) -> Path:
    """Write the chart to `path` (atomically: a failed draw leaves an older chart intact)."""
    path = Path(path)
    # Checked before drawing: a missing folder would fail the write as FileNotFoundError, which write_failure_reason
    # reads as a file system that takes no such name.
    if not path.parent.is_dir():
        why = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise TqgenError(f"cannot write the chart to {path}: the folder {path.parent} {why}")
    plt = require_matplotlib()
    rows, ceiling = payload["rows"], payload["copy_ceiling_gbps"]
    batches = sorted({row["batch"] for row in rows})
    configs = sorted({row["config"] for row in rows})
    figure, axes = plt.subplots(1, len(batches), figsize=(3.6 * len(batches) + 1, 3.8), sharey=True, squeeze=False)
    for axis, batch in zip(axes[0], batches):
        for config in configs:
            points = sorted((row["context"], row["gbps"]) for row in rows
                            if row["batch"] == batch and row["config"] == config)
            if points:
                axis.plot([c for c, _ in points], [g for _, g in points], marker="o", label=config)
        axis.axhline(ceiling, linestyle="--", color="black", linewidth=1, label="copy ceiling")
        axis.axhline(0.8 * ceiling, linestyle=":", color="gray", linewidth=1, label="80% of ceiling")
        axis.set_xscale("log", base=2)
        axis.set_title(f"batch {batch}")
        axis.set_xlabel("context (tokens)")
        axis.grid(alpha=0.3)
    axes[0][0].set_ylabel("GB/s: cache and query read, output written")
    axes[0][-1].legend(fontsize=7, loc="center right")
    meta = payload.get("metadata", {})
    figure.suptitle(f"tqgen decode, {meta.get('device', 'unknown device')}, triton {meta.get('triton', '?')}, "
                    f"{meta.get('date', '')}", fontsize=10)
    figure.tight_layout()
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial.png")
    try:
        figure.savefig(partial, dpi=110)
        os.replace(partial, path)
    except OSError as exc:
        raise TqgenError(f"cannot write the chart to {path}: {write_failure_reason(exc)}") from None
    finally:
        plt.close(figure)
        partial.unlink(missing_ok=True)
    return path
