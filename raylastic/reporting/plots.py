"""``--plots DIR``: three PNGs from a :class:`~raylastic.reporting.model.RunReport`.

- ``world_size.png``: world size over time; losses (red crosses and dashed lines: the
  report's recoveries) and graceful resizes (blue dotted lines, planned moves included).
- ``loss.png``: the loss vs step and vs wall time; re-trained reports in grey, resizes marked.
- ``cost.png``: cumulative cost vs the on-demand baseline (node-hours when prices are unknown).

Uses matplotlib's object API with the Agg canvas: no pyplot, no global backend switch,
so it is safe inside a Jupyter kernel or a headless job.
"""

from __future__ import annotations

import os
from typing import List, Tuple

from raylastic.reporting.records import RunReport

FILES = ("world_size.png", "loss.png", "cost.png")
_FAIL, _RESIZE, _KEPT, _REDONE = "tab:red", "tab:blue", "tab:green", "0.7"


def write_plots(report: RunReport, out_dir: str) -> List[str]:
    """Write the PNGs into ``out_dir`` (created) and return their paths."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise RuntimeError("--plots needs matplotlib: pip install 'raylastic[report]'") from None
    os.makedirs(out_dir, exist_ok=True)
    paths = []
    for name, draw in zip(FILES, (_world_size, _loss, _cost)):
        fig = Figure(figsize=(10, 4.8) if name != "loss.png" else (12, 4.8), dpi=100)
        FigureCanvasAgg(fig)
        draw(fig, report)
        fig.tight_layout()
        path = os.path.join(out_dir, name)
        fig.savefig(path, format="png")
        paths.append(path)
    return paths


def _title(report: RunReport, what: str) -> str:
    name = report.run_path.rstrip("/").rsplit("/", 1)[-1] or report.run_path
    return f"{what} - {name}"


def _marks(ax, report: RunReport, *, by_step: bool = False) -> None:
    """Vertical lines at failures and graceful resizes (at their time, or at the step the
    old group reached)."""
    labelled = set()
    for x in report.recoveries:
        pos = x.reached_index if by_step else x.at_s
        if pos is None:
            continue
        label = None if "failure" in labelled else "failure / preemption"
        labelled.add("failure")
        ax.axvline(pos, color=_FAIL, ls="--", lw=1.2, label=label)
    for z in report.resizes:
        if not z.graceful:
            continue
        pos = z.reached_index if by_step else z.at_s
        if pos is None:
            continue
        label = None if "resize" in labelled else "graceful resize"
        labelled.add("resize")
        ax.axvline(pos, color=_RESIZE, ls=":", lw=1.4, label=label)


def failure_crosses(report: RunReport) -> List[Tuple[float, int]]:
    """(t_s, world size before) of the red crosses in world_size.png: one per recovery,
    i.e. per loss. A planned move (a worker released or moved off a draining node) is a
    graceful resize, drawn as a blue line, never as a cross."""
    return [(x.at_s, x.world_size_before) for x in report.recoveries if x.world_size_before is not None]


def _world_size(fig, report: RunReport) -> None:
    ax = fig.add_subplot(1, 1, 1)
    xs, ys = [0.0], [0]
    for s in report.world_size_timeline:
        xs += [s.start_s, s.start_s, s.end_s, s.end_s]
        ys += [ys[-1], s.world_size, s.world_size, 0]
    end = report.end_ts - report.start_ts
    xs.append(max(end, xs[-1]))
    ys.append(ys[-1])
    ax.plot(xs, ys, color="black", lw=2, label="world size")
    ax.fill_between(xs, ys, step=None, color="0.85")
    for at_s, world_size in failure_crosses(report):
        ax.plot([at_s], [world_size], "x", color=_FAIL, ms=10, mew=2)
    _marks(ax, report)
    top = max([s.world_size for s in report.world_size_timeline] + [1])
    ax.set_ylim(0, top + 0.5)
    ax.yaxis.get_major_locator().set_params(integer=True)
    ax.set_xlim(0, max(end, 1e-9))
    ax.set_xlabel("wall time since run start (s)")
    ax.set_ylabel("workers")
    n_rec, n_res = len(report.recoveries), sum(z.graceful for z in report.resizes)
    ax.set_title(
        _title(
            report,
            f"World size: {_n(n_rec, 'recovery', 'recoveries')}, {_n(n_res, 'graceful resize', 'graceful resizes')}",
        )
    )
    ax.legend(loc="lower right")
    ax.grid(alpha=0.3)


def _n(count: int, one: str, many: str) -> str:
    return f"{count} {one if count == 1 else many}"


def _broken(xs: List[float], ys: List[float], cuts: List[float]):
    """Insert NaN gaps so a line does not bridge a recovery or resize at ``cuts``."""
    out_x, out_y = [], []
    for k, (x, y) in enumerate(zip(xs, ys)):
        if k and any(xs[k - 1] < c <= x for c in cuts):
            out_x.append(float("nan"))
            out_y.append(float("nan"))
        out_x.append(x)
        out_y.append(y)
    return out_x, out_y


def _loss(fig, report: RunReport) -> None:
    pts = report.series.loss
    key = report.series.loss_key
    axes = [fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)]
    for ax, by_step in zip(axes, (True, False)):
        if not pts:
            ax.text(0.5, 0.5, f"no '{key}' metric was reported", ha="center", va="center", transform=ax.transAxes)
        else:
            x = (lambda p: p[1]) if by_step else (lambda p: p[0])  # noqa: E731
            kept = [p for p in pts if p[3]]
            redone = [p for p in pts if not p[3]]
            if redone:
                ax.plot(
                    [x(p) for p in redone],
                    [p[2] for p in redone],
                    ".",
                    color=_REDONE,
                    label="re-trained after a recovery",
                )
            cuts = [] if by_step else [r.at_s for r in report.recoveries] + [z.at_s for z in report.resizes]
            kept.sort(key=x)
            ax.plot(*_broken([x(p) for p in kept], [p[2] for p in kept], cuts), "-", color=_KEPT, lw=1.2, label="kept")
            values = [p[2] for p in pts]
            if min(values) > 0 and max(values) / min(values) > 100:
                ax.set_yscale("log")
            _marks(ax, report, by_step=by_step)
            ax.legend(loc="upper right", fontsize="small")
        ax.set_xlabel("step (report index)" if by_step else "wall time since run start (s)")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
    axes[0].set_title(_title(report, f"{key} vs step"))
    axes[1].set_title(_title(report, f"{key} vs wall time"))


def _cost(fig, report: RunReport) -> None:
    ax = fig.add_subplot(1, 1, 1)
    pts = report.series.cost
    known = pts and pts[-1][2] is not None
    if not pts:
        ax.text(0.5, 0.5, "no node held a worker slot", ha="center", va="center", transform=ax.transAxes)
    elif known:
        ax.plot(
            [p[0] for p in pts], [p[2] for p in pts], color="black", lw=2, label=f"cost ({report.cost_usd:.4f} USD)"
        )
        if pts[-1][3] is not None:
            ax.plot(
                [p[0] for p in pts],
                [p[3] for p in pts],
                color="tab:orange",
                lw=2,
                ls="--",
                label=f"on-demand baseline: kept work priced on {report.on_demand_type} "
                f"({report.on_demand_cost_usd:.4f} USD)",
            )
        ax.set_ylabel("cumulative USD")
    else:
        ax.plot(
            [p[0] for p in pts],
            [p[1] for p in pts],
            color="black",
            lw=2,
            label="node-hours (prices unknown: pass --prices)",
        )
        ax.set_ylabel("cumulative node-hours")
    _marks(ax, report)
    ax.set_xlabel("wall time since run start (s)")
    saved = ""
    if report.savings_usd is not None:
        saved = f": savings {report.savings_usd:.4f} USD"
        if report.savings_pct is not None:
            saved += f" ({report.savings_pct:.1f} %)"
    ax.set_title(_title(report, "Cumulative cost vs on-demand baseline" + saved))
    if pts:
        ax.legend(loc="upper left")
    ax.grid(alpha=0.3)
