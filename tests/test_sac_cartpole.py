"""Tests of sac_cartpole.py: the per-task defaults, bootstrapping (terminations stop it, the time
limit does not), the upright count of the evaluation, seeds under vmap, the CLI contract (in
subprocesses) and, marked slow, that a short run learns to balance. The buffer and the losses
are sac_pendulum.py's and are tested there."""

import csv
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import chex
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import sac_cartpole as sac

SCRIPT = Path(__file__).resolve().parents[1] / "sac_cartpole.py"
# A run small enough to compile and train in seconds, with several chunks and real updates: swing-up
# on a 3 cm track with 8-step episodes, so that both kinds of episode end happen within it.
TINY = sac.Config(
    env_id="CartPoleSwingup",
    num_envs=4,
    total_timesteps=128,
    log_every=32,
    learning_starts=8,
    batch_size=8,
    buffer_size=128,
    hidden_sizes=(16,),
    eval_episodes=4,
    env=sac.EnvConfig(x_threshold=0.03, max_steps_in_episode=8),
)
TINY_FLAGS = [
    "--env-id",
    "CartPoleSwingup",
    "--num-envs",
    "4",
    "--total-timesteps",
    "128",
    "--log-every",
    "32",
    "--learning-starts",
    "8",
    "--batch-size",
    "8",
    "--buffer-size",
    "128",
    "--hidden-sizes",
    "16",
    "--eval-episodes",
    "4",
    "--env.x-threshold",
    "0.03",
    "--env.max-steps-in-episode",
    "8",
]


# ---- per-task defaults ----


def test_each_task_has_its_defaults_and_flags_override_them():
    assert sac.parse_config([]) == sac.Config() == sac.default_config("CartPoleContinuous")
    swingup = sac.default_config("CartPoleSwingup")
    assert swingup.env_id == "CartPoleSwingup"
    assert swingup != dataclasses.replace(
        sac.Config(), env_id="CartPoleSwingup"
    )  # its own defaults
    for flags in [
        ["--gamma", "0.9", "--env-id", "CartPoleSwingup"],
        ["--env_id=CartPoleSwingup", "--gamma", "0.9"],
    ]:
        assert sac.parse_config(flags) == dataclasses.replace(swingup, gamma=0.9)
    assert sac.parse_config(["--env.force-mag", "20"]).env == sac.EnvConfig(force_mag=20.0)


# ---- bootstrapping: terminations stop it, the time limit does not ----


def test_td_target_by_hand():
    # reward 1 twice: the first transition terminated (its target is the reward alone); the second
    # did not, whether or not the time limit cut it (stored terminated = 0: it bootstraps)
    batch = sac.Transition(
        obs=jnp.zeros((2, 4)),
        action=jnp.zeros((2, 1)),
        reward=jnp.array([1.0, 1.0]),
        next_obs=jnp.zeros((2, 4)),
        terminated=jnp.array([1.0, 0.0]),
    )
    next_q = jnp.array([[10.0, 20.0], [12.0, 18.0]])  # [critic, batch]
    target = sac.td_target(
        batch, next_q, next_log_prob=jnp.array([-1.0, 2.0]), alpha=0.5, gamma=0.9
    )
    np.testing.assert_allclose(target, [1.0, 1 + 0.9 * (18 - 0.5 * 2)], rtol=1e-6)


@pytest.fixture(scope="module")
def two_seed_run():
    config = dataclasses.replace(TINY, seed=3, num_seeds=2)
    _, _, train = sac.make_train(config)
    return config, train, jax.jit(jax.vmap(train))(sac.seed_keys(config))


def test_stored_episode_ends_terminate_only_off_the_track(two_seed_run):
    """In the buffer of a TINY run (every step stored, in order) an episode ends either by a
    termination, stored as terminated = 1 exactly where the cart left the track, or by the 8-step
    time limit, stored as terminated = 0 (it bootstraps), and next_obs is the episode's own last
    observation (one Euler step on from obs), not the next episode's first."""
    _, _, (state, _) = two_seed_run
    data = jax.tree.map(
        lambda x: np.asarray(x[0]).reshape(-1, TINY.num_envs, *x.shape[2:]), state.buffer.data
    )
    assert (
        int(state.buffer.size[0]) == TINY.total_timesteps == TINY.buffer_size
    )  # all of them, in order
    off_track = np.abs(data.next_obs[..., 0]) > TINY.env.x_threshold
    np.testing.assert_array_equal(data.terminated, off_track.astype(np.float32))
    np.testing.assert_allclose(
        data.next_obs[..., 0],
        data.obs[..., 0] + TINY.env.tau * data.obs[..., 1],
        rtol=1e-5,
        atol=1e-6,
    )
    ends = ~np.all(
        data.next_obs[:-1] == data.obs[1:], axis=-1
    )  # [step, env]: a new episode follows
    counts = {"terminated": 0, "time limit": 0}
    for env in range(TINY.num_envs):
        length = 0
        for step in range(len(ends)):
            length += 1
            terminated = bool(data.terminated[step, env])
            assert ends[step, env] == (terminated or length == TINY.env.max_steps_in_episode), (
                step,
                env,
            )
            if ends[step, env]:
                counts["terminated" if terminated else "time limit"] += 1
                length = 0
    assert min(counts.values()) >= 3, counts


# ---- seeds ----


def test_vmapped_seed_equals_single_run_and_seeds_differ(two_seed_run):
    config, train, (state, metrics) = two_seed_run
    assert metrics.episode_return.shape == (2, sac.chunk_counts(config)[1])
    assert (
        int(state.learner.updates[0])
        == (TINY.total_timesteps - TINY.learning_starts) // TINY.num_envs
    )
    single_state, single_metrics = jax.jit(train)(jax.random.key(4))  # seed 3 + 1 alone
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[1], state.learner.actor_params),
        single_state.learner.actor_params,
        rtol=1e-4,
        atol=1e-5,
    )
    np.testing.assert_allclose(
        metrics.losses.critic_loss[1], single_metrics.losses.critic_loss, rtol=1e-3
    )
    first, second = (
        jax.tree.map(lambda x: x[0], state.learner.actor_params),
        single_state.learner.actor_params,
    )
    assert not np.allclose(
        jax.flatten_util.ravel_pytree(first)[0], jax.flatten_util.ravel_pytree(second)[0]
    )


# ---- evaluation: return and upright fraction ----


@pytest.mark.parametrize(
    "env_id, steps, expected_upright",
    [
        # Balance without force: from at most 0.05 rad the pole needs about half a second to pass 12
        # degrees, so 10-step episodes end upright, and these 100-step ones all fall before the end.
        ("CartPoleContinuous", 10, 1.0),
        ("CartPoleContinuous", 100, 0.0),
        # Swing-up without force: the pole hangs down the whole episode.
        ("CartPoleSwingup", 10, 0.0),
    ],
)
def test_evaluation_counts_episodes_upright_through_the_second_half(
    env_id, steps, expected_upright
):
    config = dataclasses.replace(
        TINY, env_id=env_id, eval_episodes=8, env=sac.EnvConfig(max_steps_in_episode=steps)
    )
    setup = sac.make_setup(config)
    no_force = jax.tree.map(
        jnp.zeros_like,
        sac.init_params(setup.actor, jax.random.key(0), jnp.zeros((1, setup.obs_dim))),
    )  # tanh(0) = 0
    mean_return, upright_fraction, states = jax.jit(sac.make_evaluate(config))(
        no_force, jax.random.key(3)
    )
    assert float(upright_fraction) == expected_upright
    assert jax.tree.leaves(states)[0].shape[:2] == (steps, sac.GIF_ENVS)
    if env_id == "CartPoleContinuous":  # 1 per step until the pole falls
        assert (float(mean_return) == steps) == (expected_upright == 1.0)
        theta = np.asarray(states.theta)
        fell = np.argmax(np.abs(theta) > config.env.theta_threshold_radians, axis=0)
        for env, step in enumerate(fell):  # the GIF's state stays where a fallen episode ended
            if step:
                np.testing.assert_array_equal(theta[step:, env], theta[step, env])


# ---- the command line contract (subprocesses) ----


def run(*flags, env=None, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), *flags],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **(env or {})},
        **kwargs,
    )


def test_help_lists_every_option_with_the_task_defaults():
    result = run("--help")
    assert result.returncode == 0
    for flag in [
        "--env-id",
        "--seed",
        "--num-seeds",
        "--num-envs",
        "--learning-rate",
        "--tau",
        "--updates-per-step",
        "--max-grad-norm",
        "--no-capture-gif",
        "--eval-only",
        "--env.force-mag",
        "--env.x-threshold",
    ]:
        assert flag in result.stdout

    def default_total_timesteps(text: str) -> int:
        return int(re.search(r"--total-timesteps.*?\(default: (\d+)\)", text, re.DOTALL).group(1))

    swingup = run("--env-id", "CartPoleSwingup", "--help")
    assert default_total_timesteps(result.stdout) == sac.Config().total_timesteps
    assert (
        default_total_timesteps(swingup.stdout)
        == sac.default_config("CartPoleSwingup").total_timesteps
    )


@pytest.mark.parametrize(
    "flags, names",
    [
        (["--gamma", "1.5"], "--gamma"),
        (["--env.masspole", "0"], "--env.masspole"),
        (["--env-id", "CartPole-v1"], "--env-id"),
        (
            ["--env-id", "CartPole-v1"],
            "'CartPoleSwingup')",
        ),  # tyro's message wraps: the whole of it, on one line
        (["--eval-only"], "--load-model"),
    ],
)
def test_bad_flags_exit_2_with_one_line(flags, names):
    result = run(*flags)
    assert result.returncode == 2
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert names in result.stderr and "Traceback" not in result.stderr


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run(*TINY_FLAGS, "--num-seeds", "2", "--seed", "5", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    return out, result


def test_run_writes_every_output(finished_run):
    out, result = finished_run
    assert (
        "replay buffer" in result.stdout
        and "compiled in" in result.stdout
        and "SPS" in result.stdout
    )
    for name in [
        "config.json",
        "metrics.csv",
        "summary.json",
        "curves.png",
        "policy.gif",
        "model.msgpack",
    ]:
        assert (out / name).stat().st_size > 0, name
    assert not list(out.glob(".*tmp*"))  # no temporary files left behind
    assert json.loads((out / "config.json").read_text())["env_id"] == "CartPoleSwingup"
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert list(rows[0]) == sac.CSV_COLUMNS
    assert len(rows) == 2 * sac.chunk_counts(TINY)[1] and {row["seed"] for row in rows} == {
        "5",
        "6",
    }
    summary = json.loads((out / "summary.json").read_text())
    for key in [
        "final_returns",
        "final_return_mean",
        "final_return_std",
        "final_upright_fractions",
        "train_seconds",
        "compile_seconds",
        "env_steps_per_second",
        "updates_per_second",
        "num_seeds",
        "num_envs",
        "device",
    ]:
        assert key in summary, key
    assert len(summary["final_returns"]) == len(summary["final_upright_fractions"]) == 2


def test_eval_only_reproduces_the_saved_evaluation(finished_run, tmp_path):
    """The checkpoint brings its env settings, network and seeds; --env-id must name its task."""
    out, _ = finished_run
    result = run(
        "--env-id",
        "CartPoleSwingup",
        "--eval-only",
        "--load-model",
        str(out / "model.msgpack"),
        "--eval-episodes",
        "4",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    saved, reproduced = (
        json.loads((path / "summary.json").read_text()) for path in [out, tmp_path]
    )
    for key in ["final_returns", "final_upright_fractions"]:
        assert reproduced[key] == saved[key], key
    assert (tmp_path / "policy.gif").stat().st_size > 0 and not (
        tmp_path / "model.msgpack"
    ).exists()


def test_eval_only_refuses_other_checkpoints(finished_run, tmp_path):
    out, _ = finished_run
    payload = flax.serialization.msgpack_restore((out / "model.msgpack").read_bytes())
    other = tmp_path / "other.msgpack"
    foreign = {**payload, "script": "sac_pendulum", "env_id": "Pendulum-v1", "config": "{}"}
    other.write_bytes(flax.serialization.msgpack_serialize(foreign))
    for flags, expected in [
        (["--load-model", str(other)], "sac_pendulum checkpoint for Pendulum-v1"),
        (["--load-model", str(out / "model.msgpack")], "checkpoint for CartPoleSwingup"),
    ]:
        result = run(
            "--eval-only", *flags
        )  # the second: a swing-up checkpoint, evaluated as balance
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_two_devices_shard_the_seeds(finished_run, tmp_path):
    out, _ = finished_run
    two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = run(
        *TINY_FLAGS,
        "--num-seeds",
        "2",
        "--seed",
        "5",
        "--output-dir",
        str(tmp_path),
        "--no-plot",
        "--no-capture-gif",
        "--no-save-model",
        env=two_devices,
    )
    assert result.returncode == 0, result.stderr
    assert "on 2 device(s)" in result.stdout
    one = [float(row["critic_loss"]) for row in csv.DictReader((out / "metrics.csv").open())]
    two = [float(row["critic_loss"]) for row in csv.DictReader((tmp_path / "metrics.csv").open())]
    np.testing.assert_allclose(two, one, rtol=1e-3)
    odd = run(*TINY_FLAGS, "--num-seeds", "3", env=two_devices)
    assert odd.returncode == 2 and "--num-seeds" in odd.stderr


def test_ctrl_c_stops_after_the_chunk_and_writes_everything(tmp_path):
    flags = [*TINY_FLAGS, "--total-timesteps", "200000", "--output-dir", str(tmp_path)]
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in process.stdout:
        if line.startswith("steps"):
            process.send_signal(signal.SIGINT)
            break
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 0, stderr
    assert "stopping after this chunk" in stdout
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert 1 <= len(rows) < sac.chunk_counts(dataclasses.replace(TINY, total_timesteps=200000))[1]
    for name in ["summary.json", "curves.png", "policy.gif", "model.msgpack"]:
        assert (tmp_path / name).exists(), name


# ---- learning ----


@pytest.mark.slow
def test_default_config_learns_to_balance():
    """Seeds 1 and 2 of the default config, whole (4,000 updates; about 20 s of training on 2 CPU
    cores): a random policy falls after about 20 steps; our runs of these seeds, and of 8 seeds,
    all ended at 500 in every evaluation episode (the threshold 400 leaves a margin)."""
    config = dataclasses.replace(sac.Config(), num_seeds=2, eval_episodes=20)
    _, _, train = sac.make_train(config)
    keys = sac.seed_keys(config)
    state, metrics = jax.jit(jax.vmap(train))(keys)
    returns, _, _ = jax.jit(jax.vmap(sac.make_evaluate(config)))(
        state.learner.actor_params, jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    )
    assert np.all(np.asarray(returns) >= 400), returns
    assert np.all(metrics.episode_return[:, 0] < 100)  # it started from a poor policy
