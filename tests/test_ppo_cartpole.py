"""Tests of ppo_cartpole.py: the maths on hand-made numbers, seeds and determinism of the pure
core, the script contract through the CLI, and (slow) that a short run learns."""

import csv
import dataclasses
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import serialization

import ppo_cartpole as ppo

SCRIPT = str(Path(__file__).resolve().parents[1] / "ppo_cartpole.py")
# A tiny config: 2 chunks of 2 iterations of 4 envs x 16 steps; compiles and runs in seconds.
TINY = ppo.Config(
    num_envs=4,
    num_steps=16,
    num_minibatches=2,
    update_epochs=2,
    hidden_size=16,
    log_every=128,
    total_timesteps=256,
    eval_episodes=2,
)
TINY_FLAGS = [
    "--num-envs",
    "4",
    "--num-steps",
    "16",
    "--num-minibatches",
    "2",
    "--update-epochs",
    "2",
    "--hidden-size",
    "16",
    "--log-every",
    "128",
    "--total-timesteps",
    "256",
    "--eval-episodes",
    "2",
]


def run_script(
    *flags: str, env: dict | None = None, timeout: int = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, SCRIPT, *flags],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, **(env or {})},
    )


# ---------------------------------------------------------------------------------------------
# the maths, on hand-made numbers
# ---------------------------------------------------------------------------------------------


def test_gae_matches_hand_computation():
    # One env, six steps: t=1 is cut by the time limit (bootstraps the final observation's value
    # 10.0, not the next state's), t=3 terminates (bootstraps nothing), t=5 both terminates and
    # hits the time limit (as CartPole reports it at step 500: a termination, no bootstrap).
    rewards = jnp.array([1.0, 2.0, 3.0, 4.0, 5.0, 1.0])[:, None]
    values = jnp.array([0.5, 1.0, 1.5, 2.0, 2.5, 0.5])[:, None]
    next_values = jnp.array([1.0, 10.0, 2.0, 7.0, 3.0, 100.0])[:, None]
    terminated = jnp.array([False, False, False, True, False, True])[:, None]
    truncated = jnp.array([False, True, False, False, False, True])[:, None]
    gamma, gae_lambda = 0.9, 0.8  # gamma * lambda = 0.72
    # deltas r + gamma * V' * (1 - terminated) - V:
    #   1 + 0.9 * 1 - 0.5 = 1.4 | 2 + 0.9 * 10 - 1 = 10.0 | 3 + 0.9 * 2 - 1.5 = 3.3
    #   4 - 2 = 2.0 | 5 + 0.9 * 3 - 2.5 = 5.2 | 1 - 0.5 = 0.5
    # advantages, backwards, the sum cut after every episode end (t = 1, 3, 5):
    #   A5 = 0.5, A4 = 5.2 + 0.72 * 0.5 = 5.56, A3 = 2.0, A2 = 3.3 + 0.72 * 2.0 = 4.74,
    #   A1 = 10.0, A0 = 1.4 + 0.72 * 10.0 = 8.6
    expected = np.array([8.6, 10.0, 4.74, 2.0, 5.56, 0.5])[:, None]
    advantages, targets = ppo.compute_gae(
        rewards, values, next_values, terminated, truncated, gamma, gae_lambda
    )
    np.testing.assert_allclose(advantages, expected, rtol=1e-6)
    np.testing.assert_allclose(targets, expected + values, rtol=1e-6)


def test_policy_loss_on_a_hand_made_batch():
    ratios = jnp.array([1.5, 0.5, 1.1, 0.7])
    advantages = jnp.array([1.0, 1.0, -1.0, -1.0])
    old_log_prob = jnp.array([-0.3, -1.2, -0.7, -2.0])
    log_prob = old_log_prob + jnp.log(ratios)
    # per sample max(-A r, -A clip(r, 0.8, 1.2)):
    #   max(-1.5, -1.2) = -1.2 (clipped) | max(-0.5, -0.8) = -0.5 | max(1.1, 1.1) = 1.1
    #   | max(0.7, 0.8) = 0.8 (clipped)
    loss, approx_kl, clip_frac = ppo.policy_loss(log_prob, old_log_prob, advantages, 0.2)
    np.testing.assert_allclose(loss, (-1.2 - 0.5 + 1.1 + 0.8) / 4, rtol=1e-5)
    np.testing.assert_allclose(clip_frac, 3 / 4)  # |r - 1| > 0.2 for 1.5, 0.5 and 0.7
    np.testing.assert_allclose(
        approx_kl, np.mean((np.array(ratios) - 1) - np.log(ratios)), rtol=1e-5
    )
    # The clipped samples give no gradient; the others -A r / 4 (d r / d log_prob = r).
    gradient = jax.grad(lambda lp: ppo.policy_loss(lp, old_log_prob, advantages, 0.2)[0])(log_prob)
    np.testing.assert_allclose(gradient, [0.0, -0.5 / 4, 1.1 / 4, 0.0], rtol=1e-5, atol=1e-7)


def test_value_loss_clipping_on_a_hand_made_batch():
    values, old_values, targets = (
        jnp.array([1.0, 3.0]),
        jnp.array([2.0, 2.0]),
        jnp.array([0.0, 0.0]),
    )
    # plain errors 1 and 9; clipped values 1.5 and 2.5 give 2.25 and 6.25; the larger: 2.25, 9
    np.testing.assert_allclose(
        ppo.value_loss(values, old_values, targets, 0.5, clip_vloss=False), 0.5 * 10 / 2
    )
    np.testing.assert_allclose(
        ppo.value_loss(values, old_values, targets, 0.5, clip_vloss=True), 0.5 * 11.25 / 2
    )


def test_minibatches_cover_every_sample_once_per_epoch():
    for seed in range(3):
        indices = np.asarray(ppo.minibatch_indices(jax.random.key(seed), 4, 96, 3))
        assert indices.shape == (4, 3, 32)
        for epoch in indices:
            np.testing.assert_array_equal(np.sort(epoch.reshape(-1)), np.arange(96))
        assert len({epoch.tobytes() for epoch in indices}) == 4  # a fresh permutation each epoch


def test_init_is_orthogonal_with_the_gains_of_huang_et_al():
    actor, critic = ppo.make_networks(TINY, num_actions=2)
    params = ppo.init_orthogonal(
        {"actor": (actor, 0.01), "critic": (critic, 1.0)}, jax.random.key(0), (4,)
    )
    for net, head_gain in [("actor", 0.01), ("critic", 1.0)]:
        for layer, gain in [
            ("Dense_0", np.sqrt(2)),
            ("Dense_1", np.sqrt(2)),
            ("Dense_2", head_gain),
        ]:
            weights = np.asarray(params[net]["params"][layer]["kernel"]) / gain
            gram = (
                weights.T @ weights if weights.shape[0] >= weights.shape[1] else weights @ weights.T
            )
            np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-5, err_msg=f"{net} {layer}")
            np.testing.assert_array_equal(params[net]["params"][layer]["bias"], 0.0)


# ---------------------------------------------------------------------------------------------
# the pure core: seeds and determinism
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runs():
    """Seeds 0 and 1 of TINY trained in one vmapped program, and seed 1 alone, twice."""
    _, _, train = ppo.make_train(TINY)
    keys = ppo.seed_keys(dataclasses.replace(TINY, num_seeds=2))
    vmapped = jax.jit(jax.vmap(train))(keys)
    single = jax.jit(train)
    return vmapped, single(keys[1]), single(keys[1])


def test_vmapped_seed_matches_the_single_run(tiny_runs):
    (vmapped_state, vmapped_metrics), (state, metrics), _ = tiny_runs
    chex_close = dict(rtol=1e-4, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a[1], b, **chex_close),
        vmapped_state.params,
        state.params,
    )
    for name in ppo.METRIC_NAMES:
        np.testing.assert_allclose(vmapped_metrics[name][1], metrics[name], **chex_close)
    assert metrics["value_loss"].shape == (ppo.sizes(TINY).num_chunks,)


def test_different_seeds_give_different_networks(tiny_runs):
    (state, _), _, _ = tiny_runs
    kernel = state.params["actor"]["params"]["Dense_0"]["kernel"]
    assert not np.allclose(kernel[0], kernel[1])


def test_same_seed_gives_identical_metrics(tiny_runs):
    _, (_, first), (_, second) = tiny_runs
    for name in ppo.METRIC_NAMES:
        np.testing.assert_array_equal(first[name], second[name])


# ---------------------------------------------------------------------------------------------
# the contract, through the CLI
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(num_envs=0), "--num-envs"),
        (dict(num_steps=-1), "--num-steps"),
        (dict(learning_rate=0.0), "--learning-rate"),
        (dict(gamma=1.5), "--gamma"),
        (dict(gamma=0.0), "--gamma"),
        (dict(gae_lambda=-0.1), "--gae-lambda"),
        (dict(ent_coef=-1.0), "--ent-coef"),
        (dict(num_minibatches=3), "--num-minibatches"),
        (dict(total_timesteps=100), "--total-timesteps"),
        (dict(env=ppo.EnvConfig(length=0.0)), "--env.length"),
        (dict(eval_only=True), "--load-model"),
        (dict(load_model="model.msgpack"), "--eval-only"),
    ],
)
def test_validate_names_the_bad_flag(change, flag):
    with pytest.raises(ppo.UsageError, match=flag):
        ppo.validate(dataclasses.replace(TINY, **change))


def test_help_lists_every_option():
    result = run_script("--help")
    assert result.returncode == 0
    for flag in [
        "--seed",
        "--num-envs",
        "--total-timesteps",
        "--learning-rate",
        "--num-steps",
        "--anneal-lr",
        "--gamma",
        "--gae-lambda",
        "--num-minibatches",
        "--update-epochs",
        "--norm-adv",
        "--clip-coef",
        "--clip-vloss",
        "--ent-coef",
        "--vf-coef",
        "--max-grad-norm",
        "--num-seeds",
        "--output-dir",
        "--no-save-model",
        "--no-capture-gif",
        "--no-plot",
        "--eval-episodes",
        "--log-every",
        "--load-model",
        "--eval-only",
        "--env.max-steps-in-episode",
    ]:
        assert flag in result.stdout, flag


@pytest.mark.parametrize(
    "flags, flag",
    [
        (["--num-minibatches", "3"], "--num-minibatches"),
        (["--gamma", "2"], "--gamma"),
    ],
)
def test_bad_flag_is_one_line_and_exit_2(flags, flag):
    result = run_script(*flags)
    assert result.returncode == 2
    assert (
        result.stderr.count("\n") == 1
        and flag in result.stderr
        and "Traceback" not in result.stderr
    )


def test_eval_only_refuses_a_checkpoint_of_another_script(tmp_path):
    foreign = tmp_path / "model.msgpack"
    foreign.write_bytes(
        serialization.msgpack_serialize(
            {"script": "sac_pendulum", "env_id": "Pendulum-v1", "config": "{}", "params": {}}
        )
    )
    result = run_script("--eval-only", "--load-model", str(foreign))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "sac_pendulum" in result.stderr and "Pendulum-v1" in result.stderr


def test_outputs_ctrl_c_and_eval_only(tmp_path):
    """Train 2 seeds over many chunks, press Ctrl-C after the second: the run stops after that
    chunk and still writes every output; --eval-only then reproduces the saved evaluation."""
    out = tmp_path / "run"
    flags = [
        *TINY_FLAGS,
        "--total-timesteps",
        str(128 * 10_000),
        "--num-seeds",
        "2",
        "--output-dir",
        str(out),
    ]
    process = subprocess.Popen(
        [sys.executable, SCRIPT, *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines = []
    for line in process.stdout:
        lines.append(line)
        if line.startswith("steps 256/"):  # the second chunk is done
            process.send_signal(signal.SIGINT)
    assert process.wait(timeout=240) == 0, "".join(lines)
    assert any(line.startswith("compiled in") for line in lines)
    assert {path.name for path in out.iterdir()} == {
        "config.json",
        "metrics.csv",
        "summary.json",
        "curves.png",
        "policy.gif",
        "model.msgpack",
    }
    assert json.loads((out / "config.json").read_text())["num_seeds"] == 2
    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == list(ppo.CSV_COLUMNS)
    chunks = len(rows) // 2
    assert 2 <= chunks < 10_000 and [row["seed"] for row in rows[:2]] == ["0", "1"]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["stopped_early"] and summary["env_steps"] == 128 * chunks
    assert len(summary["final_returns"]) == 2 and summary["num_seeds"] == 2 and summary["device"]
    for name in [
        "final_return_mean",
        "final_return_std",
        "train_seconds",
        "compile_seconds",
        "env_steps_per_second",
    ]:
        assert summary[name] >= 0, name

    evaluation = tmp_path / "evaluation"
    result = run_script(
        "--eval-only",
        "--load-model",
        str(out / "model.msgpack"),
        "--eval-episodes",
        "2",
        "--output-dir",
        str(evaluation),
        "--no-capture-gif",
    )
    assert result.returncode == 0, result.stderr
    assert (
        json.loads((evaluation / "summary.json").read_text())["final_returns"]
        == summary["final_returns"]
    )


def test_sharded_over_two_devices_matches_the_pure_train(tmp_path, tiny_runs):
    """Seeds over 2 (forced) CPU devices: the CLI's chunk loop gives the metrics of train(key)."""
    two_devices = {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    result = run_script(*TINY_FLAGS, "--num-seeds", "3", env=two_devices)
    assert (
        result.returncode == 2 and "--num-seeds" in result.stderr and result.stderr.count("\n") == 1
    )
    out = tmp_path / "run"
    result = run_script(
        *TINY_FLAGS,
        "--num-seeds",
        "2",
        "--output-dir",
        str(out),
        "--no-capture-gif",
        "--no-plot",
        "--no-save-model",
        env=two_devices,
    )
    assert result.returncode == 0, result.stderr
    assert "2 x cpu" in result.stdout
    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    (_, metrics), _, _ = tiny_runs
    for name in ppo.METRIC_NAMES:
        from_cli = np.array(
            [[float(row[name]) for row in rows if row["seed"] == str(seed)] for seed in (0, 1)]
        )
        np.testing.assert_allclose(from_cli, metrics[name], rtol=1e-4, atol=1e-5)


def test_non_finite_loss_stops_with_chunk_seed_and_metric(tmp_path):
    result = run_script(
        *TINY_FLAGS, "--learning-rate", "inf", "--output-dir", str(tmp_path), "--no-capture-gif"
    )
    assert result.returncode == 1
    assert "non-finite" in result.stderr and "chunk 1, seed 0" in result.stderr
    assert (tmp_path / "metrics.csv").exists()


# ---------------------------------------------------------------------------------------------
# learning
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_short_run_learns_to_balance():
    config = dataclasses.replace(ppo.Config(), num_seeds=2)  # the defaults: 98,304 env steps
    _, _, train = ppo.make_train(config)
    keys = ppo.seed_keys(config)
    state, metrics = jax.jit(jax.vmap(train))(keys)
    evaluate = jax.jit(jax.vmap(ppo.make_evaluate(config)))
    returns, _ = evaluate(
        state.params["actor"], jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys)
    )
    assert np.asarray(metrics["episode_return"])[:, 0].max() < 200  # it starts out failing
    assert np.asarray(returns).mean(axis=1).min() >= 400
