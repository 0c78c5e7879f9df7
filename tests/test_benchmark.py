"""benchmark.py's subcommands on tiny sizes: each writes its rows (device, JAX version and date
on every one), and its plot where it draws one, next to the --output JSON in a temporary
directory. Timings are never asserted, only that they were measured."""

import collections
import csv
import itertools
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
def test_train_writes_rows_and_a_plot(tmp_path: Path) -> None:
    """`train` alone: `seeds` runs in the GPU list's test, and envs' test keeps other rows."""
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


def test_first_crossing_and_launch_to_solved() -> None:
    sys.path.insert(0, str(REPO))
    from benchmark import first_crossing_seconds, launch_to_solved

    lines = (
        "seed,env_steps,wall_seconds,episode_return\n0,100,1.5,nan\n0,200,2.5,480.0\n0,300,3.5,490"
    )
    metrics = list(
        csv.DictReader(lines.splitlines())
    )  # metrics.csv's rows, as run_script reads them
    assert first_crossing_seconds(metrics, 475.0) == 2.5
    assert first_crossing_seconds(metrics, 495.0) is None
    # The first progress line (row 1, 1.5 s into training) printed 10 s after launch: training
    # began at 8.5 s, so the bar was crossed 2.5 s later, at 11.0 s.
    run = {"metrics": metrics, "first_progress_seconds": 10.0}
    assert launch_to_solved(run, 475.0) == 11.0 and launch_to_solved(run, 495.0) is None


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
def test_gpu_list_runs_whole_and_tiny_on_a_cpu(tmp_path: Path) -> None:
    """`benchmark.py gpu` on a CPU: every benchmark of the GPU list at tiny sizes, the launch,
    solve and sweep rows read from the scripts' own outputs; the peers are not installed here,
    so each is skipped with a line; the rows end as one table."""
    output = tmp_path / "benchmarks.json"
    command = [*DIE_WITH_PARENT, sys.executable, "benchmark.py", "--output", str(output), "gpu"]
    command += ["--peers-path", str(tmp_path / "no-peers")]
    done = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(output.read_text())["rows"]
    check_stamped(rows)
    kinds = collections.defaultdict(list)
    for row in rows:
        kinds[row["benchmark"]].append(row)
    assert sorted(kinds) == ["env_steps", "launch", "seed_scaling", "sweep", "time_to_solve"]
    ours = {(row["env"], row["num_envs"]) for row in kinds["env_steps"] if row["library"] == "ours"}
    assert ours == set(itertools.product(["CartPole-v1", "Pendulum-v1", "Snake"], [16, 64]))
    seeds = {(row["library"], row["num_seeds"]) for row in kinds["seed_scaling"]}
    scripts = ["sac_cartpole", "ppo_cartpole", "sac_pendulum"]  # ppo_snake: not on a CPU (quick)
    assert seeds == set(itertools.product(scripts, [1]))
    assert (tmp_path / "benchmark_envs.png").stat().st_size > 0
    assert (tmp_path / "benchmark_seeds.png").stat().st_size > 0

    (launch,) = kinds["launch"]  # sac_cartpole --num-envs 1024 at 1/128 the envs, a few chunks
    assert (launch["library"], launch["num_envs"], launch["runs"]) == ("sac_cartpole", 8, 1)
    assert launch["env"].startswith("sac_cartpole --num-envs 8 ")  # a row per command
    for side in ("cold", "warm"):  # measured, never asserted on beyond their order
        assert 0 < launch[f"{side}_first_progress_seconds"] < launch[f"{side}_seconds"]
        assert launch[f"{side}_compile_seconds"] > 0 and len(launch[f"{side}_final_returns"]) == 1
        assert len(launch[f"{side}_launch_to_solved_runs"]) == 1
    cold_split = launch["cold_compile_split"]  # the run's programs, each traced, lowered, compiled
    assert {"seed_keys", "every_structure", "run_chunks"} <= set(cold_split)
    assert set(cold_split["run_chunks"]) == {
        "jaxpr_trace",
        "jaxpr_to_mlir_module",
        "backend_compile",
    }
    assert cold_split["run_chunks"]["backend_compile"] > 0
    solves = {(row["library"], row["num_envs"]): row for row in kinds["time_to_solve"]}
    assert set(solves) == {("sac_pendulum", 16), ("ppo_cartpole", 32), ("ppo_cartpole", 16)}
    for row in solves.values():
        assert row["env_steps"] == 4096 and row["env_steps_per_second"] > 0
        assert row["cold_train_seconds"] > 0 and row["solved_runs"] in (0, 1)
    assert solves["ppo_cartpole", 32]["solved_bar"] == 475.0

    (sweep,) = kinds["sweep"]  # one grid point of one seed: one process against one
    assert sweep["library"] == "sac_pendulum" and sweep["num_seeds"] == 1
    assert sweep["sweep_seconds"] > 0 and sweep["single_runs_seconds"] > 0
    assert len(sweep["sweep_final_returns"]) == len(sweep["single_final_returns"]) == 1

    for peer in ("purejaxrl_ppo", "rejax_sac"):
        assert f"  {peer} skipped (ModuleNotFoundError: " in done.stdout  # one line each
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert table[0].startswith("| benchmark | library | env |") and len(table) == 2 + len(rows)


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
    # The same seeds trained as one process or two: the same returns (CartPole's count whole
    # steps, so a seed whose evaluation went otherwise would differ by at least 1).
    assert row["median_return_difference"] == 0
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
    # setpriv sets the death signal, then runs the command: wait for that, as a real run has
    # (a parent killed within the first milliseconds, before setpriv's prctl, would leave it).
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}/comm").read_text().strip() != "sleep":
        assert time.monotonic() < deadline, "the child never started its command"
        time.sleep(0.01)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    state = Path(f"/proc/{child}/stat")
    assert not state.exists() or state.read_text().split()[2] == "Z"  # gone (or a zombie)


def test_a_users_benchmark_writes_a_folder_of_its_own_and_docs_only_when_asked(tmp_path):
    """`benchmark.py envs --quick`, run to check one's own machine, writes its rows and plot into
    runs/benchmark__<time>/ where it runs; the published docs/ files are left as they are, and
    only --write-docs names them."""
    published = {path: path.stat().st_mtime_ns for path in (REPO / "docs").glob("benchmark*")}
    command = [*DIE_WITH_PARENT, sys.executable, str(REPO / "benchmark.py"), "envs", "--quick"]
    command += ["--envs", "CartPole-v1", "--num-envs", "1", "--repeats", "1", "--no-reference"]
    done = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    (folder,) = (tmp_path / "runs").iterdir()
    assert folder.name.startswith("benchmark__")
    assert sorted(path.name for path in folder.iterdir()) == [
        "benchmark_envs.png",
        "benchmarks.json",
    ]
    (row,) = json.loads((folder / "benchmarks.json").read_text())["rows"]
    assert row["env"] == "CartPole-v1" and row["steps_per_second"] > 0
    assert {path: path.stat().st_mtime_ns for path in published} == published
    usage = subprocess.run(
        [sys.executable, "benchmark.py", "--help"], cwd=REPO, capture_output=True, text=True
    )
    usage = " ".join(usage.stdout.split())  # as argparse wraps it to the terminal's width
    assert f"--write-docs {REPO / 'docs' / 'benchmarks.json'} " in usage
