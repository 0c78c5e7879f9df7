"""Watching a run while it trains, in every script: curves.png redrawn between chunks while the
next chunk runs, --live (the curves and the current policy in a window where a display exists),
--track (TensorBoard event files per run with every metric, the config and the evaluation)."""

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
        module.main(*module.parse_args(["--track", "--no-compile-cache"]))
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
            *("--sweep", "gamma=0.9,0.99", "--output-dir", str(tmp_path)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "MPLBACKEND": "agg"},
    )
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "curves.png").stat().st_size > 0
    assert not list(tmp_path.glob(".*.tmp"))  # every file written atomically
    runs = sorted(path.name for path in (tmp_path / "tensorboard").iterdir())
    assert runs == ["seed3_gamma=0.9", "seed3_gamma=0.99"]
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


def test_curves_are_redrawn_between_chunks_at_most_every_plot_every(tmp_path, monkeypatch):
    sac = importlib.import_module("sac_pendulum")
    saved = []
    monkeypatch.setattr(sac.Plots, "save", lambda plots, path: saved.append(path))
    flags = [*TINY_FLAGS["sac_pendulum"], "--no-capture-gif", "--no-save-model"]
    for plot_every, expected in [("0.001", range(6, 8)), ("0", range(1, 2))]:
        saved.clear()
        out = tmp_path / plot_every
        sac.main(*sac.parse_args([*flags, "--plot-every", plot_every, "--output-dir", str(out)]))
        assert (
            len(saved) in expected
        )  # a redraw after each of the 6 chunks (or none), then the last
        assert set(saved) == {out / "curves.png"}


def test_the_live_window_animates_the_policy_and_training_goes_on_once_it_is_closed(monkeypatch):
    """The window's code under matplotlib's Agg backend (no display in CI), as with one."""
    import matplotlib

    matplotlib.use("agg")
    import matplotlib.pyplot as plt

    monkeypatch.setattr(plt, "get_backend", lambda: "tkagg")  # as where a display exists
    monkeypatch.setattr(plt, "show", lambda block: None)
    sac = importlib.import_module("sac_pendulum")
    config = sac.Config()
    plots = sac.Plots(config, sac.Options(live=True), [{}])
    assert plots.window and plots.render is not None
    rows = [
        {"seed": 1, "env_steps": 100 * i, **{name: -100.0 * i for name in sac.METRIC_COLUMNS}}
        for i in range(1, 4)
    ]
    frames = np.zeros((5, 8, 8, 3), np.uint8)
    frames[:, :, :, 0] = np.arange(5)[:, None, None]
    plots.update(rows, frames)
    shown = set()
    for _ in range(6):
        assert plots.animate()
        shown.add(int(plots.image.get_array()[0, 0, 0]))
    assert len(shown) > 1  # the frames cycle
    assert len(plots.axes[0].lines) == 2  # the return curve and the solved bar
    plt.close(plots.figure)
    assert not plots.animate()  # closed: the loop waits on the chunk without it
    sac.wait_for(sac.jnp.zeros(3), plots)


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
