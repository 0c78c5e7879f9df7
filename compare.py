"""Compare finished runs as a paper reports them: IQM and 95% intervals. Docs: docs/usage.md

    python compare.py runs/A runs/B     # a table and runs/compare__<time>.png; A: the baseline
    python compare.py runs/A runs/B --metric episode_length --output figure.png

Each run folder, of any script or a copy of one, is a variant; a sweep's folder is a variant per
grid point. From the files a run leaves (metrics.csv, summary.json, config.json; no training script
is imported) it draws each variant's training curve (the IQM over its seeds at each env step, with
the 95% interval), its final evaluation's IQM with the 95% interval, and its probability of
improvement over the first variant, and prints them as a table. The statistics are rliable's
(Agarwal et al. 2021, "Deep RL at the Edge of the Statistical Precipice") computed by scipy: the IQM
is the mean of the middle half of the runs (scipy.stats.trim_mean), an interval is the percentile
bootstrap over runs (with one task rliable's stratified bootstrap is the plain one) from a fixed
seed, and P(X > Y) + P(X = Y) / 2 for a run X of a variant and a run Y of the first is
Mann-Whitney's U divided by the number of pairs. Fewer than 3 runs give no interval.
"""

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np

FINAL_RESAMPLES = 50_000  # bootstrap draws for the final returns (the training scripts': the same)
CURVE_RESAMPLES = 2_000  # for each point of a curve (as curves.png)
SEED = 0  # the bootstrap's: the same figures every time (the training scripts' too)


class UsageError(Exception):
    """A folder that cannot be compared: one line, exit status 2."""


def iqm(samples: np.ndarray, axis: int = -1) -> np.ndarray:
    """The interquartile mean: the mean of the middle half of the runs (rliable's IQM)."""
    from scipy import stats

    return stats.trim_mean(samples, 0.25, axis=axis)


def improvement(x: np.ndarray, y: np.ndarray, axis: int = -1) -> np.ndarray:
    """P(X > Y) + P(X = Y) / 2 for a run X of x and a run Y of y: Mann-Whitney's U over pairs."""
    from scipy import stats

    return stats.mannwhitneyu(x, y, axis=axis).statistic / (x.shape[axis] * y.shape[axis])


def interval(samples: tuple, statistic, resamples: int) -> list | None:
    """The 95% percentile-bootstrap interval of statistic(*samples) over runs (the last axis),
    each sample resampled on its own; None with fewer than 3 runs in any of them."""
    from scipy import stats

    if min(sample.shape[-1] for sample in samples) < 3:
        return None
    rng = np.random.default_rng(SEED)
    found = stats.bootstrap(
        samples, statistic, n_resamples=resamples, axis=-1, method="percentile", rng=rng
    )
    return [found.confidence_interval.low, found.confidence_interval.high]


def read_run(folder: Path) -> dict:
    """A finished run folder's config, summary and metrics rows (else one line)."""
    missing = [
        n for n in ("config.json", "summary.json", "metrics.csv") if not (folder / n).is_file()
    ]
    if missing:
        raise UsageError(f"{folder} is not a finished run's folder: it has no {missing[0]}")
    summary = json.loads((folder / "summary.json").read_text())
    if "env" not in summary:
        raise UsageError(f"{folder}: its summary.json names no env (a run of an older version)")
    with (folder / "metrics.csv").open() as file:
        rows = list(csv.DictReader(file))
    config = json.loads((folder / "config.json").read_text())
    return {"config": config, "summary": summary, "rows": rows}


def variants(folder: Path, run: dict, metric: str) -> list[dict]:
    """The folder's variants: itself, or each grid point of its sweep. Each has its label, its
    final returns (one per seed) and its curve: env steps, and the metric [chunks, seeds]."""
    summary = run["summary"]
    num_runs = len(summary["final_returns"])
    num_seeds = run["config"]["num_seeds"]  # runs: grid point major, then seed (metrics.csv too)
    if metric not in run["rows"][0]:
        raise UsageError(f"{folder}: its metrics.csv has no column {metric}")
    rows = np.array([[row["env_steps"], row[metric] or "nan"] for row in run["rows"]], float)
    rows = rows.reshape(-1, num_runs, 2)  # [chunks, runs, (env steps, metric)]
    points = summary["sweep"] or [{"final_returns": summary["final_returns"]}]
    found = []
    for index, point in enumerate(points):
        swept = [f"{name}={value}" for name, value in point.items() if name in run["rows"][0]]
        seeds = slice(index * num_seeds, (index + 1) * num_seeds)
        found.append(
            {
                "label": " ".join([folder.name, *swept]),
                "finals": np.array(point["final_returns"]),
                "steps": rows[:, seeds.start, 0],
                "curve": rows[:, seeds, 1],
            }
        )
    return found


def compare(folders: list[Path], metric: str) -> tuple[list[dict], str]:
    """Every folder's variants with their statistics, the first the baseline; the task's name.
    Folders of different tasks are refused."""
    runs = [read_run(folder) for folder in folders]
    tasks = [run["summary"]["env"] for run in runs]
    if len(set(tasks)) > 1:
        other = next(index for index, task in enumerate(tasks) if task != tasks[0])
        found = f"{folders[other]} is {tasks[other]}, {folders[0]} {tasks[0]}"
        raise UsageError(f"{found}: compare runs of one task")
    found = [
        v for folder, run in zip(folders, runs, strict=True) for v in variants(folder, run, metric)
    ]
    baseline = found[0]["finals"]
    for variant in found:
        finals = variant["finals"]
        variant["iqm"] = iqm(finals)
        variant["iqm_ci"] = interval((finals,), iqm, FINAL_RESAMPLES)
        variant["improvement"] = improvement(finals, baseline)
        variant["improvement_ci"] = interval((finals, baseline), improvement, FINAL_RESAMPLES)
    return found, tasks[0]


def shown(bounds: list | None, digits: int = 1) -> str:
    return f"[{bounds[0]:.{digits}f}, {bounds[1]:.{digits}f}]" if bounds else "none (< 3 runs)"


def table(found: list[dict]) -> list[str]:
    """A line per variant: its runs, mean ± std, IQM and interval, improvement over the first."""
    lines = [
        f"variant | runs | mean ± std | IQM | 95% CI | P(better than {found[0]['label']}) | 95% CI"
    ]
    for variant in found:
        finals = variant["finals"]
        cells = [variant["label"], str(len(finals)), f"{finals.mean():.1f} ± {finals.std():.1f}"]
        cells += [f"{variant['iqm']:.1f}", shown(variant["iqm_ci"])]
        cells += [f"{variant['improvement']:.2f}", shown(variant["improvement_ci"], 2)]
        lines.append(" | ".join(cells))
    return lines


def draw(found: list[dict], task: str, metric: str, path: Path) -> None:
    """The curves with their intervals; the final IQMs with theirs; each P(improvement)."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import EngFormatter

    figure = Figure(figsize=(15, 2.5 + 0.4 * len(found)), layout="constrained")
    curves, finals, better = figure.subplots(1, 3, width_ratios=[2, 1, 1])
    labels = [variant["label"] for variant in found]
    for index, variant in enumerate(found):
        color = f"C{index % 10}"
        whole = np.isfinite(variant["curve"]).all(axis=1)  # the chunks where every seed has one
        steps, values = variant["steps"][whole], variant["curve"][whole]
        curves.plot(steps, iqm(values), color=color, label=variant["label"])
        if bounds := interval((values,), iqm, CURVE_RESAMPLES):
            curves.fill_between(steps, *bounds, color=color, alpha=0.25)
        for axis, name in ((finals, "iqm"), (better, "improvement")):
            bounds = variant[f"{name}_ci"] or [variant[name]] * 2  # (no interval: a point)
            axis.plot(bounds, [index] * 2, color=color, lw=6, alpha=0.5, solid_capstyle="butt")
            axis.plot(variant[name], index, "|", color="black", ms=14)
    curves.set(title=f"{task}: {metric}, IQM over seeds and 95% interval", xlabel="env steps")
    curves.xaxis.set_major_formatter(EngFormatter(sep=""))
    curves.legend(fontsize=8)
    finals.set(
        title="final return: IQM, 95% interval", yticks=range(len(found)), yticklabels=labels
    )
    finals.invert_yaxis()
    better.set(title=f"P(better than {labels[0]})", yticks=[], xlim=(0, 1))
    better.axvline(0.5, ls="--", c="gray")
    better.invert_yaxis()
    figure.savefig(path, dpi=100)


def main(args: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "folders", nargs="+", type=Path, help="finished run folders; the first: the baseline"
    )
    parser.add_argument("--metric", default="episode_return", help="the curves' metrics.csv column")
    parser.add_argument(
        "--output", type=Path, help="the figure (default: runs/compare__<time>.png)"
    )
    parsed = parser.parse_args(args)
    output = parsed.output or Path("runs") / f"compare__{int(time.time())}.png"  # git ignores runs/
    try:
        found, task = compare(parsed.folders, parsed.metric)
    except UsageError as error:
        print(f"compare.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    print(f"{task}, final evaluation returns:", *table(found), sep="\n")
    output.parent.mkdir(parents=True, exist_ok=True)
    draw(found, task, parsed.metric, output)
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
