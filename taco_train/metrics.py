"""Run outputs: metrics as JSONL and TensorBoard scalars, a PNG of train / validation loss,
throughput and MFU."""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import sys
from pathlib import Path
from typing import Any

# Dense bf16 tensor-core peak per device, FLOP/s (vendor datasheets: H100/H200 SXM 989.4 TFLOP/s,
# A100 312 TFLOP/s). Keyed by a substring of `jax.Device.device_kind`.
PEAK_FLOPS = {"H200": 989.4e12, "H100": 989.4e12, "A100": 312e12}


def peak_flops(device_kind: str, override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device, or None if unknown (then MFU is not reported)."""
    if override_tflops is not None:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_FLOPS.items() if k in device_kind), None)


def mfu(tokens_per_s: float, flops_per_token: float, n_devices: int, peak: float | None):
    """Model FLOPs utilisation (PaLM, Chowdhery et al. 2022, appendix B): achieved model FLOP/s
    (tokens/s x training FLOPs per token, no remat recompute) over the devices' summed peak."""
    if peak is None:
        return None
    return tokens_per_s * flops_per_token / (n_devices * peak)


class MetricsWriter:
    """Appends one JSON object per line to `path`, and (with `tensorboard_dir`) every numeric
    field as a TensorBoard scalar `<kind>/<field>` (fields named with a "/" keep their own tag),
    and figures as TensorBoard images (`write_figure`).

    On resume from `start_step`, records of later steps (written after the checkpoint the run
    resumes from) and lines that do not parse (one a killed process was writing) move to
    `<name>.after-step-<start_step>.jsonl` beside it, said in one line, so the file reads like
    one uninterrupted run and nothing is lost; TensorBoard is told the same (`purge_step`), so
    it hides the events of those steps.
    """

    def __init__(
        self,
        path: Path,
        start_step: int,
        enabled: bool = True,
        tensorboard_dir: Path | None = None,
    ):
        self.path = path
        self.enabled = enabled
        self._board = None
        if not enabled:
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        kept, later = _split_at(path, start_step)
        if later:
            aside = _unused(path.with_name(f"{path.stem}.after-step-{start_step}{path.suffix}"))
            aside.write_text("".join(later))
            print(
                f"resuming at step {start_step}: {len(later)} lines of {path.name} from later "
                f"steps (or unreadable) moved to {aside.name}",
                file=sys.stderr,
                flush=True,
            )
        partial = path.with_name(f".{path.name}.partial")
        partial.write_text("".join(kept))
        os.replace(partial, path)  # the file whole, never cut short by a kill here
        if tensorboard_dir is not None:
            from tensorboardX import SummaryWriter

            # A NaN loss is a value to record, not a warning line per scalar.
            logging.getLogger("tensorboardX.x2num").setLevel(logging.ERROR)

            self._board = SummaryWriter(str(tensorboard_dir), purge_step=start_step + 1)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")  # NaN / Infinity stay visible.
        if self._board is not None:
            for tag, value in scalars(record).items():
                self._board.add_scalar(tag, value, record["step"])
            self._board.flush()

    @property
    def wants_figures(self) -> bool:
        """Whether `write_figure` writes anywhere (TensorBoard is on)."""
        return self._board is not None

    def write_figure(self, tag: str, figure, step: int) -> None:
        """A matplotlib figure as a TensorBoard image under `tag` at `step` (closes it)."""
        if self._board is not None:
            self._board.add_figure(tag, figure, step, close=True)
            self._board.flush()

    def records(self) -> list[dict[str, Any]]:
        """The records written so far (those of earlier invocations of a resumed run too)."""
        return read_jsonl(self.path) if self.enabled else []

    def close(self) -> None:
        if self._board is not None:
            self._board.close()


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """The TensorBoard scalars of one record: `train/loss`, `eval/val_loss`,
    `comm_error/<call site>`, ... (nested fields are left to metrics.jsonl)."""
    out = {}
    for key, value in record.items():
        if key in ("kind", "step") or isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key if "/" in key else f"{record['kind']}/{key}"] = float(value)
    return out


def _split_at(path: Path, step: int) -> tuple[list[str], list[str]]:
    """The lines of `path` (JSONL) of records up to `step`, and the others: records of later
    steps and lines that do not parse."""
    kept, later = [], []
    lines = path.read_text().splitlines(keepends=True) if path.exists() else []
    for line in filter(str.strip, lines):
        try:
            up_to = json.loads(line).get("step", 0) <= step
        except (json.JSONDecodeError, AttributeError, TypeError):
            up_to = False
        (kept if up_to else later).append(line if line.endswith("\n") else line + "\n")
    return kept, later


def _unused(path: Path) -> Path:
    """`path`, or the first of `<stem>.1<suffix>`, `.2`, ... that does not exist."""
    candidates = (path.with_name(f"{path.stem}.{n}{path.suffix}") for n in itertools.count(1))
    return path if not path.exists() else next(c for c in candidates if not c.exists())


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(records: list[dict[str, Any]], png: Path, title: str = "") -> None:
    """Train loss (per logged step) and validation loss (per evaluation) against step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for kind, key, style, label in (
        ("train", "loss", "-", "train loss"),
        ("eval", "val_loss", "o-", "validation loss"),
    ):
        pts = [(r["step"], r[key]) for r in records if r.get("kind") == kind and key in r]
        if pts:
            ax.plot(*zip(*pts, strict=True), style, label=label, markersize=3)
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def format_line(record: dict[str, Any]) -> str:
    """One progress line: step, loss, tokens/s, MFU where known (and validation loss on eval
    records); an unknown MFU is said once at the start of the run, not on every line."""
    parts = [f"step {record['step']:>6d}"]
    for key, fmt in (("loss", ".4f"), ("val_loss", ".4f"), ("grad_norm", ".3f"), ("lr", ".2e")):
        if key in record:
            parts.append(f"{key} {record[key]:{fmt}}")
    if "tokens_per_s" in record:
        parts.append(f"tok/s {record['tokens_per_s']:,.0f}")
    if record.get("mfu") is not None:
        parts.append(f"mfu {100 * record['mfu']:.1f}%")
    return " | ".join(parts)


def is_finite(value: float) -> bool:
    return math.isfinite(value)
