"""benchmark.py's subcommands on tiny sizes: each writes its rows (device, JAX version and date
on every one), and its plot where it draws one, next to the --output JSON in a temporary
directory. Timings are never asserted, only that they were measured."""

import csv
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmark import DIE_WITH_PARENT  # no script outlives a killed pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPT_FLAGS = ["--no-capture-gif", "--no-plot", "--no-save-model"]


def benchmark(output: Path, *args: str) -> list[dict]:
    """Run `python benchmark.py --output output args...` in the repo and return the JSON's rows."""
    command = [*DIE_WITH_PARENT, sys.executable, "benchmark.py", "--output", str(output), *args]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    return json.loads(output.read_text())["rows"]


def check_stamped(rows: list[dict]) -> None:
    for row in rows:
        assert row["device"] and row["jax_version"] and row["date"]


@pytest.mark.slow
def test_train_and_seeds_write_rows_and_plots(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "train",
        "--scripts",
        "sac_pendulum",
        "ppo_cartpole",
        "--num-envs",
        "8",
        "--steps-per-env",
        "128",
        "--repeats",
        "1",
    )
    train = [row for row in rows if row["benchmark"] == "train_throughput"]
    assert sorted((row["library"], row["num_envs"]) for row in train) == [
        ("ppo_cartpole", 8),
        ("sac_pendulum", 8),
    ]
    for row in train:
        assert (
            row["steps_per_second"] > 0
            and row["updates_per_second"] > 0
            and row["compile_seconds"] > 0
        )
        # 128 steps of every env: 128 SAC iterations, or 2 PPO rollouts of 64 steps
        assert row["chunk_steps"] == 128 * row["num_envs"]
    check_stamped(train)
    assert (tmp_path / "benchmark_train.png").stat().st_size > 0

    rows = benchmark(
        output,
        "seeds",
        "--scripts",
        "ppo_cartpole",
        "--seeds",
        "1",
        "2",
        "--steps-per-env",
        "64",
        "--repeats",
        "1",
    )
    seeds = [row for row in rows if row["benchmark"] == "seed_scaling"]
    assert len(rows) == len(train) + len(seeds)  # merged: the train rows are kept
    assert [row["num_seeds"] for row in seeds] == [1, 2]
    assert seeds[0]["ratio_to_one_seed"] == 1.0 and seeds[1]["ratio_to_one_seed"] > 0
    assert seeds[1]["steps_per_second"] > 0
    check_stamped(seeds)
    assert (tmp_path / "benchmark_seeds.png").stat().st_size > 0


@pytest.mark.slow
def test_solve_reads_the_scripts_summary(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "solve",
        "--quick",
        "--solve-scripts",
        "ppo_cartpole",
        "--solve-flags=--total-timesteps 4096 --num-envs 8 --log-every 1024 --eval-episodes 1",
    )
    (row,) = rows
    assert (
        row["benchmark"] == "time_to_solve"
        and row["library"] == "ppo_cartpole"
        and row["runs"] == 1
    )
    assert row["solved_bar"] == 475.0 and row["num_envs"] == 8 and row["env_steps"] == 4096
    assert row["train_seconds"] > 0 and row["compile_seconds"] > 0
    assert len(row["final_returns"]) == 1 and row["solved_runs"] in (0, 1)
    check_stamped(rows)


def test_first_crossing_seconds() -> None:
    sys.path.insert(0, str(REPO))
    from benchmark import first_crossing_seconds

    lines = (
        "seed,env_steps,wall_seconds,episode_return\n0,100,1.5,nan\n0,200,2.5,480.0\n0,300,3.5,490"
    )
    metrics = list(
        csv.DictReader(lines.splitlines())
    )  # metrics.csv's rows, as run_script reads them
    assert first_crossing_seconds(metrics, 475.0) == 2.5
    assert first_crossing_seconds(metrics, 495.0) is None


@pytest.mark.slow
def test_launch_times_cold_and_warm_compile_caches(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "launch",
        "--quick",
        "--launch-scripts",
        "sac_pendulum",
        "--launch-flags=--total-timesteps 2048 --log-every 1024 --eval-episodes 1 --no-capture-gif",
    )
    (row,) = rows
    assert row["benchmark"] == "launch" and row["library"] == "sac_pendulum" and row["runs"] == 1
    for side in ("cold", "warm"):  # measured, never asserted on beyond their order
        assert 0 < row[f"{side}_first_progress_seconds"] < row[f"{side}_seconds"]
        assert row[f"{side}_compile_seconds"] > 0
    assert len(row["final_returns"]) == 2
    check_stamped(rows)


@pytest.mark.slow
def test_versus_compares_two_trees_side_by_side(tmp_path: Path) -> None:
    """The baseline is a copy of this tree: each side runs its own benchmark.py and scripts."""
    baseline = tmp_path / "baseline"
    baseline.mkdir()
    for source in REPO.glob("*.py"):
        shutil.copy(source, baseline)
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "versus",
        str(baseline),
        "--scripts",
        "ppo_cartpole",
        "--rounds",
        "1",
        "--num-envs",
        "8",
        "--launch-flags=--total-timesteps 4096 --num-envs 8 --log-every 1024 --eval-episodes 1 "
        + " ".join(SCRIPT_FLAGS),
    )
    train, launch = rows
    assert (train["benchmark"], train["num_envs"]) == ("versus_train", 8)
    assert train["steps_per_second"] > 0 and train["baseline_steps_per_second"] > 0
    assert launch["benchmark"] == "versus_launch" and launch["library"] == "ppo_cartpole"
    for side in ("cold", "warm"):
        for prefix in ("baseline_", ""):
            assert 0 < launch[f"{prefix}{side}_first_progress_seconds"]
        assert launch[f"{side}_first_progress_ratio"] > 0 and launch[f"{side}_ratio"] > 0
    check_stamped(rows)


@pytest.mark.slow
def test_sweep_times_one_program_against_one_process_per_run(tmp_path: Path) -> None:
    """It also checks that the single runs end where the sweep's runs do."""
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "sweep",
        "--script",
        "sac_pendulum",
        "--sweep",
        "tau=0.02,0.05",
        "--num-seeds",
        "1",
        "--sweep-flags=--total-timesteps 2048 --log-every 1024 --eval-episodes 1",
    )
    (row,) = rows
    assert row["benchmark"] == "sweep" and row["num_seeds"] == 2 and row["seeds_per_point"] == 1
    assert row["sweep_seconds"] > 0 and row["single_runs_seconds"] > 0
    check_stamped(rows)


@pytest.mark.slow
def test_distributed_times_one_process_against_two(tmp_path: Path) -> None:
    output = tmp_path / "benchmarks.json"
    rows = benchmark(
        output,
        "distributed",
        "--scripts",
        "ppo_cartpole",
        "--num-seeds",
        "2",
        "--repeats",
        "1",
        "--run-flags=--total-timesteps 4096 --log-every 2048 --eval-episodes 1",
    )
    (row,) = rows
    assert row["benchmark"] == "distributed" and row["processes"] == 2 and row["devices"] == 2
    assert row["one_process_seconds"] > 0 and row["distributed_seconds"] > 0
    assert row["median_return_difference"] >= 0
    check_stamped(rows)


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="setpriv (Linux's util-linux)")
def test_a_child_dies_with_its_parent(tmp_path: Path) -> None:
    """A benchmark (or a pytest) that is killed leaves no script running behind it."""
    parent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, sys, time; from benchmark import DIE_WITH_PARENT\n"
            "child = subprocess.Popen([*DIE_WITH_PARENT, 'sleep', '300'])\n"
            "print(child.pid, flush=True); time.sleep(300)",
        ],
        cwd=REPO,
        stdout=subprocess.PIPE,
        text=True,
    )
    child = int(parent.stdout.readline())
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z"  # gone (or a zombie)
