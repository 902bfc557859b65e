"""Draws a benchmark's JSON as a PNG: grouped bars of its metric per shape, with the measured
ceilings and targets as horizontal lines, and (when the JSON names a baseline) a second panel of
time relative to that baseline.

    python benchmarks/plot.py results.json [--png results.png]

The JSON's "plot" entry says what to draw: metric (a rate, higher is faster, e.g. eff_tb_s), ylabel,
lines {name: value}, series [[legend label, source]] where source is a column name or "@key" for the
column named by row["summary"][key], and optionally relative_to [label, source]. A column's value
is taken at its faster timing: plain launch or CUDA-graph replay.
"""

from __future__ import annotations

import argparse
import json
import pathlib


def column_of(row: dict, source: str) -> dict:
    if source.startswith("@"):
        name = row.get("summary", {}).get(source[1:])
        return row["columns"].get(name, {}) if name else {}
    return row["columns"].get(source, {})


def best_value(column: dict, key: str, better=max) -> float:
    """The better of a column's launch and graph values of key (NaN when neither was measured)."""
    values = [t[key] for t in (column, column.get("graph", {})) if key in t]
    return better(values) if values else float("nan")


def series_values(rows: list[dict], source: str, key: str, better=max) -> list[float]:
    return [best_value(column_of(row, source), key, better) for row in rows]


def draw_bars(ax, labels: list[str], series: dict[str, list[float]]) -> None:
    width = 0.8 / max(1, len(series))
    for i, (name, values) in enumerate(series.items()):
        ax.bar([x + (i - (len(series) - 1) / 2) * width for x in range(len(labels))], values, width, label=name)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.grid(axis="y", alpha=0.3)


def plot_results(payload: dict, png: pathlib.Path) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    spec, rows = payload["plot"], payload["rows"]
    labels = [row["label"] for row in rows]
    series = {label: series_values(rows, source, spec["metric"]) for label, source in spec["series"]}
    relative_to = spec.get("relative_to")
    panels = 2 if relative_to else 1
    fig, axes = plt.subplots(panels, 1, figsize=(max(8.0, 0.7 * len(rows) + 3), 4.5 * panels), squeeze=False)
    ax = axes[0][0]
    draw_bars(ax, labels, series)
    for i, (name, value) in enumerate(spec.get("lines", {}).items()):
        ax.axhline(value, linestyle="--", linewidth=1, color=f"C{len(series) + i}", label=f"{name} ({value:.2f})")
    ax.set_ylabel(spec["ylabel"])
    device = payload.get("device", {}).get("name", "?")
    ax.set_title(f"{payload['benchmark']} on {device}")
    ax.legend(fontsize=7, ncol=2)
    if relative_to:
        base_label, base_source = relative_to
        base = series_values(rows, base_source, "median_us", min)
        ratios = {label: [t / b for t, b in zip(series_values(rows, source, "median_us", min), base)]
                  for label, source in spec["series"]}
        ax = axes[1][0]
        draw_bars(ax, labels, ratios)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_yscale("log")  # the naive path can be 10x slower while the target ratio is ~0.5
        ax.set_ylabel(f"time / {base_label} time (log; lower is faster)")
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("json", type=pathlib.Path)
    parser.add_argument("--png", type=pathlib.Path, help="output path (default: the JSON's with .png)")
    args = parser.parse_args()
    png = args.png or args.json.with_suffix(".png")
    plot_results(json.loads(args.json.read_text()), png)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
