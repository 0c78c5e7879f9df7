"""Watching a run while it trains, in every script: curves.png redrawn between chunks while the
next chunk runs, --live (the curves and the current policy in a window where a display exists),
--track (TensorBoard event files per run with the values of metrics.csv) and, with
--wandb-project-name, Weights & Biases runs (offline here: read back from their .wandb files)."""

import csv
import importlib
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_ppo_cartpole  # tests/ is on the path: pytest prepends it
import test_sac_pendulum
from conftest import in_process

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
# Small runs of a SAC and a PPO script, as each script's own tests define them.
TINY_FLAGS = {
    "sac_pendulum": test_sac_pendulum.TINY_FLAGS,
    "ppo_cartpole": test_ppo_cartpole.TINY_FLAGS,
}


def read_events(directory: Path) -> list:
    """Every Event in a TensorBoard event directory (TFRecord: length, crc, data, crc)."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted(directory.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        offset = 0
        while offset < len(data):
            (length,) = struct.unpack("<Q", data[offset : offset + 8])
            event = event_pb2.Event()
            event.ParseFromString(data[offset + 12 : offset + 12 + length])
            events.append(event)
            offset += 12 + length + 4
    return events


def read_wandb(folder: Path) -> dict[str, list]:
    """Every record of every W&B run under `folder` (its wandb/ folder), by run id, in the order
    written (a resumed run: its files one after another). wandb ships no reader of its .wandb
    files: each is a ':W&B' header (7 bytes), then LevelDB's log format (32 KiB blocks of records,
    each a 7-byte header: checksum, length, type; FULL or FIRST..MIDDLE..LAST pieces) holding
    wandb.proto.wandb_internal_pb2.Record messages."""
    from wandb.proto import wandb_internal_pb2

    runs: dict[str, list] = {}
    for path in sorted(folder.glob("wandb/offline-run-*/run-*.wandb")):  # by start time
        data = path.read_bytes()
        assert data[:4] == b":W&B"
        offset, pending = 7, b""
        while offset + 7 <= len(data):
            if 32768 - offset % 32768 < 7:  # a block's tail too short for a header: padding
                offset += 32768 - offset % 32768
                continue
            length, kind = struct.unpack("<HB", data[offset + 4 : offset + 7])
            pending += data[offset + 7 : offset + 7 + length]
            offset += 7 + length
            if kind in (1, 4):  # FULL, or the LAST piece of a record
                record = wandb_internal_pb2.Record()
                record.ParseFromString(pending)
                runs.setdefault(path.stem.removeprefix("run-"), []).append(record)
                pending = b""
    return runs


def wandb_history(records: list) -> list[dict]:
    """The rows a W&B run logged, each {name: value} with its step as _step."""
    rows = [record.history for record in records if record.WhichOneof("record_type") == "history"]
    return [{item.nested_key[0]: json.loads(item.value_json) for item in row.item} for row in rows]


def test_the_wandb_reader_reads_records_split_across_blocks(tmp_path):
    """The reader joins a record's pieces and skips a block's padding, as LevelDB writes them."""
    from wandb.proto import wandb_internal_pb2

    record = wandb_internal_pb2.Record()
    item = record.history.item.add()
    item.nested_key.append("episode_return")
    item.value_json = json.dumps("x" * 40_000)  # longer than a block: FIRST, then LAST
    data = record.SerializeToString()
    first = 32768 - 7 - 7 - 3  # the first block: the file's header, a record's, a piece, padding
    blocks = b":W&B" + bytes(3) + bytes(4) + struct.pack("<HB", first, 2) + data[:first] + bytes(3)
    blocks += bytes(4) + struct.pack("<HB", len(data) - first, 4) + data[first:]
    path = tmp_path / "wandb" / "offline-run-1-abc" / "run-abc.wandb"
    path.parent.mkdir(parents=True)
    path.write_bytes(blocks)
    assert wandb_history(read_wandb(tmp_path)["abc"]) == [{"episode_return": "x" * 40_000}]


@pytest.mark.parametrize("script", SCRIPTS)
def test_wandb_without_wandb_or_without_track_is_one_line_and_exit_2(script, monkeypatch):
    module = importlib.import_module(script)
    status, _, stderr = in_process(module, "--wandb-project-name", "demo")
    assert status == 2 and stderr.strip() == (
        f"{script}.py: error: --wandb-project-name NAME (and --wandb-entity) go with --track"
    )
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name: None if name == "wandb" else find_spec(name)
    )
    status, _, stderr = in_process(module, "--track", "--wandb-project-name", "demo")
    assert status == 2 and stderr.strip() == (
        f"{script}.py: error: --wandb-project-name needs wandb: pip install wandb"
    )


@pytest.mark.parametrize("script", SCRIPTS)
def test_track_without_tensorboardx_is_one_line_and_exit_2(script, monkeypatch):
    module = importlib.import_module(script)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: None if name == "tensorboardX" else find_spec(name),
    )
    status, _, stderr = in_process(module, "--track")
    assert status == 2 and stderr.strip() == (
        f"{script}.py: error: --track needs tensorboardX: pip install tensorboardX"
    )


@pytest.mark.parametrize("script", ["sac_pendulum", "ppo_cartpole"])
def test_live_and_track_on_a_sweep(script, tmp_path):
    """Headless --live says so once; --track writes TensorBoard and, offline, W&B runs: one per
    run, with its config as run, metrics.csv's values at their env steps, its final evaluation,
    and the GIF with the first."""
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / f"{script}.py"),
            *TINY_FLAGS[script],
            *("--live", "--track", "--plot-every", "0.001", "--seed", "3"),
            *("--wandb-project-name", "demo", "--wandb-entity", "team"),
            *("--sweep", "gamma=0.9,0.99", "--output-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MPLBACKEND": "agg", "WANDB_MODE": "offline"},
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count(f"{script}: --live: no display (agg backend): see curves.png") == 1
    assert f"{script}: W&B: 2 runs in {tmp_path / 'wandb'}" in result.stdout
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp"))  # every file written atomically
    runs = sorted(path.name for path in (tmp_path / "tensorboard").iterdir())
    assert runs == ["seed3_gamma=0.9", "seed3_gamma=0.99"]
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    columns = ["updates", "wall_seconds", "sps", *importlib.import_module(script).METRIC_COLUMNS]
    for run, name in enumerate(runs):
        scalars: dict[str, list] = {}
        for event in read_events(tmp_path / "tensorboard" / name):
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
        assert set(scalars) == set(columns)
        expected = [  # metrics.csv's values, at their env steps
            (int(row["env_steps"]), float(row["episode_length"])) for row in rows[run::2]
        ]
        steps, values = zip(*scalars["episode_length"], strict=True)
        assert list(steps) == [step for step, _ in expected]
        np.testing.assert_allclose(values, [value for _, value in expected], rtol=1e-6)
    summary = json.loads((tmp_path / "summary.json").read_text())
    wandb_runs = read_wandb(tmp_path)
    assert len(wandb_runs) == 2
    for records in wandb_runs.values():
        (start,) = [record.run for record in records if record.WhichOneof("record_type") == "run"]
        config = {item.key: json.loads(item.value_json) for item in start.config.update}
        run = [0.9, 0.99].index(config["gamma"])  # its grid point's value, its own seed
        assert config["seed"] == 3 and config["sweep"] == ["gamma=0.9,0.99"]
        assert (start.project, start.entity) == ("demo", "team")
        assert start.run_group == f"{tmp_path.name} gamma={config['gamma']}"
        assert start.display_name == f"{tmp_path.name}/{runs[run]}"
        logged = wandb_history(records)
        assert [row["_step"] for row in logged] == [int(row["env_steps"]) for row in rows[run::2]]
        for row, csv_row in zip(logged, rows[run::2], strict=True):
            np.testing.assert_allclose(
                [row[name] for name in columns], [float(csv_row[name]) for name in columns]
            )
        final = {}
        for record in records:
            if record.WhichOneof("record_type") == "summary":
                final |= {item.key: json.loads(item.value_json) for item in record.summary.update}
        assert final["final_episode_return"] == pytest.approx(summary["final_returns"][run])
    gifs = [path.parent.parent.name for path in tmp_path.glob("wandb/*/files/media/*/policy_*.gif")]
    assert len(gifs) == 1  # the first run's: the one policy.gif shows
    # headless, --live draws the first run's policy into curves.png, below the curves
    from PIL import Image

    assert Image.open(tmp_path / "curves.png").size[1] > 900  # the policy's row


def test_curves_are_redrawn_between_chunks_at_most_every_plot_every(tmp_path, monkeypatch):
    sac = importlib.import_module("sac_pendulum")
    saved = []
    write_atomic = sac.write_atomic

    def write_and_note_the_curves(path, data):
        write_atomic(path, data)
        if path.name == "curves.png":
            saved.append(path)

    monkeypatch.setattr(sac, "write_atomic", write_and_note_the_curves)
    flags = [*TINY_FLAGS["sac_pendulum"], "--no-capture-gif", "--no-save-model"]
    for plot_every, expected in [("0.001", range(5, 7)), ("0", range(1, 2))]:
        saved.clear()
        out = tmp_path / plot_every
        sac.main(*sac.parse_args([*flags, "--plot-every", plot_every, "--output-dir", str(out)]))
        assert len(saved) in expected  # after each of the 6 chunks (maybe not the first), or once
        assert set(saved) == {out / "curves.png"}


def test_the_live_window_shows_the_policy_below_the_curves(monkeypatch):
    """The window's code under matplotlib's Agg backend (no display in CI), as with one."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "get_backend", lambda: "tkagg")  # as where a display exists
    shown = []
    monkeypatch.setattr(plt, "show", lambda block: shown.append(block))
    sac = importlib.import_module("sac_pendulum")
    figure = sac.new_figure(live=True)
    assert shown == [False] and plt.fignum_exists(figure.number)  # a pyplot window
    rows = [
        {"seed": 1, "env_steps": 100 * i, **{name: -100.0 * i for name in sac.METRIC_COLUMNS}}
        for i in range(1, 4)
    ]
    frames = np.zeros((5, 128, 384, 3), np.uint8)  # three pendulums side by side
    frames[2, :, :, 0] = 200  # the middle frame is shown
    sac.draw_curves(figure, sac.Config(), [{}], rows, frames)
    policy = figure.axes[-1]
    assert policy.get_images()[0].get_array()[0, 0, 0] == 200
    figure.canvas.draw()  # the constrained layout places the panels when drawn
    width = policy.get_position().width  # a row of its own, not a third of one
    assert width > 1.5 * figure.axes[0].get_position().width
    assert len(figure.axes[0].lines) == 2  # the return curve and the solved bar
    plt.close(figure)


def test_ctrl_c_from_a_terminal_stops_a_live_run_after_the_chunk(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group: the run stops after the chunk, writes
    everything and exits with 130, with curves and the policy drawn every chunk."""
    process = subprocess.Popen(
        [
            sys.executable,
            str(ROOT / "sac_pendulum.py"),
            *TINY_FLAGS["sac_pendulum"],
            *("--total-timesteps", "400000", "--plot-every", "0.001", "--live"),
            *("--output-dir", str(tmp_path)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a terminal's foreground job
        env={**os.environ, "MPLBACKEND": "agg"},
    )
    progress = 0
    for line in process.stdout:
        progress += line.startswith("steps")
        if progress == 5:
            os.killpg(process.pid, signal.SIGINT)
            break
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "stopping after this chunk" in stderr and "Traceback" not in stderr
    for name in ["metrics.csv", "curves.png", "summary.json", "policy.gif"]:
        assert (tmp_path / name).exists(), name
