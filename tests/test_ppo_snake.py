"""Tests of ppo_snake.py: the networks' shapes, the reverse-move mask against envs.Snake's neck
rule, seeds and determinism of the pure core, the script contract, and (slow) that a short run
learns to eat."""

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
import tyro
from flax import serialization

import envs
import ppo_snake as ppo

SCRIPT = str(Path(__file__).resolve().parents[1] / "ppo_snake.py")
# A tiny config: 2 chunks of 2 iterations of 4 envs x 16 steps on a 6x6 board.
TINY = ppo.Config(
    num_envs=4,
    num_steps=16,
    num_minibatches=2,
    update_epochs=2,
    conv_channels=(4,),
    hidden_size=16,
    log_every=128,
    total_timesteps=256,
    eval_episodes=2,
    env=ppo.EnvConfig(grid_size=6),
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
    "--conv-channels",
    "4",
    "--hidden-size",
    "16",
    "--log-every",
    "128",
    "--total-timesteps",
    "256",
    "--eval-episodes",
    "2",
    "--env.grid-size",
    "6",
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


def run_main(flags: list[str], capsys) -> tuple[int, str]:
    """main() in this process, as the CLI runs it: (exit status, stderr)."""
    with pytest.raises(SystemExit) as exit_info:
        ppo.main(tyro.cli(ppo.Config, args=flags))
    return exit_info.value.code, capsys.readouterr().err


# ---- networks and the reverse-move mask -----------------------------------------------------


@pytest.mark.parametrize("network", ["conv", "transformer"])
def test_network_output_shapes(network):
    for grid_size in [6, 10, 13, 20]:
        config = dataclasses.replace(
            ppo.Config(), network=network, env=ppo.EnvConfig(grid_size=grid_size)
        )
        net = ppo.make_network(config, 4)
        obs = jax.ShapeDtypeStruct(
            (3, 2, grid_size, grid_size, 3), jnp.float32
        )  # any leading batch axes
        params = jax.eval_shape(net.init, jax.random.key(0), obs)
        logits, value = jax.eval_shape(net.apply, params, obs)
        assert logits.shape == (3, 2, 4) and value.shape == (3, 2), grid_size


@pytest.fixture(scope="module")
def random_play():
    """States and observations of 64 random-playing snakes on a 6x6 board over 400 steps, with
    the key each step used; on this small board random snakes eat and grow."""
    env, params = envs.make("Snake")
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)

    def step(carry, key):
        obs, state = carry
        key_action, key_step = jax.random.split(key)
        action = jax.random.randint(key_action, (), 0, 4)
        next_obs, next_state, *_ = env.step(key_step, state, action, params)
        return (next_obs, next_state), (obs, state, key_step)

    def play(key):
        key_reset, key_steps = jax.random.split(key)
        return jax.lax.scan(step, env.reset(key_reset, params), jax.random.split(key_steps, 400))[1]

    obs, states, keys = jax.jit(jax.vmap(play))(jax.random.split(jax.random.key(0), 64))
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), (obs, states, keys))
    return env, params, *flat


def test_reverse_move_mask_is_the_envs_neck_rule(random_play):
    env, params, obs, states, keys = random_play
    assert (states.length >= 3).sum() > 100  # the test sees long snakes, not only fresh ones
    mask = np.asarray(jax.jit(ppo.reverse_move_mask)(obs))
    moves = np.arange(4)
    expected = ((moves + 2) % 4 == np.asarray(states.direction)[:, None]) & (
        np.asarray(states.length)[:, None] > 1
    )
    np.testing.assert_array_equal(mask, expected)
    # What the env does with the masked move is exactly what it does with "keep going".
    long = np.flatnonzero(np.asarray(states.length) > 1)
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    states = jax.tree.map(lambda x: x[long], states)
    after_masked = step(keys[long], states, jnp.argmax(mask[long], axis=-1), params)[1]
    after_straight = step(keys[long], states, states.direction, params)[1]
    jax.tree.map(np.testing.assert_array_equal, after_masked, after_straight)


@pytest.mark.parametrize("network", ["conv", "transformer"])
def test_policy_starts_near_uniform_and_never_chooses_the_reverse_move(random_play, network):
    obs = random_play[2][::8]
    net = ppo.make_network(dataclasses.replace(ppo.Config(), network=network), 4)

    @jax.jit
    def policies(obs):
        params = net.init(jax.random.key(0), obs[0])
        confident = jax.tree.map(lambda x: 30.0 * x, params)  # a policy far from uniform
        return [jax.nn.softmax(net.apply(p, obs)[0]) for p in (params, confident)] + [
            ppo.reverse_move_mask(obs)
        ]

    fresh, confident, mask = map(np.asarray, policies(obs))
    assert (
        mask.any(axis=-1).sum() > 100 and np.isfinite(fresh).all() and np.isfinite(confident).all()
    )
    # At first (head gain 0.01) near uniform over the allowed moves: three with a neck, else four.
    allowed = 4 - mask.sum(-1, keepdims=True)
    np.testing.assert_allclose(fresh, np.where(mask, 0.0, 1.0 / allowed), atol=0.02)
    assert (fresh[mask] == 0).all() and (confident[mask] == 0).all()
    np.testing.assert_allclose(confident.sum(-1), 1.0, rtol=1e-5)
    assert confident.max(-1).mean() > 0.5


def test_init_is_orthogonal_with_the_gains_of_huang_et_al_under_vmap():
    """Every conv-trunk kernel is gain x orthogonal, two seeds initialised in one vmapped call
    (where a QR-based initialiser could deadlock on CPU); the seeds differ; the biases are zero."""
    net = ppo.make_network(ppo.Config(), 4)
    params = jax.jit(jax.vmap(net.init, in_axes=(0, None)))(
        jax.random.split(jax.random.key(0), 2), jnp.zeros((10, 10, 3))
    )["params"]
    gains = {
        ("trunk", "Dense_0"): np.sqrt(2),
        ("trunk", "Dense_1"): np.sqrt(2),
        ("trunk", "Dense_2"): np.sqrt(2),
        ("Dense_0",): 0.01,
        ("Dense_1",): 1.0,
    }  # the trunk's two convolutions and dense layer, the heads
    for path, gain in gains.items():
        layer = params[path[0]][path[1]] if len(path) == 2 else params[path[0]]
        assert not np.allclose(layer["kernel"][0], layer["kernel"][1])
        for kernel in np.asarray(layer["kernel"]) / gain:
            gram = kernel.T @ kernel if kernel.shape[0] >= kernel.shape[1] else kernel @ kernel.T
            np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-5, err_msg=str(path))
        np.testing.assert_array_equal(layer["bias"], 0.0)


# ---- the pure core: seeds and determinism ---------------------------------------------------


@pytest.fixture(scope="module")
def tiny_runs():
    """Seeds 0 and 1 of TINY trained in one vmapped program, and seed 1 alone, twice."""
    _, _, train = ppo.make_train(TINY)
    keys = ppo.seed_keys(dataclasses.replace(TINY, num_seeds=2))
    single = jax.jit(train)
    return jax.jit(jax.vmap(train))(keys), single(keys[1]), single(keys[1])


def test_vmapped_seed_matches_the_single_run(tiny_runs):
    (vmapped_state, vmapped_metrics), (state, metrics), _ = tiny_runs
    close = dict(rtol=1e-4, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a[1], b, **close),
        vmapped_state.params,
        state.params,
    )
    for name in ppo.METRIC_NAMES:
        np.testing.assert_allclose(vmapped_metrics[name][1], metrics[name], **close)
    assert metrics["value_loss"].shape == (ppo.sizes(TINY).num_chunks,)


def test_different_seeds_give_different_networks_and_same_seed_identical_metrics(tiny_runs):
    (state, _), (_, first), (_, second) = tiny_runs
    kernel = state.params["params"]["trunk"]["Dense_0"]["kernel"]
    assert not np.allclose(kernel[0], kernel[1])
    for name in ppo.METRIC_NAMES:
        np.testing.assert_array_equal(first[name], second[name])


def test_score_counts_food(tiny_runs):
    # Food eaten = return + 1 for an episode that ended in a death: between return and return + 1.
    (_, metrics), _, _ = tiny_runs
    surplus = np.asarray(metrics["score"] - metrics["episode_return"])
    assert ((surplus >= 0) & (surplus <= 1 + 1e-6)).all() and (surplus > 0).any()
    assert (np.asarray(metrics["score"]) >= 0).all() and (
        np.asarray(metrics["win_rate"]) == 0
    ).all()


# ---- the contract -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "change, flag",
    [
        (dict(env=ppo.EnvConfig(grid_size=5)), "--env.grid-size"),
        (dict(env=ppo.EnvConfig(grid_size=21)), "--env.grid-size"),
        (dict(env=ppo.EnvConfig(max_steps_without_food=0)), "--env.max-steps-without-food"),
        (dict(conv_channels=()), "--conv-channels"),
        (dict(conv_channels=(8, 0)), "--conv-channels"),
        (dict(num_envs=0), "--num-envs"),
        (dict(learning_rate=0.0), "--learning-rate"),
        (dict(gamma=0.0), "--gamma"),
        (dict(gae_lambda=1.5), "--gae-lambda"),
        (dict(num_minibatches=3), "--num-minibatches"),
        (dict(total_timesteps=100), "--total-timesteps"),
        (dict(eval_only=True), "--eval-only"),
        (dict(load_model="model.msgpack"), "--load-model"),
    ],
)
def test_validate_names_the_bad_flag(change, flag):
    with pytest.raises(ppo.UsageError, match=flag):
        ppo.validate(dataclasses.replace(TINY, **change))
    ppo.validate(TINY)


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
        "--clip-coef",
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
        "--network",
        "--conv-channels",
        "--env.grid-size",
        "--env.max-steps-without-food",
    ]:
        assert flag in result.stdout, flag


@pytest.mark.parametrize(
    "flags, words",
    [
        (
            ["--grid-size", "8"],
            "perhaps you meant --env.grid-size",
        ),  # tyro's suggestion for a typo, kept
        (["--network", "mlp"], "--network"),
        (["--num-envs", "many"], "--num-envs"),
    ],
)
def test_parse_errors_are_one_line_and_exit_2(flags, words):
    result = run_script(*flags)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("ppo_snake.py: error:"), (
        result.stderr
    )
    assert words in result.stderr or "argument" in result.stderr.lower(), result.stderr


def test_grid_size_out_of_range_is_one_line_and_exit_2(capsys):
    result = run_script("--env.grid-size", "21")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert (
        result.stderr.count("\n") == 1
        and "--env.grid-size must be in [6, 20], got 21" in result.stderr
    )
    status, stderr = run_main(["--env.grid-size", "5"], capsys)
    assert status == 2 and stderr.count("\n") == 1 and "--env.grid-size" in stderr
    status, stderr = run_main(["--num-minibatches", "3"], capsys)
    assert status == 2 and stderr.count("\n") == 1 and "--num-minibatches" in stderr


def test_eval_only_refuses_a_checkpoint_of_another_script(tmp_path, capsys):
    foreign = tmp_path / "model.msgpack"
    foreign.write_bytes(
        serialization.msgpack_serialize(
            {"script": "ppo_cartpole", "env_id": "CartPole-v1", "config": "{}", "params": {}}
        )
    )
    status, stderr = run_main(["--eval-only", "--load-model", str(foreign)], capsys)
    assert (
        status == 2
        and stderr.count("\n") == 1
        and "ppo_cartpole" in stderr
        and "CartPole-v1" in stderr
    )


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
    assert any("score" in line and "wins" in line for line in lines if line.startswith("steps "))
    assert {path.name for path in out.iterdir()} == {
        "config.json",
        "metrics.csv",
        "summary.json",
        "curves.png",
        "policy.gif",
        "model.msgpack",
    }
    assert json.loads((out / "config.json").read_text())["env"]["grid_size"] == 6
    with open(out / "metrics.csv") as file:
        rows = list(csv.DictReader(file))
    assert list(rows[0]) == list(ppo.CSV_COLUMNS)
    chunks = len(rows) // 2
    assert 2 <= chunks < 10_000 and [row["seed"] for row in rows[:2]] == ["0", "1"]
    summary = json.loads((out / "summary.json").read_text())
    assert (
        summary["stopped_early"]
        and summary["env_steps"] == 128 * chunks
        and summary["num_seeds"] == 2
    )
    assert len(summary["final_returns"]) == len(summary["final_scores"]) == 2
    assert 0 <= summary["final_win_fraction"] <= 1 and summary["final_score_mean"] >= 0
    for name in ["final_return_std", "train_seconds", "compile_seconds", "env_steps_per_second"]:
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
    )
    assert result.returncode == 0, result.stderr
    assert (evaluation / "policy.gif").stat().st_size > 0
    evaluated = json.loads((evaluation / "summary.json").read_text())
    for name in [
        "final_returns",
        "final_scores",
        "final_win_fraction",
        "final_episode_length_mean",
    ]:
        assert evaluated[name] == summary[name], name


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


# ---- learning -----------------------------------------------------------------------------------


@pytest.mark.slow
def test_short_run_learns_to_eat():
    """Two seeds, 163,840 env steps each on a 6x6 board with a small CNN (about 20 s on 2 CPU
    cores). Measured for seeds 0-7 (pairs through this same code): random play scores 0.14-0.19
    food per episode in the first chunk; the greedy policy after training 2.85-7.05 per seed
    (20 episodes; seeds 0 and 1: 7.05 and 5.9), the training episodes of the last 32,768 steps
    6.2-8.5. The bars: under 0.6 at first, then 3.0 in training and 1.5 greedy."""
    config = dataclasses.replace(
        ppo.Config(),
        num_seeds=2,
        env=ppo.EnvConfig(grid_size=6),
        conv_channels=(8, 16),
        hidden_size=64,
        num_envs=32,
        num_steps=64,
        num_minibatches=8,
        update_epochs=2,
        learning_rate=2e-3,
        food_shaping=1.0,
        total_timesteps=163_840,
        log_every=16_384,
        eval_episodes=20,
    )
    _, _, train = ppo.make_train(config)
    keys = ppo.seed_keys(config)
    state, metrics = jax.jit(jax.vmap(train))(keys)
    evaluate = jax.jit(jax.vmap(ppo.make_evaluate(config)))
    episodes = evaluate(state.params, jax.vmap(lambda key: jax.random.fold_in(key, 1))(keys))
    scores = np.asarray(metrics["score"])  # [seeds, chunks]
    assert scores.shape == (2, 10) and scores[:, 0].max() < 0.6  # it starts out as random play
    assert scores[:, -2:].mean(axis=1).min() >= 3.0
    assert np.asarray(episodes["score"]).mean(axis=1).min() >= 1.5
