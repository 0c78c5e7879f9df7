"""--distributed: two local processes (CPU devices, gloo collectives, 127.0.0.1) train and evaluate
the very runs that one process trains; process 0 alone prints and writes; a non-finite loss stops
both (a Ctrl-C on a worker: test_resume.py, which resumes the pair); bad flags end in one line and
exit 2 (an unreachable coordinator is JAX's to report)."""

import csv
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest
import test_ppo_cartpole  # tests/ is on the path: pytest prepends it
import test_sac_pendulum
from conftest import forced_cpu_devices

import benchmark
import sac_pendulum

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
# Four runs: a sweep (2 grid points x 2 seeds) of a SAC script and 4 seeds of a PPO script,
# without the GIF and the curves (their rendering is tested on one process elsewhere).
QUIET = ["--no-capture-gif", "--no-plot"]
RUNS = {
    "sac_pendulum": [
        *test_sac_pendulum.TINY_FLAGS,
        *QUIET,
        "--sweep",
        "gamma=0.9,0.99",
        "--num-seeds",
        "2",
    ],
    "ppo_cartpole": [*test_ppo_cartpole.TINY_FLAGS, *QUIET, "--num-seeds", "4"],
}
TIMED_COLUMNS = ("wall_seconds", "sps")  # differ from run to run


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def cpu_devices(count: int) -> dict:
    return {
        **os.environ,
        "JAX_PLATFORMS": "cpu",
        **forced_cpu_devices(count),
    }


def start(script: str, flags: list, log: Path, devices: int) -> subprocess.Popen:
    """The script in a subprocess, its stdout and stderr in log.out and log.err (files: a full
    pipe would block a process that its partner then waits for)."""
    return subprocess.Popen(
        [*benchmark.DIE_WITH_PARENT, sys.executable, str(ROOT / f"{script}.py"), *flags],
        stdout=log.with_suffix(".out").open("w"),
        stderr=log.with_suffix(".err").open("w"),
        env=cpu_devices(devices),
    )


def start_pair(script: str, flags: list, tmp: Path, devices: int = 2) -> list[subprocess.Popen]:
    """Processes 0 and 1 of a --distributed run, each writing into its own tmp/p<I> (so that
    what a worker writes shows), with `devices` CPU devices each."""
    tmp.mkdir(exist_ok=True)
    cluster = ["--distributed", "--coordinator-address", f"127.0.0.1:{free_port()}"]
    return [
        start(
            script,
            [*flags, *cluster, "--num-processes", "2", "--process-id", str(process)]
            + ["--output-dir", str(tmp / f"p{process}")],
            tmp / f"p{process}",
            devices,
        )
        for process in (0, 1)
    ]


def finish(processes: list[subprocess.Popen], timeout: float = 300) -> list[int]:
    deadline = time.monotonic() + timeout
    return [process.wait(max(deadline - time.monotonic(), 1)) for process in processes]


def output(log: Path) -> tuple[str, str]:
    return log.with_suffix(".out").read_text(), log.with_suffix(".err").read_text()


def read_rows(path: Path) -> list[dict]:
    with path.open() as file:
        return list(csv.DictReader(file))


def assert_same_rows(got: list[dict], expected: list[dict]) -> None:
    assert len(got) == len(expected) and list(got[0]) == list(expected[0])
    for row, reference in zip(got, expected, strict=True):
        for name, value in reference.items():
            if name not in TIMED_COLUMNS:
                np.testing.assert_allclose(float(row[name]), float(value), rtol=1e-4, atol=1e-5)


def checkpoint_params(path: Path) -> list[np.ndarray]:
    payload = flax.serialization.msgpack_restore(path.read_bytes())
    return jax.tree.leaves(payload["params"])


@pytest.mark.slow
def test_two_processes_train_and_evaluate_what_one_process_does(tmp_path, monkeypatch):
    """A sweep's 4 runs on 2 processes x 2 CPU devices against the same 4 runs in one process
    with 4 devices: every metrics row, the evaluation and the checkpoint agree to float
    tolerance; process 0 writes every output and the worker writes nothing and prints one line.
    Then the checkpoint is evaluated --distributed too, logged to W&B (offline) as asked: one
    W&B run per run, from process 0 alone. The four scripts share this code (their
    command-line blocks are one block: test_cli_block.py); a PPO script's seeds over 2 processes
    give one process's returns in test_benchmark.py's distributed test."""
    script = "sac_pendulum"
    flags = RUNS[script]
    alone = start(script, [*flags, "--output-dir", str(tmp_path / "alone")], tmp_path / "alone", 4)
    assert alone.wait(300) == 0, output(tmp_path / "alone")
    pair = start_pair(script, flags, tmp_path)
    assert finish(pair) == [0, 0], [output(tmp_path / f"p{i}") for i in (0, 1)]

    lead_out, _ = output(tmp_path / "p0")
    worker_out, worker_err = output(tmp_path / "p1")
    assert "on 4 device(s) (cpu), 2 process(es)" in lead_out
    assert worker_out.splitlines() == [f"{script}: process 1, a worker; process 0 writes"], (
        worker_err
    )
    assert not (tmp_path / "p1").exists()
    lead, reference = tmp_path / "p0", tmp_path / "alone"
    assert sorted(path.name for path in lead.iterdir()) == sorted(
        path.name for path in reference.iterdir()
    )
    assert_same_rows(read_rows(lead / "metrics.csv"), read_rows(reference / "metrics.csv"))
    summary = json.loads((lead / "summary.json").read_text())
    expected = json.loads((reference / "summary.json").read_text())
    np.testing.assert_allclose(summary["final_returns"], expected["final_returns"], rtol=1e-3)
    for got, want in zip(
        checkpoint_params(lead / "model.msgpack"),
        checkpoint_params(reference / "model.msgpack"),
        strict=True,
    ):
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)

    episodes = flags[flags.index("--eval-episodes") + 1]  # the training run's evaluation
    evaluation = ["--eval-only", "--load-model", str(lead / "model.msgpack"), "--no-capture-gif"]
    evaluation += ["--eval-episodes", episodes, "--track", "--wandb-project-name", "demo"]
    monkeypatch.setenv("WANDB_MODE", "offline")  # (the processes inherit it)
    pair = start_pair(script, evaluation, tmp_path / "eval")
    assert finish(pair) == [0, 0], [output(tmp_path / "eval" / f"p{i}") for i in (0, 1)]
    evaluated = json.loads((tmp_path / "eval" / "p0" / "summary.json").read_text())
    np.testing.assert_allclose(evaluated["final_returns"], summary["final_returns"], rtol=1e-3)
    assert not (tmp_path / "eval" / "p1").exists()
    from test_watch import read_wandb

    finals = []
    for records in read_wandb(tmp_path / "eval" / "p0").values():
        (begun,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
        assert begun.job_type == "eval"
        for record in records:
            if record.WhichOneof("record_type") == "summary":
                finals += [
                    json.loads(i.value_json) for i in record.summary.update if i.key[:6] == "final_"
                ]
    assert sorted(finals) == pytest.approx(sorted(evaluated["final_returns"]))  # a run per run


@pytest.mark.slow
def test_a_non_finite_loss_stops_every_process_and_process_0_says_so(tmp_path):
    """Every process holds every run's metrics, so all stop after the same chunk (exit 1); the
    message comes once, from process 0, and what it wrote stays valid."""
    flags = [*test_sac_pendulum.TINY_FLAGS, "--q-lr", "1e30", "--num-seeds", "2"]
    pair = start_pair("sac_pendulum", [*flags, "--no-plot", "--no-capture-gif"], tmp_path, 1)
    assert finish(pair, timeout=240) == [1, 1], output(tmp_path / "p0")
    lead_err, worker_err = output(tmp_path / "p0")[1], output(tmp_path / "p1")[1]
    assert "non-finite" in lead_err and "chunk" in lead_err
    assert "non-finite" not in worker_err
    assert len(read_rows(tmp_path / "p0" / "metrics.csv")) >= 2  # a row per run and chunk


def test_runs_that_do_not_divide_over_every_process_s_devices_are_refused(tmp_path):
    """3 seeds on 2 processes of 1 device each: both processes refuse before compiling."""
    pair = start_pair("sac_pendulum", ["--num-seeds", "3"], tmp_path, devices=1)
    assert finish(pair, timeout=120) == [2, 2]
    for process in (0, 1):
        err = output(tmp_path / f"p{process}")[1]
        assert "--num-seeds must be such that the 3 runs divide over the 2 devices, got 3" in err


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--process-id", "1"], "--coordinator-address, --num-processes, --process-id need --"),
        (
            ["--distributed", "--coordinator-address", "localhost"],
            "--coordinator-address must be HOST:PORT",
        ),
        (
            ["--distributed", "--coordinator-address", "10.0.0.1:99999"],
            "--coordinator-address must be HOST:PORT",
        ),
    ],
)
def test_distributed_flags_are_checked_before_anything_starts(flags, message):
    with pytest.raises(sac_pendulum.UsageError, match=re.escape(message)):
        sac_pendulum.check_options(sac_pendulum.parse_args(flags)[1])


@pytest.mark.parametrize(("processes", "process"), [("2", "2"), ("0", "0")])
def test_a_process_id_or_count_that_jax_refuses_is_one_line(processes, process):
    """JAX checks them itself, before it connects: its reason in one line, exit 2."""
    flags = ["--distributed", "--coordinator-address", "127.0.0.1:1234", "--num-processes"]
    result = subprocess.run(
        [sys.executable, str(ROOT / "sac_pendulum.py"), *flags, processes, "--process-id", process],
        capture_output=True,
        text=True,
        timeout=60,
        env=cpu_devices(1),
    )
    assert result.returncode == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    got = f"Got process_id={process}, num_processes={processes}"
    assert result.stderr.startswith("sac_pendulum.py: error: --distributed: process_id ")
    assert got in result.stderr


def test_without_a_cluster_distributed_says_what_to_give(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "sac_pendulum.py"), "--distributed"],
        capture_output=True,
        text=True,
        timeout=60,
        env={
            name: value
            for name, value in cpu_devices(1).items()
            if not name.startswith(("SLURM_", "OMPI_", "PMI_"))
        },
    )
    assert result.returncode == 2 and result.stdout == ""
    assert "without a cluster, give" in result.stderr
    assert len(result.stderr.splitlines()) == 1
    assert "--coordinator-address HOST:PORT --num-processes N --process-id I" in result.stderr


def test_importing_a_script_does_not_start_jax():
    """jax.distributed.initialize must come before JAX's backend starts: importing envs.py and
    the scripts starts nothing (an array made at import would)."""
    code = (
        "import envs, sac_pendulum, sac_cartpole, ppo_cartpole, ppo_snake\n"
        "from jax._src import xla_bridge\n"
        "print(xla_bridge.backends_are_initialized())\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    assert result.stdout.strip() == "False", result.stderr


@pytest.mark.parametrize("script", list(RUNS))
def test_runs_never_communicate_inside_a_chunk(script):
    """The compiled init and chunk programs over 2 devices hold no collective (all-gather,
    all-reduce, ...): each device trains its own runs, so processes meet only between chunks."""
    code = f"""
import re, jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec
import {script} as script
config = script.parse_args(["--num-seeds", "4", "--sweep", "gamma=0.9,0.99"])[0]
sharding = NamedSharding(Mesh(np.array(jax.devices()), ("runs",)), PartitionSpec("runs"))
keys = jax.device_put(script.seed_keys(config, 2)["train"], sharding)
values = jax.device_put({{"gamma": np.float32([0.9] * 4 + [0.99] * 4)}}, sharding)
def init(key, values):
    return script.make_train(script.with_values(config, values))[0](key)
def run_chunk(state, chunk, values):
    return script.make_train(script.with_values(config, values))[1](state, chunk)
init_fn = jax.jit(jax.vmap(init), out_shardings=sharding)  # as the script's train_and_log
state = init_fn(keys, values)
chunk_fn = jax.jit(jax.vmap(run_chunk, (0, None, 0)), out_shardings=sharding, donate_argnums=0)
for program in (init_fn.lower(keys, values), chunk_fn.lower(state, jnp.int32(0), values)):
    text = program.compile().as_text()
    print(len(text), sorted(set(re.findall(
        r"(all-gather|all-reduce|all-to-all|collective-permute|reduce-scatter)", text))))
"""
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
        env=cpu_devices(2),
    )
    assert result.returncode == 0, result.stderr
    programs = [line.split(" ", 1) for line in result.stdout.splitlines()]
    assert len(programs) == 2 and all(int(size) > 1000 for size, _ in programs)  # real programs
    assert [collectives for _, collectives in programs] == ["[]", "[]"]
