"""Compression error in a training run, and the error budget (docs/training.md, "Compression
error").

Every `run.comm_error_every` steps the trainer runs a measuring step: the train step built
with the collectives' measurement on (`taco_jax.telemetry`), a program of its own, so that
every other step runs the program it runs without measuring. After it, this module gives
- a "comm" record for metrics.jsonl (`record`): each call site's relative error against the
  exact fp32 collective (`comm_error/<site>`, a TensorBoard scalar each), its non-finite
  values, and the share of the TP bytes that went compressed; a console line (`line`); and a
  picture of the error by layer and op over the measuring steps (`figure`);
- the error budget (`compression.error_budget`): a call site over it on
  `compression.error_budget_consecutive` measuring steps in a row (`tally`, `due`; one spiky
  batch decides nothing) moves one step down its ladder, its codec ->
  `compression.fallback_codec` -> uncompressed (`next_codec`), for the rest of the run. The
  trainer says so in one line naming those steps (`switch_line`), records it
  (`fallback_record`), rebuilds its steps with the sites' new codecs
  (`taco_jax.CommConfig.site_codecs`: every rank switches at the same step, one program) and
  saves in each checkpoint the fallbacks (`METADATA_KEY`: {call site: codec}), the runs of
  measuring steps over the budget so far (`STREAKS_KEY`: {call site: [steps]}) and the
  compression settings that chose them (`checkpoint_metadata`), so a resumed run keeps both
  while those settings hold (`resumed_fallbacks`, `resumed_streaks`);
- at the end, a table per op (`table`) and `comm_error.png`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from typing import Any

import numpy as np

from taco_jax import telemetry

METADATA_KEY = "comm_fallbacks"  # in a checkpoint's metadata: {call site: codec}
STREAKS_KEY = "comm_over_budget"  # there too: {call site: the measuring steps over, in a row}
ERROR_PREFIX = "comm_error/"
TP_AXIS = "tp"
# The sharded optimizer's sites: SDP4Bit's codecs, with no other codec to fall back to.
DP_SITES = ("dp_grads", "dp_params")
_LAYERED = re.compile(r"layer_(\d+)/(.+)")
# The model's call sites in the order a block runs them (the figure's and the table's order).
OP_ORDER = ("embed", "attn_in", "attn_out", "mlp_in", "mlp_out", "head_in")


def op_of(site: str) -> str:
    """A call site without its layer: "layer_03/mlp_out/fwd" -> "mlp_out/fwd"."""
    match = _LAYERED.fullmatch(site)
    return match[2] if match else site


def layer_of(site: str) -> int | None:
    match = _LAYERED.fullmatch(site)
    return int(match[1]) if match else None


def _op_key(op: str) -> tuple:
    name, _, direction = op.rpartition("/")
    rank = OP_ORDER.index(name) if name in OP_ORDER else len(OP_ORDER)
    return (rank, name or direction, direction != "fwd")


def next_codec(site: str, current: str | None, fallback_codec: str) -> str:
    """The codec a call site over the budget runs next: `fallback_codec` after its own codec
    (`current` None; the sharded optimizer's sites have no other), then "none"."""
    if current is None and fallback_codec != "none" and site not in DP_SITES:
        return fallback_codec
    return "none"


def tally(
    streaks: dict[str, list[int]],
    step: int,
    errors: dict[str, telemetry.SiteError],
    budget: float,
) -> dict[str, list[int]]:
    """Each call site's run of measuring steps over `budget` (`taco_jax.telemetry.over_budget`)
    up to measuring step `step`: `streaks`, the runs up to the measuring step before, extended
    by the sites over it at `step`; a site within it at `step` (or not compressed) has none."""
    return {site: [*streaks.get(site, []), step] for site in telemetry.over_budget(errors, budget)}


def due(
    streaks: dict[str, list[int]],
    consecutive: int,
    fallbacks: dict[str, str],
    fallback_codec: str,
) -> dict[str, str]:
    """{call site: the codec it runs next} of the sites over the budget on `consecutive`
    measuring steps in a row (`tally`)."""
    return {
        site: next_codec(site, fallbacks.get(site), fallback_codec)
        for site, steps in streaks.items()
        if len(steps) >= consecutive
    }


def tp_share(errors: dict[str, telemetry.SiteError]) -> float | None:
    """The share of the TP collectives' bytes (a ring's, uncompressed) that went compressed."""
    tp = [e for e in errors.values() if e.axis == TP_AXIS]
    total = sum(e.nbytes for e in tp)
    return sum(e.compressed_bytes for e in tp) / total if total else None


def record(step: int, errors: dict[str, telemetry.SiteError]) -> dict[str, Any]:
    """The "comm" metrics record of a measuring step."""
    measured = {site: e for site, e in errors.items() if e.error is not None}
    out: dict[str, Any] = {"kind": "comm", "step": step}
    out.update({ERROR_PREFIX + site: e.error for site, e in measured.items()})
    out["nonfinite"] = {site: e.nonfinite for site, e in measured.items()}
    share = tp_share(errors)
    if share is not None:
        out["tp_bytes_compressed"] = share
    return out


def site_errors(rec: dict[str, Any]) -> dict[str, float]:
    """{call site: error} of a "comm" record."""
    return {k.removeprefix(ERROR_PREFIX): v for k, v in rec.items() if k.startswith(ERROR_PREFIX)}


def line(rec: dict[str, Any]) -> str:
    """The console line of a "comm" record: the largest error and where, the mean, the TP
    bytes that went compressed, and the sites with non-finite values."""
    errors = site_errors(rec)
    parts = [f"step {rec['step']:>6d}", "comm error"]
    if errors:
        worst = max(errors, key=lambda s: _ordered(errors[s]))
        parts[-1] += (
            f" max {errors[worst]:.4f} ({worst}), mean "
            f"{np.mean(list(errors.values())):.4f} over {len(errors)} sites"
        )
    if "tp_bytes_compressed" in rec:
        parts.append(f"TP bytes compressed {100 * rec['tp_bytes_compressed']:.1f}%")
    bad = [site for site, n in rec.get("nonfinite", {}).items() if n]
    if bad:
        parts.append(f"non-finite at {len(bad)} sites ({bad[0]}, ...)")
    return " | ".join(parts)


def _ordered(error: float) -> float:
    return math.inf if math.isnan(error) else error  # NaN is the worst


def switch_line(step: int, new: dict[str, str], errors, budget: float, streaks) -> str:
    """The one log line of the call sites that leave their codec after measuring step `step`,
    each with the measuring steps it was over the budget on (`streaks`)."""
    moves = ", ".join(
        f"{site} ({_said(errors[site], budget)}; over at steps {_steps(streaks[site])}) -> {codec}"
        for site, codec in new.items()
    )
    return f"step {step}: over compression.error_budget={budget:g}: {moves}, from step {step + 1}"


def _steps(steps: list[int]) -> str:
    return ", ".join(str(s) for s in steps)


def _said(error: telemetry.SiteError, budget: float) -> str:
    if error.codec_nonfinite:
        return f"{error.nonfinite} non-finite values"
    return f"error {_above(error.error, budget)}"


def _above(value: float, budget: float) -> str:
    """`value` with the fewest significant digits, 4 at least, that read above `budget`:
    "0.0312", but "0.030004" where "0.03" would read as a budget of 0.03."""
    for digits in range(4, 18):
        text = f"{value:.{digits}g}"
        if float(text) > budget:
            return text
    return repr(value)


def fallback_record(step: int, new: dict[str, str], errors, streaks) -> dict[str, Any]:
    """The "comm_fallback" metrics record of the call sites that switch after step `step`, each
    with its error at `step` and the measuring steps it was over the budget on (`over_at`)."""
    sites = {
        site: {
            "codec": codec,
            "error": errors[site].error,
            "nonfinite": errors[site].nonfinite,
            "over_at": streaks[site],
        }
        for site, codec in new.items()
    }
    return {"kind": "comm_fallback", "step": step, "sites": sites}


def _history(records) -> tuple[list[int], dict[str, dict[int, float]]]:
    """The measuring steps, and per call site its error at each."""
    comm = sorted((r for r in records if r.get("kind") == "comm"), key=lambda r: r["step"])
    by_site: dict[str, dict[int, float]] = {}
    for rec in comm:
        for site, error in site_errors(rec).items():
            by_site.setdefault(site, {})[rec["step"]] = error
    return [r["step"] for r in comm], by_site


def _fallbacks(records) -> dict[str, tuple[str, int]]:
    """{call site: (its last codec, the step after which it switched)}."""
    out = {}
    for rec in sorted(
        (r for r in records if r.get("kind") == "comm_fallback"), key=lambda r: r["step"]
    ):
        for site, what in rec["sites"].items():
            out[site] = (what["codec"], rec["step"])
    return out


def figure(records: list[dict[str, Any]], budget: float | None = None):
    """The relative error by layer and op over the measuring steps: one heat map per op
    (layers down, steps across, log color), the sites outside the blocks in one more; a blank
    cell: not compressed at that step (fallen back). None without "comm" records."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.colors import LogNorm

    steps, by_site = _history(records)
    if not steps:
        return None
    layered = sorted({op_of(s) for s in by_site if layer_of(s) is not None}, key=_op_key)
    others = sorted((s for s in by_site if layer_of(s) is None), key=_op_key)
    n_layers = 1 + max((layer_of(s) for s in by_site if layer_of(s) is not None), default=-1)
    column = {step: i for i, step in enumerate(steps)}
    panels = []
    for op in layered:
        grid = np.full((n_layers, len(steps)), np.nan)
        for site, values in by_site.items():
            if op_of(site) == op:
                for step, error in values.items():
                    grid[layer_of(site), column[step]] = error
        panels.append((op, grid, [f"{i}" for i in range(n_layers)], "layer"))
    if others:
        grid = np.full((len(others), len(steps)), np.nan)
        for row, site in enumerate(others):
            for step, error in by_site[site].items():
                grid[row, column[step]] = error
        panels.append(("outside the blocks", grid, others, ""))
    finite = np.concatenate([g[np.isfinite(g) & (g > 0)] for _, g, _, _ in panels])
    low, high = (finite.min(), finite.max()) if finite.size else (1e-3, 1e-1)
    if budget is not None:
        low, high = min(low, budget), max(high, budget)
    norm = LogNorm(vmin=low, vmax=max(high, low * 1.01))
    cmap = matplotlib.colormaps["viridis"].with_extremes(bad="0.85")
    widths = [1.0] * len(layered) + ([1.6] if others else [])
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(1.5 + 2.4 * sum(widths), 3.8),
        dpi=110,
        gridspec_kw={"width_ratios": widths},
        squeeze=False,
        layout="constrained",
    )
    fig.suptitle(
        "relative error of each call site against the exact fp32 collective (gray: not compressed)",
        fontsize=9,
    )
    ticks = np.unique(np.linspace(0, len(steps) - 1, min(len(steps), 5)).round().astype(int))
    for ax, (title, grid, labels, ylabel) in zip(axes[0], panels, strict=True):
        image = ax.imshow(grid, aspect="auto", interpolation="nearest", cmap=cmap, norm=norm)
        ax.set_title(title, fontsize=9)
        ax.set_xticks(ticks, [str(steps[i]) for i in ticks], fontsize=7)
        ax.set_yticks(range(len(labels)), labels, fontsize=7 if ylabel else 6)
        ax.set_xlabel("step", fontsize=8)
        if ylabel:
            ax.set_ylabel(ylabel, fontsize=8)
    if others:  # the sites' names, on the right of their panel
        axes[0][-1].yaxis.tick_right()
    bar = fig.colorbar(image, ax=axes[0].tolist(), fraction=0.04, pad=0.02)
    bar.set_label("relative error" + ("" if budget is None else " (red: the budget)"), fontsize=8)
    if budget is not None:
        bar.ax.axhline(budget, color="red", linewidth=2)
    return fig


def write_png(records: list[dict[str, Any]], png, budget: float | None = None) -> bool:
    """`figure` as a PNG at `png`; False (nothing written) without "comm" records."""
    import matplotlib.pyplot as plt

    fig = figure(records, budget)
    if fig is None:
        return False
    fig.savefig(png, bbox_inches="tight")
    plt.close(fig)
    return True


def table(records: list[dict[str, Any]], budget: float | None = None) -> str | None:
    """The end-of-run table: per op the largest error (where and when), the mean over its
    layers and measuring steps, its non-finite values, and its call sites that fell back; then
    the share of TP bytes compressed at the first and last measuring step. None without
    "comm" records."""
    steps, by_site = _history(records)
    if not steps:
        return None
    fell = _fallbacks(records)
    nonfinite: dict[str, int] = {}
    for rec in records:
        if rec.get("kind") == "comm":
            for site, n in rec.get("nonfinite", {}).items():
                nonfinite[op_of(site)] = nonfinite.get(op_of(site), 0) + n
    ops = sorted({op_of(s) for s in by_site} | {op_of(s) for s in fell}, key=_op_key)
    budget_text = "" if budget is None else f"; budget {budget:g}"
    title = (
        f"compression error per op over {len(steps)} measuring steps ({steps[0]}-{steps[-1]}), "
        f"relative to the exact fp32 collective{budget_text}:"
    )
    cells = [
        (op, *_largest_and_mean(by_site, op), nonfinite.get(op, 0), _fell_back(fell, op))
        for op in ops
    ]
    op_width = max(len("op"), *(len(c[0]) for c in cells))
    at_width = max(len("at"), *(len(c[2]) for c in cells))
    rows = _wrapped(title)
    rows.append(
        f"  {'op':<{op_width}} {'largest':>8}  {'at':<{at_width}} {'mean':>8} "
        f"{'non-finite':>10}  fell back"
    )
    for op, largest, where, mean, bad, fallen in cells:
        row = f"  {op:<{op_width}} {largest:>8}  {where:<{at_width}} {mean:>8} {bad:>10d}  "
        rows += _wrapped(row + fallen)
    shares = [
        (r["step"], r["tp_bytes_compressed"])
        for r in records
        if r.get("kind") == "comm" and "tp_bytes_compressed" in r
    ]
    if shares:
        shares.sort()
        (first, a), (last, b) = shares[0], shares[-1]
        rows.append(
            f"  TP bytes compressed: {100 * a:.1f}% at step {first}, {100 * b:.1f}% at step {last}"
        )
    return "\n".join(rows)


def _largest_and_mean(by_site: dict[str, dict[int, float]], op: str) -> tuple[str, str, str]:
    """The table's cells of `op`: its largest error, where and when, and its mean error."""
    values = [
        (e, site, step) for site, v in by_site.items() if op_of(site) == op for step, e in v.items()
    ]
    if not values:
        return "-", "-", "-"
    worst, site, step = max(values, key=lambda v: _ordered(v[0]))
    layer = layer_of(site)
    where = f"step {step}" if layer is None else f"layer_{layer:02d}, step {step}"
    return f"{worst:.4f}", where, f"{np.mean([v[0] for v in values]):.4f}"


# The width of the table's rows: a longer one (many fallbacks of one op) goes on below.
TABLE_WIDTH = 100


def _fell_back(fell: dict[str, tuple[str, int]], op: str) -> str:
    """The table's "fell back" cell of `op`: per (codec, step) its layers, as ranges
    ("layers 0-6, 9 -> none after 4"), or "-"."""
    groups: dict[tuple[str, int], list[int | None]] = {}
    for site, (codec, step) in fell.items():
        if op_of(site) == op:
            groups.setdefault((codec, step), []).append(layer_of(site))
    parts = []
    for (codec, step), layers in sorted(groups.items(), key=lambda item: (item[0][1], item[0])):
        where = _layers(layers)
        parts.append(f"{where} -> {codec} after {step}" if where else f"{codec} after {step}")
    return "; ".join(parts) or "-"


def _layers(layers: list[int | None]) -> str:
    """ "layer_03", "layers 0-6, 9"; "" for a site outside the blocks (its op's only one)."""
    numbers = sorted(n for n in layers if n is not None)
    if not numbers:
        return ""
    if len(numbers) == 1:
        return f"layer_{numbers[0]:02d}"
    runs: list[list[int]] = []
    for n in numbers:
        if runs and n == runs[-1][-1] + 1:
            runs[-1].append(n)
        else:
            runs.append([n])
    return "layers " + ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else f"{r[0]}" for r in runs)


def _wrapped(row: str) -> list[str]:
    """`row` in lines of at most `TABLE_WIDTH` characters, those after the first indented."""
    import textwrap

    if len(row) <= TABLE_WIDTH:
        return [row]
    return textwrap.wrap(
        row,
        TABLE_WIDTH,
        subsequent_indent=" " * 6,
        break_long_words=False,
        break_on_hyphens=False,
    )


# ---------------------------------------------------------------------------------------------
# The fallbacks across a resume: they hold for the settings that chose them.

# In a checkpoint's metadata beside METADATA_KEY: the compression settings (`compression.*`, as
# configured) under which the error budget chose those fallbacks.
SETTINGS_KEY = "comm_fallbacks_settings"


def checkpoint_metadata(
    fallbacks: dict[str, str], compression, streaks: dict[str, list[int]] | None = None
) -> dict[str, Any]:
    """What a checkpoint records of the error budget: its fallbacks ({call site: codec}), the
    measuring steps over the budget in a row ({call site: [steps]}) and the `CompressionConfig`
    they were chosen under."""
    return {
        METADATA_KEY: dict(fallbacks),
        STREAKS_KEY: dict(streaks or {}),
        SETTINGS_KEY: _settings(compression),
    }


def _settings(compression) -> dict[str, Any]:
    """`compression` as a checkpoint's metadata holds it (JSON values), without `tune`, which
    says only when to time the collectives, not what they compute."""
    settings = json.loads(json.dumps(dataclasses.asdict(compression)))
    settings.pop("tune", None)
    return settings


def resumed_fallbacks(
    metadata: dict[str, Any], compression, reset: bool = False
) -> tuple[dict[str, str], str | None]:
    """The fallbacks a run resumed from a checkpoint with `metadata` takes up, and the start-up
    line that says which and why (None where the checkpoint holds none). All of them while the
    settings that chose them equal `compression`; none where any `compression.*` differs (the
    run starts from its new settings: the budget, if any, measures them afresh), where the
    checkpoint does not record those settings, or where `reset` (run.reset_fallbacks) asks."""
    fallbacks = dict(metadata.get(METADATA_KEY) or {})
    if not fallbacks:
        return {}, None
    moved = ", ".join(f"{site} -> {codec}" for site, codec in fallbacks.items())
    saved, now = metadata.get(SETTINGS_KEY), _settings(compression)
    if reset:
        why = "run.reset_fallbacks=true"
    elif saved is None:
        why = "the checkpoint does not record the compression settings that chose them"
    elif saved != now:
        changed = [k for k in sorted(saved.keys() | now.keys()) if saved.get(k) != now.get(k)]
        why = "; ".join(f"compression.{k} {saved.get(k)!r} -> {now.get(k)!r}" for k in changed)
    else:
        kept = "kept from the checkpoint: the compression settings that chose them are unchanged"
        return fallbacks, f"call sites off their codec (the error budget's, {kept}): {moved}"
    return {}, (
        f"the error budget's fallbacks saved with the checkpoint ({moved}) are dropped: {why}; "
        "every call site starts from the configured codecs"
    )


def resumed_streaks(metadata: dict[str, Any], compression, reset: bool = False) -> dict:
    """The runs of measuring steps over the budget a resumed run carries on counting: those
    saved, while the settings that measured them equal `compression` (as `resumed_fallbacks`),
    else none."""
    if reset or metadata.get(SETTINGS_KEY) != _settings(compression):
        return {}
    return dict(metadata.get(STREAKS_KEY) or {})
