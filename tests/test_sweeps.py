"""--sweep in every training script: what can be swept really is traced, bad grids are one-line
usage errors before anything compiles, a grid point's run is the single command's run, and the
sweep's report (summary.json and a printed table), checkpoint and --eval-only hold every run."""

import csv
import functools
import importlib
import itertools
import json
import subprocess
from pathlib import Path

import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_ppo_cartpole  # tests/ is on the path: pytest prepends it
import test_sac_pendulum
from conftest import forced_cpu_devices, in_process, run_script

SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
# Small runs of a SAC and a PPO script, as each script's own tests define them.
TINY_FLAGS = {
    "sac_pendulum": test_sac_pendulum.TINY_FLAGS,
    "ppo_cartpole": test_ppo_cartpole.TINY_FLAGS,
}


def run(script: str, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run_script(importlib.import_module(script), *flags, env=env)


def task_configs(module) -> list:
    if hasattr(module, "default_config"):  # sac_cartpole: balance and swing-up
        return [module.default_config(), module.default_config("CartPoleSwingup")]
    return [module.Config()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_every_sweepable_field_is_traced_through_training_and_evaluation(script):
    """Each float field --sweep accepts can be a traced value (one per run) in init, run_chunk
    and the evaluation: no shape and no Python branch depends on it. Every such field is traced at
    once (a field that a shape or a branch reads fails the trace all the same), in one trace per
    task instead of one per field. The other sweepable fields set a structure."""
    module = importlib.import_module(script)
    assert "gamma" in module.TRACED and {"num_envs", "num_seeds"} & module.TRACED == set()
    assert "num_envs" in module.SWEEPABLE and "seed" not in module.SWEEPABLE
    values = {name: jnp.full(1, 0.5) for name in module.TRACED}
    for config in task_configs(module):
        keys = module.seed_keys(config)

        def init(key, values, config=config):
            return module.make_train(module.with_values(config, values))[0](key)

        def run_chunk(state, values, config=config):
            return module.make_train(module.with_values(config, values))[1](state, 0)

        def evaluate(params, key, values, config=config):
            return module.make_evaluate(module.with_values(config, values), 2)(params, key)

        state = jax.eval_shape(jax.vmap(init), keys["train"], values)
        jax.eval_shape(jax.vmap(run_chunk), state, values)
        params = jax.eval_shape(jax.vmap(functools.partial(module.trained_params, config)), state)
        jax.eval_shape(jax.vmap(evaluate), params, keys["evaluate"], values)


@pytest.mark.parametrize("script", SCRIPTS)
@pytest.mark.parametrize(
    "sweep, message",
    [
        (
            ["seed=1,2"],
            "--sweep must be NAME=V1,V2,... naming one of ",
        ),  # the run's own fields are not swept
        (["gamma=0.9,abc"], "--sweep must be NAME=V1,V2,... (of its type), got gamma=0.9,abc"),
        (["gamma="], "--sweep must be NAME=V1,V2,... (of its type), got gamma="),
        (["gamma"], "--sweep must be NAME=V1,V2,... (of its type), got gamma"),
        (["num-envs=4,1.5"], "--sweep must be NAME=V1,V2,... (of its type), got num-envs=4,1.5"),
        (["num-envs=4,0"], "grid point 2 of 2 (num-envs=0): --num-envs must be >= 1, got 0"),
        ([], "--sweep must be followed by NAME=V1,V2,... entries"),  # not a plain run
        (["gamma=0.9", "gamma=0.99"], "--sweep must be one entry per field, got gamma=0.99"),
        (["gamma=0.9,1.5"], "grid point 2 of 2 (gamma=1.5): --gamma must be in (0, 1], got 1.5"),
        (["gamma=0.9,0.9"], "--sweep must be distinct values, got gamma=0.9,0.9"),
    ],
)
def test_bad_grids_exit_2_with_one_line_before_compiling(script, sweep, message):
    module = importlib.import_module(script)
    status, _, stderr = in_process(module, "--sweep", *sweep)
    stderr = stderr.strip()
    assert status == 2 and len(stderr.splitlines()) == 1 and message in stderr, stderr
    assert stderr.startswith(f"{script}.py: error: --sweep")


def test_a_run_count_that_does_not_divide_over_the_devices_is_refused():
    two_devices = forced_cpu_devices(2)
    flags = ["--sweep", "gamma=0.9,0.95,0.99"]
    result = run("sac_pendulum", *TINY_FLAGS["sac_pendulum"], *flags, env=two_devices)
    assert result.returncode == 2
    assert result.stderr.strip() == (
        "sac_pendulum.py: error: --num-seeds must be such that the 3 runs divide over the 2 "
        "devices, got 1"
    )


def rows_of(path: Path) -> list[dict]:
    return list(csv.DictReader(path.open()))


METRICS = ["episode_return", "episode_length"]


@pytest.mark.parametrize("script", ["sac_pendulum", "ppo_cartpole"])
def test_a_grid_point_is_the_single_run_and_the_report_holds_every_run(script, tmp_path, capsys):
    sweep_dir, single_dir, eval_dir = tmp_path / "sweep", tmp_path / "single", tmp_path / "eval"
    flags = [*TINY_FLAGS[script], "--seed", "5", "--no-capture-gif"]
    swept = run(
        script,
        *flags,
        *("--sweep", "gamma=0.9,0.99", "--num-seeds", "2"),
        *("--output-dir", str(sweep_dir)),
    )
    assert swept.returncode == 0, swept.stderr
    assert "2 grid points x 2 seeds x" in swept.stdout and "(all 4 runs together)" in swept.stdout
    single = run(
        script,
        *[flag if flag != "5" else "6" for flag in flags],  # seed 6: the sweep's second seed
        *("--gamma", "0.99", "--output-dir", str(single_dir), "--no-plot"),
    )
    assert single.returncode == 0, single.stderr

    # (gamma 0.99, seed 6) of the sweep is the single run, to float tolerance
    rows = rows_of(sweep_dir / "metrics.csv")
    assert list(rows[0])[:3] == ["seed", "gamma", "env_steps"]
    point = [row for row in rows if float(row["gamma"]) == 0.99 and row["seed"] == "6"]
    alone = rows_of(single_dir / "metrics.csv")
    assert len(point) == len(alone) > 1
    loss = next(name for name in ("critic_loss", "value_loss") if name in alone[0])
    for name in [*METRICS, loss]:
        np.testing.assert_allclose(
            [float(row[name]) for row in point],
            [float(row[name]) for row in alone],
            rtol=1e-4,
            atol=1e-5,
        )
    summary = json.loads((sweep_dir / "summary.json").read_text())
    single_return = json.loads((single_dir / "summary.json").read_text())["final_returns"][0]
    assert summary["final_returns"][3] == pytest.approx(single_return, rel=1e-4, abs=1e-3)

    # the report: per grid point its values, each seed's final return, mean, std, IQM (of 2
    # seeds: their mean), no intervals (fewer than 3 seeds), solved share
    report = summary["sweep"]
    assert [entry["gamma"] for entry in report] == [0.9, 0.99]
    for index, entry in enumerate(report):
        returns = summary["final_returns"][2 * index : 2 * index + 2]
        assert entry["final_returns"] == returns
        assert entry["mean"] == pytest.approx(np.mean(returns)) == pytest.approx(entry["iqm"])
        assert entry["std"] == pytest.approx(np.std(returns))
        assert entry["mean_ci"] is None and entry["iqm_ci"] is None
        assert 0 <= entry["solved_fraction"] <= 1
    header, *table = swept.stdout.splitlines()[-4:-1]  # the printed table: a line per grid point
    columns = "grid point | returns per seed | mean ± std | 95% CI | IQM | 95% CI | solved"
    assert header.startswith(f"  {columns} (* the best IQM")
    cells = [line[2:].split(" | ") for line in table]
    assert [row[0] for row in cells] == ["gamma=0.9", "gamma=0.99"]
    assert cells[1][2:5] == [
        f"{report[1]['mean']:.1f} ± {report[1]['std']:.1f}",
        "none (< 3 runs)",
        f"{report[1]['iqm']:.1f}",
    ]
    best = int(np.argmax([entry["iqm"] for entry in report]))  # marked; no interval to overlap
    assert [line[0] for line in table] == ["*" if row == best else " " for row in range(2)]

    # the checkpoint holds every run with its grid point; --eval-only evaluates them all
    payload = flax.serialization.msgpack_restore((sweep_dir / "model.msgpack").read_bytes())
    assert [(run["gamma"], run["seed"]) for run in payload["runs"]] == [
        (0.9, 5),
        (0.9, 6),
        (0.99, 5),
        (0.99, 6),
    ]
    evaluated = run(
        script,
        *("--eval-only", "--load-model", str(sweep_dir / "model.msgpack")),
        *("--output-dir", str(eval_dir), "--no-capture-gif"),
        *("--eval-episodes", flags[flags.index("--eval-episodes") + 1]),
    )
    assert evaluated.returncode == 0, evaluated.stderr
    assert "2 grid points x 2 seeds x" in evaluated.stdout
    again = json.loads((eval_dir / "summary.json").read_text())
    assert again["final_returns"] == summary["final_returns"]
    assert [entry["gamma"] for entry in again["sweep"]] == [0.9, 0.99]

    # compare.py reads the folders as the script left them: a variant per folder and grid point
    import compare

    compare.main([str(single_dir), str(sweep_dir), "--output", str(tmp_path / "compare.png")])
    table = capsys.readouterr().out.splitlines()[2:5]
    assert [line.split(" | ")[:2] for line in table] == [
        ["single", "1"],
        ["sweep gamma=0.9", "2"],
        ["sweep gamma=0.99", "2"],
    ]
    assert (tmp_path / "compare.png").stat().st_size > 0


STRUCTURES = {  # a field that sets a shape (the networks') and one that sets a loop's length
    "sac_pendulum": ("hidden-sizes", ["16x16", "8x8"], ["updates-per-step", "1", "2"]),
    "ppo_cartpole": ("hidden-size", ["16", "8"], ["update-epochs", "2", "1"]),
}


@pytest.mark.parametrize("script", ["sac_pendulum", "ppo_cartpole"])
def test_a_structural_sweep_is_one_process_one_report_and_each_point_its_single_run(
    script, tmp_path
):
    """Fields that set a shape or a loop: one program per structure (here 4), every run in one
    process and one report, and run (g, i) is the single command's run with those values."""
    shape, shapes, (loop, *loops) = STRUCTURES[script]
    flags = [*TINY_FLAGS[script], "--seed", "5", "--no-capture-gif"]
    grid = [f"{shape}={','.join(shapes)}", f"{loop}={','.join(loops)}", "gamma=0.9,0.99"]
    swept = run(script, *flags, "--sweep", *grid, "--output-dir", str(tmp_path / "sweep"))
    assert swept.returncode == 0, swept.stderr
    assert "8 grid points x 1 seed x" in swept.stdout and "(all 8 runs together)" in swept.stdout
    shown = [line[2:].split(" | ")[0] for line in swept.stdout.splitlines()[-9:-1]]
    assert shown[:2] == [f"{shape}={shapes[0]} {loop}={loops[0]} gamma=0.9"] * 1 + [
        f"{shape}={shapes[0]} {loop}={loops[0]} gamma=0.99"
    ]  # the structure's fields vary slowest
    assert shown[-1] == f"{shape}={shapes[1]} {loop}={loops[1]} gamma=0.99"
    summary = json.loads((tmp_path / "sweep" / "summary.json").read_text())
    assert len(summary["sweep"]) == 8 and len(summary["final_returns"]) == 8
    # the last point (the second network, the second loop length, gamma 0.99) run alone
    sizes = shapes[1].split("x")
    alone_flags = [*flags, f"--{shape}", *sizes, f"--{loop}", loops[1], "--gamma", "0.99"]
    alone = run(script, *alone_flags, "--output-dir", str(tmp_path / "alone"), "--no-plot")
    assert alone.returncode == 0, alone.stderr
    rows = [row for row in rows_of(tmp_path / "sweep" / "metrics.csv")]
    point = rows[7::8]  # run 7 of each chunk's 8 rows
    single = rows_of(tmp_path / "alone" / "metrics.csv")
    assert len(point) == len(single) > 1
    assert all(row["gamma"] == "0.99" for row in point)
    value = [int(size) for size in sizes] if len(sizes) > 1 else int(sizes[0])  # as JSON has it
    assert [json.loads(row[shape.replace("-", "_")]) for row in point] == [value] * len(point)
    loss = next(name for name in ("critic_loss", "value_loss") if name in single[0])
    for name in [*METRICS, loss]:  # the first chunks to float tolerance (rounding then grows)
        np.testing.assert_allclose(
            [float(row[name]) for row in point[:2]],
            [float(row[name]) for row in single[:2]],
            rtol=1e-4,
            atol=1e-5,
        )
    # --eval-only evaluates every structure's runs of the sweep's model
    evaluated = run(
        script,
        *("--eval-only", "--load-model", str(tmp_path / "sweep")),
        *("--output-dir", str(tmp_path / "eval"), "--no-capture-gif"),
        *("--eval-episodes", flags[flags.index("--eval-episodes") + 1]),
    )
    assert evaluated.returncode == 0, evaluated.stderr
    again = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert again["final_returns"] == summary["final_returns"]


def test_a_structural_grid_of_unequal_chunks_is_refused_before_compiling():
    """Every structure trains in as many chunks (one progress line and row per chunk)."""
    status, _, stderr = in_process(
        test_sac_pendulum.sac, *TINY_FLAGS["sac_pendulum"], "--sweep", "num-envs=4,24"
    )
    assert status == 2 and "--sweep must be points of as many chunks" in stderr, stderr


def test_iqm_and_intervals_against_a_hand_computed_case():
    """The IQM is the mean of the middle half (rliable's, scipy's trim_mean); each interval is the
    2.5 and 97.5 percentiles of the statistic over resampled runs, here worked out exactly from
    all 4**4 equally likely resamples of 4 runs; the seed is fixed, so a report is the same twice;
    fewer than 3 runs get none, as the printed cells say."""
    sac = importlib.import_module("sac_pendulum")
    returns = np.array([0.0, 1.0, 2.0, 10.0])
    report = sac.estimates(returns)
    assert (report["mean"], report["iqm"]) == (3.25, 1.5)  # the IQM: (1 + 2) / 2
    resamples = np.sort(list(itertools.product(returns, repeat=4)), axis=1)
    for name, values in [("mean", resamples.mean(axis=1)), ("iqm", resamples[:, 1:3].mean(axis=1))]:
        exact = np.quantile(values, [0.025, 0.975], method="inverted_cdf")
        assert report[f"{name}_ci"] == pytest.approx(exact), name
    assert report["mean_ci"] == pytest.approx([0.5, 7.75]) and report["iqm_ci"] == [0.0, 10.0]
    assert sac.estimates(returns) == report  # reproducible
    few = sac.estimates(np.array([1.0, 2.0]))
    assert few["mean_ci"] is None and few["iqm_ci"] is None and few["iqm"] == few["mean"] == 1.5
    assert sac.report_cells(few) == ["1.5 ± 0.5", "none (< 3 runs)", "1.5", "none (< 3 runs)"]
