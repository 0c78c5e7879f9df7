"""Watching a run while it trains, in every script: curves.png redrawn during training off the
chunk loop, --live (live.gif without a display, a window with one), --track (TensorBoard event
files per run with every metric, the config and the evaluation)."""

import importlib
import importlib.util
import json
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import test_ppo_cartpole  # tests/ is on the path: pytest prepends it
import test_sac_pendulum

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


@pytest.mark.parametrize("script", SCRIPTS)
def test_track_without_tensorboardx_is_one_line_and_exit_2(script, capsys, monkeypatch):
    module = importlib.import_module(script)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name: None if name == "tensorboardX" else find_spec(name),
    )
    monkeypatch.setattr(module.jax, "jit", None)  # nothing may be compiled on the way
    with pytest.raises(SystemExit) as exit_:
        module.main(module.parse_config(["--track"]))
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == (
        f"{script}.py: error: --track needs tensorboardX: pip install tensorboardX"
    )


@pytest.mark.parametrize("script", ["sac_pendulum", "ppo_cartpole"])
def test_live_and_track_on_a_sweep(script, tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            str(ROOT / f"{script}.py"),
            *TINY_FLAGS[script],
            *("--live", "--track", "--plot-every", "0.001", "--seed", "3"),
            *("--sweep", "learning-rate=1e-3,1e-2", "--output-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MPLBACKEND": "agg"},
    )
    assert result.returncode == 0, result.stderr
    assert f"{script}: --live: no display here; live.gif shows the policy" in result.stdout
    assert (tmp_path / "live.gif").stat().st_size > 0
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp"))  # every file written atomically
    runs = sorted(path.name for path in (tmp_path / "tensorboard").iterdir())
    assert runs == ["seed3_learning-rate=0.001", "seed3_learning-rate=0.01"]
    metrics = importlib.import_module(script).METRIC_COLUMNS
    summary = json.loads((tmp_path / "summary.json").read_text())
    for run, name in enumerate(runs):
        events = read_events(tmp_path / "tensorboard" / name)
        scalars: dict[str, list] = {}
        for event in events:
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
        assert "charts/sps" in scalars and "charts/episode_length" in scalars
        loss = next(tag for tag in scalars if tag.startswith("losses/"))
        assert loss.removeprefix("losses/") in metrics
        assert all(np.isfinite(value) for _, value in scalars[loss])
        (step, final), *_ = scalars["eval/episode_return"]
        assert step == summary["env_steps"]
        assert final == pytest.approx(summary["final_returns"][run], rel=1e-6)
        texts = [value for event in events for value in event.summary.value if value.tag]
        assert any(value.tag.startswith("config") for value in texts)


def test_curves_are_redrawn_while_training_off_the_chunk_loop(tmp_path):
    """after_chunk returns at once; the drawing runs on the painter thread, at most every
    --plot-every seconds, and a chunk that ends while it is busy skips its redraw."""
    sac = importlib.import_module("sac_pendulum")
    config = sac.Config(plot_every=0.05)
    watch = sac.Watch(config, [{}], tmp_path, sac.seed_keys(config))
    rows = [
        {"seed": 1, "env_steps": step, **{name: 1.0 for name in sac.METRIC_COLUMNS}}
        for step in range(100, 1100, 100)
    ]
    watch.after_chunk(rows[:5], rows[4:5], None)
    assert watch.drawing is None  # not due yet: --plot-every after the start
    time.sleep(0.06)
    watch.after_chunk(rows[:6], rows[5:6], None)
    first = watch.drawing
    assert first is not None
    watch.after_chunk(rows[:7], rows[6:7], None)
    assert watch.drawing is first  # busy (or not due again): no second drawing queued
    watch.settle()
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert not (tmp_path / ".curves.png.tmp").exists()


def test_the_live_window_animates_and_training_goes_on_when_it_is_closed(capsys):
    """The window's code under matplotlib's Agg backend (no display in CI): it draws the curves
    and cycles the policy's frames while a chunk runs; closing it ends the window, not the run."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    sac = importlib.import_module("sac_pendulum")
    window = sac.LiveWindow(plt, "test")
    rows = [{"seed": 1, "env_steps": 100 * i, "episode_return": -100.0 * i} for i in range(1, 4)]
    frames = np.zeros((5, 8, 8, 3), np.uint8)
    frames[:, :, :, 0] = np.arange(5)[:, None, None]
    window.show(rows, frames)
    assert window.tick(0.001) and window.tick(0.001)
    assert window.image is not None and window.image.get_array()[0, 0, 0] == 2  # frame 2 shown
    assert len(window.curves.lines) == 1
    config = sac.Config()
    watch = sac.Watch(config, [{}], Path("."), sac.seed_keys(config))
    watch.window = window
    plt.close(window.figure)
    from concurrent.futures import ThreadPoolExecutor

    future = ThreadPoolExecutor(1).submit(time.sleep, 0.05)
    assert watch.wait(future) is None and watch.window is None
    assert "live window closed; training goes on" in capsys.readouterr().out


def test_ctrl_c_from_a_terminal_stops_the_run_with_its_drawing_process(tmp_path):
    """A terminal's Ctrl-C reaches the whole process group, the drawing process too: the run
    still stops after the chunk, writes everything and exits with 130."""
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
        if progress == 20 and (tmp_path / "live.gif").exists():  # the drawing process is up
            os.killpg(process.pid, signal.SIGINT)
            break
        if progress == 20:
            progress -= 1  # wait for the first drawing
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130, stderr
    assert "stopping after this chunk" in stdout and "Traceback" not in stderr
    for name in ["metrics.csv", "curves.png", "live.gif", "summary.json", "policy.gif"]:
        assert (tmp_path / name).exists(), name
