"""compare.py on run folders as the training scripts leave them (written here by hand: nothing is
trained): its table's IQM and intervals are the scripts' own estimates, its probability of
improvement is the count of pairs by hand, it draws the figure, and what it cannot compare it
refuses in one line."""

import csv
import json
from pathlib import Path

import numpy as np
import pytest

import compare
import sac_pendulum


def write_run(folder: Path, finals: list, env: str = "Pendulum-v1", sweep: list | None = None):
    """A finished run's three files: `finals` per run (grid point major, then seed), 3 chunks."""
    folder.mkdir()
    points = sweep or [{}]
    num_seeds = len(finals) // len(points)
    (folder / "config.json").write_text(json.dumps({"num_seeds": num_seeds, "sweep": None}))
    report = [
        point | {"final_returns": finals[index * num_seeds : (index + 1) * num_seeds]}
        for index, point in enumerate(points)
    ]
    summary = {"env": env, "final_returns": finals, "sweep": report if sweep else None}
    (folder / "summary.json").write_text(json.dumps(summary))
    with (folder / "metrics.csv").open("w") as file:
        writer = csv.DictWriter(file, ["seed", *points[0], "env_steps", "episode_return"])
        writer.writeheader()
        for chunk in range(1, 4):
            for run, final in enumerate(finals):
                point = points[run // num_seeds]
                returns = float("nan") if chunk == 1 and run == 0 else final * chunk / 3
                row = {"seed": 1 + run % num_seeds, **point, "env_steps": 100 * chunk}
                writer.writerow(row | {"episode_return": returns})


def test_the_table_holds_iqm_intervals_and_the_probability_of_improvement(tmp_path, capsys):
    baseline, swept = [0.0, 1.0, 2.0, 10.0], [1.0, 2.0, 3.0, 11.0, 4.0, 5.0, 6.0, 7.0]
    write_run(tmp_path / "a", baseline)
    write_run(tmp_path / "b", swept, sweep=[{"gamma": 0.9}, {"gamma": 0.99}])
    write_run(tmp_path / "c", [3.0, 4.0])
    figure = tmp_path / "compare.png"
    folders = [str(tmp_path / name) for name in "abc"]
    compare.main([*folders, "--output", str(figure)])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "Pendulum-v1, final evaluation returns:"
    assert lines[1] == "variant | runs | mean ± std | IQM | 95% CI | P(better than a) | 95% CI"
    rows = [line.split(" | ") for line in lines[2:6]]
    variants = [["a", "4"], ["b gamma=0.9", "4"], ["b gamma=0.99", "4"], ["c", "2"]]
    assert [row[:2] for row in rows] == variants
    ours = sac_pendulum.report_cells(sac_pendulum.estimates(np.array(baseline)))
    assert rows[0][2:5] == [ours[0], ours[2], ours[3]]  # the scripts' estimates, the same seed
    # b gamma=0.9 against a, pair by pair: 1 beats 0 and ties 1; 2 beats 0, 1 and ties 2; 3 beats
    # three; 11 beats four: (10 + 2 / 2) / 16
    assert rows[1][5] == f"{11 / 16:.2f}" and rows[0][5] == "0.50"  # the baseline: a tie
    assert rows[3][4] == rows[3][6] == "none (< 3 runs)"  # 2 runs: no interval
    assert lines[-1] == f"wrote {figure}" and figure.stat().st_size > 0


def test_the_figure_goes_under_runs_unless_named(tmp_path, monkeypatch, capsys):
    """Run from a clone's root, the figure lands in runs/ (which git ignores), not by the code."""
    (tmp_path / "runs").mkdir()
    write_run(tmp_path / "runs" / "a", [1.0, 2.0, 3.0])
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(compare.time, "time", lambda: 1796475063.5)
    compare.main(["runs/a"])
    assert capsys.readouterr().out.splitlines()[-1] == "wrote runs/compare__1796475063.png"
    assert sorted(path.name for path in tmp_path.iterdir()) == ["runs"]
    assert (tmp_path / "runs" / "compare__1796475063.png").stat().st_size > 0


def test_folders_it_cannot_compare_are_refused_in_one_line(tmp_path, capsys):
    write_run(tmp_path / "pendulum", [1.0, 2.0, 3.0])
    write_run(tmp_path / "cartpole", [500.0, 500.0, 500.0], env="CartPole-v1")
    (tmp_path / "empty").mkdir()
    for folders, message in [
        (
            ["pendulum", "cartpole"],
            "is CartPole-v1, " + f"{tmp_path / 'pendulum'} Pendulum-v1: compare runs of one task",
        ),
        (["pendulum", "empty"], "empty is not a finished run's folder: it has no config.json"),
    ]:
        with pytest.raises(SystemExit) as exit_:
            compare.main([str(tmp_path / folder) for folder in folders])
        error = capsys.readouterr().err
        assert exit_.value.code == 2 and len(error.splitlines()) == 1, error
        assert error.startswith("compare.py: error: ") and message in error
