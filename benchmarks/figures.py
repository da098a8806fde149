"""The figures of BENCHMARKS.md and README.md, drawn from the records by `benchmarks.tables`.

Each is a declaration of `FIGURES`: the records it reads (the tuples of `tables`: a new record
is one line there) and the function that draws them (matplotlib, Agg) into docs/figures/.
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
from collections.abc import Callable

from benchmarks import tables

FIGURES_DIR = tables.REPO / "docs" / "figures"


@dataclasses.dataclass(frozen=True)
class Figure:
    """records: file names; draw(records, figure): draws them on a matplotlib figure."""

    records: tuple[str, ...]
    draw: Callable[[list[dict], object], None]
    inches: tuple[float, float]


def band(ax, x, mid, lo, hi, label: str, style: str = "-", color=None) -> None:
    (line,) = ax.plot(x, mid, style, color=color, label=label, ms=4)
    ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.2, lw=0)


def over_seeds(ax, x, ys: list[list[float]], label: str, color=None) -> None:
    """The mean of the series `ys` (one a seed), shaded over their range."""
    columns = list(zip(*ys, strict=True))
    mean = [statistics.mean(v) for v in columns]
    band(ax, x, mean, list(map(min, columns)), list(map(max, columns)), label, color=color)


def draw_convergence(records: list[dict], fig, codecs=("taco", "int6_hadamard")) -> None:
    """TP = 4 and 8: validation loss over the steps of bf16 and each codec (the mean over
    seeds, their range shaded), and each codec's over the bf16 run of its seed (%)."""
    runs, curve = tables.runs_of(records), lambda run: [v for _, v in run["val_curve"]]
    for col, layout in enumerate(("tp4", "tp8")):
        top, bottom = fig.add_subplot(2, 2, 1 + col), fig.add_subplot(2, 2, 3 + col)
        both = {codec: tables.pairs(runs, layout, codec) for codec in codecs}
        bf16 = {s: base for seeds in both.values() for s, (_, base) in seeds.items()}
        steps = [s for s, _ in next(iter(bf16.values()))["val_curve"]]
        over_seeds(top, steps, [curve(r) for r in bf16.values()], f"bf16, {len(bf16)} seeds")
        for color, (codec, seeds) in enumerate(both.items(), start=1):
            label, c = f"{codec}, {len(seeds)} seeds", f"C{color}"
            over_seeds(top, steps, [curve(r) for r, _ in seeds.values()], label, color=c)
            diffs = [
                [100 * (a / b - 1) for a, b in zip(curve(r), curve(base), strict=True)]
                for r, base in seeds.values()
            ]
            over_seeds(bottom, steps, diffs, label, color=c)
        top.set(title=tables.layout_name(layout), ylabel="validation loss")
        bottom.axhline(0, color="C0", lw=0.8)
        bottom.set(xlabel="step", ylabel="over its seed's bf16 run (%)")
        top.legend(fontsize=8)


def draw_kernels(records: list[dict], fig) -> None:
    """Per op: bandwidth over an XLA copy's against the message, per record and peer count, of
    the registry's kernel (and Triton's, Mosaic's where timed), the interval shaded."""
    rows = sorted(tables.kernel_sizes(records), key=lambda r: r["b"]["bytes"])
    lines = dict.fromkeys((r["record"]["name"], r["codec"], r["peers"]) for r in rows)
    axes = fig.subplots(1, len(tables.OPS), sharey=True)
    for ax, (op, title) in zip(axes, tables.OPS.items(), strict=True):
        for color, (name, codec, peers) in enumerate(lines):
            for kernel, style in ((op, "o-"), (f"{op}_triton", "s:"), (f"{op}_mosaic", "^--")):
                mine = [r for r in rows if (r["record"]["name"], r["peers"]) == (name, peers)]
                points = [
                    (r["b"]["bytes"] / 2**20, r["b"][kernel]) for r in mine if kernel in r["b"]
                ]
                if points:
                    x, ops = zip(*points, strict=True)
                    ys = [[100 * v["in_program_of_copy"] for v in ops]]
                    ys += [[100 * v["of_copy_interval"][i] for v in ops] for i in (0, 1)]
                    label = f"{codec}, {peers} peers, {kernel.removeprefix(op)[1:] or 'registry'}"
                    band(ax, x, *ys, label, style, color=f"C{color}")
        ax.set(title=title, xscale="log", xlabel="message (MiB of bf16)")
    fig.axes[0].set(ylabel="% of an XLA copy's bandwidth")
    fig.axes[0].legend(fontsize=7)


FIGURES = {
    "convergence": Figure(tables.CONVERGENCE, draw_convergence, (10, 6)),
    "kernels": Figure(tables.KERNELS, draw_kernels, (12, 3.5)),
}


def draw(name: str, records: tables.Records, out_dir=FIGURES_DIR) -> pathlib.Path:
    """Draws figure `name` from its records into `out_dir`/`name`.png."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure = FIGURES[name]
    fig = plt.figure(figsize=figure.inches, layout="constrained")
    figure.draw([records(n) for n in figure.records], fig)
    path = pathlib.Path(out_dir) / f"{name}.png"
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=72, metadata={"Software": None})
    plt.close(fig)
    return path
