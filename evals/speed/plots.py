"""PNG plots of a `quantkit bench` report (the dict `run_bench` returns, or its --json file).

    python -m quantkit.evals.speed.plots BENCH.json OUT_DIR

- `roofline.png`: the device's roofline (bandwidth slope, compute roof, ridge point) with the
  measured decode steps at each batch size placed on it.
- `throughput_vs_tpot.png`: output tok/s against TPOT p50 and p99 across batch caps, static and
  continuous batching.
- `chunked_prefill_cdf.png`: TTFT and TPOT distributions (CDFs) of the long-prompt workload
  without and with chunked prefill.

Every number drawn is read from the report, so the pictures match its table. matplotlib is an
optional dependency (the `bench` extra), imported only here, with the object API (no pyplot
global state).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from quantkit.errors import EvalError, MissingExtraError
from quantkit.evals.common import run_main
from quantkit.paths import atomic_file

__all__ = [
    "plot_chunked_cdf",
    "plot_roofline",
    "plot_throughput_tpot",
    "require_matplotlib",
    "write_plots",
]


def require_matplotlib() -> None:
    """Raise MissingExtraError (naming the extra) unless matplotlib can be imported."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MissingExtraError("matplotlib", "bench") from None


def _figure(width: float = 7.0, height: float = 5.0) -> Any:
    require_matplotlib()
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), dpi=110, layout="constrained")


def _save(fig: Any, path: Path) -> Path:
    """savefig to a temporary file beside `path`, then rename: never half a PNG."""
    with atomic_file(path, suffix=".png") as tmp:
        fig.savefig(tmp, format="png")
    return path


def plot_roofline(report: dict[str, Any], path: Path) -> Path | None:
    """None when the report has no bandwidth (a GPU missing from the table) or no points."""
    roof = report["roofline"]
    bandwidth, peak, points = roof.get("bandwidth"), roof.get("peak_flop_s"), roof["points"]
    if not bandwidth or not peak or not points:
        return None
    ridge = peak / bandwidth
    xs = [p["intensity"] for p in points]
    lo = min(min(xs) / 4, ridge / 20)
    hi = max(max(xs) * 4, ridge * 8)
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(
        [lo, ridge],
        [bandwidth * lo, peak],
        color="tab:blue",
        lw=2,
        label=f"bandwidth slope: {bandwidth / 1e9:.1f} GB/s ({roof.get('bandwidth_source')})",
    )
    ax.plot(
        [ridge, hi],
        [peak, peak],
        color="tab:red",
        lw=2,
        label=f"compute roof: {peak / 1e9:,.0f} GFLOP/s ({roof.get('flops_source')})",
    )
    ax.axvline(ridge, color="gray", ls="--", lw=1, label=f"ridge point: {ridge:.1f} FLOP/byte")
    ys = [p["flop_s"] for p in points]
    ax.scatter(xs, ys, color="tab:orange", zorder=3, label="measured decode steps")
    for i, p in enumerate(points):  # labels alternate below/above: neighbours sit close
        ax.annotate(
            f"B={p['batch']}\n{p['tok_s']:.0f} tok/s",
            (p["intensity"], p["flop_s"]),
            textcoords="offset points",
            xytext=(5, -22 if i % 2 == 0 else 8),
            fontsize=8,
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo, hi)
    ax.set_ylim(min(min(ys), bandwidth * lo) / 2, peak * 3)
    ax.set_xlabel("arithmetic intensity (FLOP / byte read)")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"Decode on the roofline: {roof.get('name')} ({roof.get('dtype')})")
    ax.legend(fontsize=8, loc="lower right")  # the points sit left of and under the roof
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path)


def _rate(rate: float | str) -> str:
    return rate if isinstance(rate, str) else f"{rate:g}"


def plot_throughput_tpot(report: dict[str, Any], path: Path) -> Path | None:
    """One panel per arrival rate: throughput against TPOT p50 (filled) and p99 (hollow), a
    line per mode through its batch caps."""
    base = [
        r
        for r in report["records"]
        if not r["long_prompts"] and r["throughput_tok_s"] and r["tpot_ms_p50"] is not None
    ]
    if not base:
        return None
    rates = list(dict.fromkeys(r["rate"] for r in base))
    fig = _figure(6.0 * len(rates), 5.0)
    axes = fig.subplots(1, len(rates), squeeze=False)[0]
    colors = {"continuous": "tab:blue", "static": "tab:green"}
    for ax, rate in zip(axes, rates, strict=True):
        here = [r for r in base if r["rate"] == rate]
        x_max = 1.15 * max(r["tpot_ms_p99"] or r["tpot_ms_p50"] for r in here)
        y_max = 1.15 * max(r["throughput_tok_s"] for r in here)
        for mode in dict.fromkeys(r["mode"] for r in base):
            rows = sorted(
                (r for r in base if r["mode"] == mode and r["rate"] == rate),
                key=lambda r: r["batch_cap"],
            )
            if not rows:
                continue
            color = colors.get(mode, "black")
            y = [r["throughput_tok_s"] for r in rows]
            for q, marker, line in ((50, "o", "-"), (99, "s", "--")):
                ax.plot(
                    [r[f"tpot_ms_p{q}"] for r in rows],
                    y,
                    ls=line,
                    marker=marker,
                    color=color,
                    mfc=color if q == 50 else "none",
                    label=f"{mode}: TPOT p{q}",
                )
            points = [(r["tpot_ms_p50"], r["throughput_tok_s"], r["batch_cap"]) for r in rows]
            for (x, y), caps in _merge_close(points, x_max / 40, y_max / 40):
                ax.annotate(
                    "cap " + ", ".join(str(c) for c in caps),
                    (x, y),
                    textcoords="offset points",
                    xytext=(4, 4 if mode == "continuous" else -12),
                    fontsize=8,
                    color=color,
                )
        # From zero: an arrival-bound panel would otherwise magnify a 0.1% difference.
        ax.set_xlim(0, x_max)
        ax.set_ylim(0, y_max)
        ax.set_xlabel("TPOT (ms between tokens; filled p50, hollow p99)")
        ax.set_ylabel("throughput (output tok/s)")
        load = "all requests at t=0" if _rate(rate) == "inf" else f"Poisson {_rate(rate)} req/s"
        ax.set_title(f"arrivals: {load}", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(True, alpha=0.3)
    fig.suptitle("Bigger batches: more throughput, slower tokens for each user", fontsize=11)
    return _save(fig, path)


def _merge_close(
    points: list[tuple[float, float, int]], dx: float, dy: float
) -> list[tuple[tuple[float, float], list[int]]]:
    """(x, y, cap) points -> one label position per cluster of points closer than (dx, dy),
    with every cap in it: caps whose points coincide (an arrival-bound rate) share a label
    instead of printing over each other."""
    groups: list[tuple[tuple[float, float], list[int]]] = []
    for x, y, cap in points:
        near = next((g for g in groups if abs(g[0][0] - x) <= dx and abs(g[0][1] - y) <= dy), None)
        if near is None:
            groups.append(((x, y), [cap]))
        else:
            near[1].append(cap)
    return groups


def _cdf(ax: Any, values: list[float], label: str, color: str) -> None:
    """The empirical CDF as a staircase from 0 (before the smallest sample) to 1."""
    xs = sorted(values)
    n = len(xs)
    ys = [0.0, *((i + 1) / n for i in range(n))]
    ax.step([xs[0], *xs], ys, where="post", label=label, color=color)


def _plain_log_axis(axis: Any) -> None:
    """Log scale labelled 20, 50, 100 ms: no 2x10^1 labels crowding a short range."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    axis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
    axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    axis.set_minor_formatter(NullFormatter())


def plot_chunked_cdf(report: dict[str, Any], path: Path) -> Path | None:
    records = report["records"]
    off = next((r for r in records if r["long_prompts"] and not r["chunked_prefill"]), None)
    on = next((r for r in records if r["long_prompts"] and r["chunked_prefill"]), None)
    if off is None or on is None:
        return None
    fig = _figure(11, 4.5)
    left, right = fig.subplots(1, 2)
    runs = (
        (off, "whole prompts", "tab:red"),
        (on, f"chunked, {on['chunk']} tokens/step", "tab:blue"),
    )
    for rec, label, color in runs:
        ttft, tpot = rec["samples"]["ttft_ms"], rec["samples"]["tpot_ms"]
        _cdf(left, ttft, f"{label} (p99 {_fmt(rec['ttft_ms_p99'])} ms)", color)
        _cdf(right, tpot, f"{label} (p99 {_fmt(rec['tpot_ms_p99'])} ms)", color)
    left.set_xlabel("TTFT (ms)")
    right.set_xlabel("TPOT: gap between consecutive tokens (ms)")
    right.set_xscale("log")
    _plain_log_axis(right.xaxis)
    for ax in (left, right):
        ax.set_ylabel("fraction of samples")
        ax.axhline(0.99, color="gray", ls=":", lw=1)
        ax.legend(fontsize=8, loc="lower right")
        ax.grid(True, alpha=0.3)
    fig.suptitle(
        f"Chunked prefill with long prompts arriving (cap {on['batch_cap']}, rate "
        f"{_rate(on['rate'])}): "
        f"{on['workload']}",
        fontsize=9,
    )
    return _save(fig, path)


def _fmt(value: float | None) -> str:
    """Milliseconds as the table prints them: 3 significant digits, never an exponent."""
    if value is None or math.isnan(value):
        return "n/a"
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def write_plots(report: dict[str, Any], out_dir: Path) -> list[Path]:
    """Write every plot the report has data for into `out_dir`; return their paths."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    made = [
        plot_roofline(report, out_dir / "roofline.png"),
        plot_throughput_tpot(report, out_dir / "throughput_vs_tpot.png"),
        plot_chunked_cdf(report, out_dir / "chunked_prefill_cdf.png"),
    ]
    return [p for p in made if p is not None]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m quantkit.evals.speed.plots")
    parser.add_argument("report", type=Path, help="a `quantkit bench --json` file")
    parser.add_argument("out_dir", type=Path)
    args = parser.parse_args(argv)
    try:
        report = json.loads(args.report.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise EvalError(f"report: expected a quantkit bench JSON file, got {e}") from None
    for path in write_plots(report, args.out_dir):
        print(path)


if __name__ == "__main__":
    run_main(main)
