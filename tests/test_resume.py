"""Resuming a stopped run: from a periodic checkpoint after a kill, or after SIGTERM or Ctrl-C, the
run goes on bit for bit as if it had never stopped (metrics rows and final parameters), and
whatever cannot be resumed is refused in one line with nothing in the folder changed."""

import csv
import importlib
import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import flax.serialization
import jax
import numpy as np
import pytest
import test_ppo_cartpole
import test_sac_pendulum
from conftest import in_process, run_script

import ppo_cartpole
import sac_pendulum

ROOT = Path(__file__).resolve().parents[1]
TIMED_COLUMNS = ("wall_seconds", "sps")  # differ from run to run
QUIET = ["--no-plot", "--no-capture-gif"]
# sac_pendulum's tiny run in 7 chunks of 64 env steps; a checkpoint every 3 chunks leaves the last
# one at chunk 6 (384 transitions in the buffer), the 7th chunk's rows after it.
SAC_FLAGS = [*test_sac_pendulum.TINY_FLAGS, "--total-timesteps", "448", *QUIET]


def run(script: str, flags: list, check: int | None = 0) -> subprocess.CompletedProcess:
    result = run_script(importlib.import_module(script), *flags)
    assert check is None or result.returncode == check, result.stderr
    return result


def signal_at(flags: list, line: str, signum: int) -> int:
    """sac_pendulum.py with `flags`, sent `signum` once it prints a line starting with `line`;
    its exit status."""
    process = subprocess.Popen(
        [sys.executable, str(ROOT / "sac_pendulum.py"), *flags], stdout=subprocess.PIPE, text=True
    )
    for printed in process.stdout:
        if printed.startswith(line):
            process.send_signal(signum)
            break
    return process.wait(120)


def untimed_rows(folder: Path) -> list[dict]:
    with (folder / "metrics.csv").open() as file:
        return [
            {name: value for name, value in row.items() if name not in TIMED_COLUMNS}
            for row in csv.DictReader(file)
        ]


def params(folder: Path) -> list[np.ndarray]:
    payload = flax.serialization.msgpack_restore((folder / "model.msgpack").read_bytes())
    return jax.tree.leaves(payload["params"])


def assert_same_run(resumed: Path, never_stopped: Path) -> None:
    """Bit for bit: every metrics value (the timing columns aside) and every trained parameter."""
    assert untimed_rows(resumed) == untimed_rows(never_stopped)
    for got, expected in zip(params(resumed), params(never_stopped), strict=True):
        np.testing.assert_array_equal(got, expected)


@pytest.mark.slow
@pytest.mark.parametrize(
    "buffer_size, runs",
    [
        ("1000", ["--num-seeds", "2"]),  # the buffer mid-fill at the checkpoint (384 of 1000)
        ("256", ["--sweep", "gamma=0.9,0.99"]),  # the buffer wrapped around (384 into 256)
    ],
)
def test_a_run_killed_after_a_periodic_checkpoint_resumes_bit_for_bit(tmp_path, buffer_size, runs):
    flags = [*SAC_FLAGS, "--buffer-size", buffer_size, *runs]
    run("sac_pendulum", [*flags, "--checkpoint-every", "0", "--output-dir", str(tmp_path / "a")])
    assert not (tmp_path / "a" / "checkpoint.msgpack").exists()  # a finished run keeps none
    # A checkpoint every 3 chunks, killed (SIGKILL: no handler runs) once the 7th chunk's line is
    # out: the checkpoint of chunk 6, and maybe the 7th chunk's rows, which the resume replaces.
    killed = tmp_path / "b"
    periodic = ["--checkpoint-every", "192", "--output-dir", str(killed)]
    status = signal_at([*flags, *periodic], "steps 448/448", signal.SIGKILL)
    assert status == -signal.SIGKILL and not (killed / "summary.json").exists()
    resumed = run("sac_pendulum", ["--resume", str(killed), *QUIET])
    assert "resumed at chunk 6 of 7" in resumed.stdout
    assert_same_run(killed, tmp_path / "a")
    assert not (killed / "checkpoint.msgpack").exists()
    again = run("sac_pendulum", ["--resume", str(killed)])
    assert "has finished: nothing to resume" in again.stdout and "compiled" not in again.stdout


@pytest.mark.slow
def test_a_signalled_run_stops_after_its_chunk_and_resumes_bit_for_bit(tmp_path):
    """SIGTERM (a scheduler's notice, here twice) or Ctrl-C, each to a run of its own: the outputs
    and the checkpoint of the chunks done, exit 143 or 130; --resume then finishes each run as if
    nothing had happened (the same run never stopped)."""
    flags = [*test_ppo_cartpole.TINY_FLAGS, "--total-timesteps", "32000", "--num-seeds", "2"]
    flags += [*QUIET, "--checkpoint-every", "0"]
    run("ppo_cartpole", [*flags, "--output-dir", str(tmp_path / "never_stopped")])
    for signum, status in [(signal.SIGTERM, 143), (signal.SIGINT, 130)]:
        stopped = tmp_path / f"stopped_{status}"
        process = subprocess.Popen(
            [sys.executable, str(ROOT / "ppo_cartpole.py"), *flags, "--output-dir", str(stopped)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for line in process.stdout:  # the first progress line: training runs
            if line.startswith("steps "):
                break
        process.send_signal(signum)
        if signum == signal.SIGTERM:  # a repeated notice does not abort the stop under way
            process.send_signal(signum)
        _, stderr = process.communicate(timeout=300)
        assert process.returncode == status and "stopping after this chunk" in stderr, stderr
        assert "Traceback" not in stderr
        chunks = len(untimed_rows(stopped)) // 2
        assert 0 < chunks < 250, "stopped too late to test a resume"
        resumed = run("ppo_cartpole", ["--resume", str(stopped), *QUIET])
        assert f"resumed at chunk {chunks} of 250" in resumed.stdout
        assert_same_run(stopped, tmp_path / "never_stopped")


def test_resume_refuses_in_one_line_and_changes_nothing(tmp_path):
    """After a real stop, the refusals in process (the same main, nothing compiled), but for a
    checkpoint without a train state (telling needs the run's layout, which compiles)."""
    folder = tmp_path / "run"
    flags = [*SAC_FLAGS, "--output-dir", str(folder)]  # stopped by SIGTERM: a checkpoint
    assert signal_at(flags, "steps ", signal.SIGTERM) == 143
    assert (folder / "checkpoint.msgpack").exists()
    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoint.msgpack").write_bytes((folder / "checkpoint.msgpack").read_bytes()[:5000])
    (tmp_path / "model_only").mkdir()
    shutil.copy(folder / "model.msgpack", tmp_path / "model_only" / "checkpoint.msgpack")
    before = {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")}
    for flags, message in [
        (["--resume", str(tmp_path / "missing")], "(No such file or directory)"),
        (["--resume", ""], "--resume must be a run folder"),  # not a fresh run
        (["--resume", str(other)], "is not a checkpoint of sac_pendulum"),  # truncated
        (["--resume", str(folder), "--q-lr", "0.1"], "--q-lr is 0.003 in the saved run"),
        (
            ["--resume", str(folder), "--num-envs", "16"],
            "--num-envs is 4 in the saved run",
        ),  # typed at the default
        (["--resume", str(folder), "--output-dir", str(other)], "(without --output-dir)"),
        (
            ["--resume", str(folder), "--total-timesteps", "384"],  # fewer env steps than its 448
            "--total-timesteps must be >= 448 (the saved run's), got 384",
        ),
    ]:
        status, _, stderr = in_process(sac_pendulum, *flags)
        assert status == 2 and message in stderr and len(stderr.strip().splitlines()) == 1, flags
    status, _, stderr = in_process(ppo_cartpole, "--resume", str(folder))
    assert status == 2 and "is a sac_pendulum checkpoint" in stderr
    result = run("sac_pendulum", ["--resume", str(tmp_path / "model_only")], check=2)
    assert "does not fit this sac_pendulum: state is absent in the file" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert {path: path.stat().st_mtime_ns for path in tmp_path.rglob("*")} == before


def test_tracking_goes_on_at_the_resumed_runs_env_steps_in_the_same_wandb_run(
    tmp_path, monkeypatch
):
    """A resumed run's TensorBoard writer adds its events at the env steps of the chunks it
    trains, and its W&B run (offline) is the stopped run's, by id, going on from there; resumed
    with a larger --total-timesteps, it trains on to it."""
    from test_watch import read_events, read_wandb, wandb_history

    monkeypatch.setenv("WANDB_MODE", "offline")  # (the subprocess inherits it)
    folder = tmp_path / "run"
    flags = [*SAC_FLAGS, "--track", "--wandb-project-name", "demo", "--no-save-model"]
    output = [*flags, "--output-dir", str(folder)]
    assert signal_at(output, "steps 192/448", signal.SIGTERM) == 143  # the 3rd chunk's line
    done = len(untimed_rows(folder))
    (events,) = (folder / "tensorboard").iterdir()
    first = {path.name for path in events.iterdir()}
    time.sleep(1)  # a new events file per writer: its name holds the second it was made
    resume = ["--resume", str(folder), "--track", "--wandb-project-name", "demo", *QUIET]
    run("sac_pendulum", [*resume, "--total-timesteps", "512"])
    (new,) = [path for path in events.iterdir() if path.name not in first]
    events = read_events_file(read_events, new)
    steps = sorted({event.step for event in events if event.summary.value})
    assert steps == [64 * chunk for chunk in range(done + 1, 9)]  # where the first writer stopped
    (records,) = read_wandb(folder).values()  # one W&B run: both processes wrote to its id
    starts = [record.run for record in records if record.WhichOneof("record_type") == "run"]
    assert len(starts) == 2 and not starts[0].resume and starts[1].resume
    logged = [row["_step"] for row in wandb_history(records)]
    assert logged == [64 * chunk for chunk in range(1, 9)] and len(untimed_rows(folder)) == 8


def test_a_finished_run_kept_trains_on_to_a_larger_budget_as_if_started_with_it(tmp_path):
    """--keep-checkpoint keeps a finished run's last state: --resume then has nothing to do, and
    with a larger --total-timesteps it trains on; sac_pendulum's training depends on the total
    nowhere (its step sizes stay constant, --lr-decay-start 1), so it ends as the run started
    with that total, bit for bit. A run that kept no state is refused more steps in one line (a
    script chaining runs must not take it for trained)."""
    kept, longer = tmp_path / "kept", tmp_path / "longer"
    shorter = [*SAC_FLAGS, "--total-timesteps", "384", "--no-capture-gif"]
    run("sac_pendulum", [*shorter, "--keep-checkpoint", "--output-dir", str(kept)])
    assert (kept / "checkpoint.msgpack").exists()
    again = run("sac_pendulum", ["--resume", str(kept)])
    assert "has finished: nothing to resume" in again.stdout
    run("sac_pendulum", ["--resume", str(kept), "--total-timesteps", "448", *QUIET])
    run("sac_pendulum", [*SAC_FLAGS, "--output-dir", str(longer)])  # 448 env steps
    assert_same_run(kept, longer)
    assert not (kept / "checkpoint.msgpack").exists()  # this time it was not asked to keep it
    refused = run("sac_pendulum", ["--resume", str(kept), "--total-timesteps", "512"], check=2)
    expected = "--resume must be a run kept with --keep-checkpoint to train longer"
    assert refused.stderr.splitlines() == [f"sac_pendulum.py: error: {expected}, got {kept}"]


def read_events_file(read_events, path: Path) -> list:
    """The events of one file, after the file-version header event."""
    scratch = path.parent.parent / "one_file"
    scratch.mkdir()
    shutil.copy(path, scratch)
    return [event for event in read_events(scratch) if not event.file_version]


@pytest.mark.slow
def test_ctrl_c_on_a_worker_stops_the_pair_and_it_resumes_bit_for_bit(tmp_path):
    """SIGINT to process 1 alone: both processes stop after the chunk (exit 130, as after Ctrl-C)
    and process 0 writes the outputs and every run's state. Resumed, each process restores its
    own runs, and the pair ends as a pair never stopped."""
    import test_distributed

    flags = [*SAC_FLAGS, "--num-seeds", "2"]
    never = test_distributed.start_pair("sac_pendulum", flags, tmp_path / "never", devices=1)
    assert test_distributed.finish(never) == [0, 0]
    lead, worker = test_distributed.start_pair("sac_pendulum", flags, tmp_path / "first", devices=1)
    folder = tmp_path / "first" / "p0"
    deadline = time.monotonic() + 240
    while not (folder / "metrics.csv").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.send_signal(signal.SIGINT)
    assert test_distributed.finish([lead, worker]) == [130, 130], test_distributed.output(folder)
    summary = json.loads((folder / "summary.json").read_text())
    assert summary["stopped_early"] and 0 < summary["env_steps"] < 448
    assert (folder / "checkpoint.msgpack").exists() and (folder / "model.msgpack").exists()
    stopping = "Ctrl-C on another process: stopping after this chunk"
    assert stopping in test_distributed.output(folder)[0]
    assert "Ctrl-C: stopping after this chunk" in test_distributed.output(folder.parent / "p1")[1]
    cluster = [
        "--distributed",
        "--coordinator-address",
        f"127.0.0.1:{test_distributed.free_port()}",
    ]
    again = [
        test_distributed.start(
            "sac_pendulum",
            ["--resume", str(folder), *QUIET, *cluster, "--num-processes", "2"]
            + ["--process-id", str(process)],
            tmp_path / f"again{process}",
            1,
        )
        for process in (0, 1)
    ]
    assert test_distributed.finish(again) == [0, 0], test_distributed.output(tmp_path / "again0")
    assert "resumed at chunk " in test_distributed.output(tmp_path / "again0")[0]
    assert untimed_rows(folder) == untimed_rows(tmp_path / "never" / "p0")
