"""Tests of sac_pendulum.py: the buffer, the losses, the tanh-Gaussian, seeds under vmap, the
CLI contract (in process and in subprocesses) and, marked slow, that a short run learns."""

import csv
import dataclasses
import json
import os
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
from conftest import XLA_DEFAULT, forced_cpu_devices, in_process, run_script
from flax import struct

import envs
import sac_pendulum as sac

SCRIPT = Path(__file__).resolve().parents[1] / "sac_pendulum.py"
# A run small enough to compile and train in seconds, with several chunks and real updates.
TINY = sac.Config(
    num_envs=4,
    total_timesteps=384,
    log_every=64,
    learning_starts=64,
    batch_size=16,
    hidden_sizes=(16, 16),
    buffer_size=256,
    env=sac.EnvConfig(max_steps_in_episode=20),
)
TINY_FLAGS = [
    "--num-envs",
    "4",
    "--total-timesteps",
    "384",
    "--log-every",
    "64",
    "--learning-starts",
    "64",
    "--batch-size",
    "16",
    "--hidden-sizes",
    "16",
    "16",
    "--buffer-size",
    "256",
    "--eval-episodes",
    "4",
    "--env.max-steps-in-episode",
    "20",
]


def transitions(rewards, obs_dim=3, action_dim=1) -> sac.Transition:
    """Transitions whose every field encodes its reward, so a slot's content is recognisable."""
    rewards = np.asarray(rewards, np.float32)  # built in NumPy: no compiled op per shape
    column = rewards[:, None]
    return jax.tree.map(
        jnp.asarray,
        sac.Transition(
            obs=np.tile(column, (1, obs_dim)),
            action=np.tile(column, (1, action_dim)),
            reward=rewards,
            next_obs=np.tile(column + 0.5, (1, obs_dim)),
            terminated=np.zeros(len(rewards), np.float32),
        ),
    )


def stored(buffer: sac.Buffer) -> sac.Transition:
    """Every slot of the buffer, its rows read in the layout buffer_add writes (obs, action,
    reward, next_obs, terminated side by side)."""
    rows, obs_dim = np.asarray(buffer.rows), buffer.obs_dim
    action_end = rows.shape[-1] - obs_dim - 2
    return sac.Transition(
        obs=rows[..., :obs_dim],
        action=rows[..., obs_dim:action_end],
        reward=rows[..., action_end],
        next_obs=rows[..., action_end + 1 : -1],
        terminated=rows[..., -1],
    )


# ---- replay buffer ----


def test_buffer_add_wraps_around():
    add = jax.jit(sac.buffer_add)  # one program (eager, every op would compile on its own)
    buffer = sac.buffer_init(capacity=5, obs_dim=3, action_dim=1)
    buffer = add(buffer, transitions([1, 2, 3]))
    assert int(buffer.added) == 3
    buffer = add(buffer, transitions([4, 5, 6]))  # 6 goes to slot 0
    assert int(buffer.added) == 6  # the next goes to slot 6 % 5 = 1
    data = stored(buffer)
    np.testing.assert_array_equal(data.reward, [6, 2, 3, 4, 5])
    np.testing.assert_array_equal(data.obs[:, 0], [6, 2, 3, 4, 5])
    np.testing.assert_array_equal(data.action[:, 0], [6, 2, 3, 4, 5])
    np.testing.assert_array_equal(data.next_obs[:, 2], [6.5, 2.5, 3.5, 4.5, 5.5])
    np.testing.assert_array_equal(data.terminated, 0.0)


def test_buffer_samples_only_filled_slots_and_all_of_them():
    buffer = jax.jit(sac.buffer_add)(
        sac.buffer_init(capacity=100, obs_dim=3, action_dim=1), transitions(np.arange(1, 11))
    )
    sample = jax.jit(sac.buffer_sample, static_argnames="batch_size")
    batch = sample(buffer, jax.random.key(0), batch_size=2000)
    chex.assert_shape(
        [batch.obs, batch.next_obs, batch.action, batch.reward, batch.terminated],
        [(2000, 3), (2000, 3), (2000, 1), (2000,), (2000,)],
    )
    # every field of a sampled transition comes from the same slot (one row, unpacked)
    np.testing.assert_array_equal(batch.obs[:, 0], batch.reward)
    np.testing.assert_array_equal(batch.action[:, 0], batch.reward)
    np.testing.assert_array_equal(batch.next_obs[:, 2], batch.reward + 0.5)
    counts = np.bincount(np.asarray(batch.reward, int), minlength=11)
    assert counts[0] == 0 and counts.sum() == 2000  # the 90 empty (zero) slots are never drawn
    assert counts[1:].min() > 140 and counts[1:].max() < 260  # about 200 each


def test_buffer_add_is_donated_not_copied():
    add = jax.jit(sac.buffer_add, donate_argnums=0)
    buffer = sac.buffer_init(capacity=1000, obs_dim=3, action_dim=1)
    new = add(buffer, transitions([1.0, 2.0]))
    assert buffer.rows.is_deleted()  # the input was given to the call, which updated it in place
    np.testing.assert_array_equal(stored(new).reward[:3], [1, 2, 0])


# ---- losses ----


def test_td_target_by_hand():
    batch = transitions([1.0, -2.0])
    batch = batch.replace(terminated=jnp.array([0.0, 1.0]))
    next_q = jnp.array([[10.0, 3.0], [8.0, 5.0]])  # [critic, batch]
    target = sac.td_target(
        batch, next_q, next_log_prob=jnp.array([-1.0, 2.0]), alpha=0.5, gamma=0.9
    )
    # first: 1 + 0.9 * (min(10, 8) - 0.5 * -1) = 8.65; second terminated: -2
    np.testing.assert_allclose(target, [8.65, -2.0], rtol=1e-6)


def linear_q_values(params, obs, action):
    """Twin 'critics' Q_i = w_i * (sum(obs) + action), easy to differentiate by hand."""
    return params["w"][:, None] * (obs.sum(-1) + action[:, 0])[None, :]


def test_critic_loss_by_hand():
    batch = transitions([1.0, 2.0])  # obs rows sum to 3 and 6, actions 1 and 2: features 4 and 8
    params = {"w": jnp.array([1.0, 0.5])}
    target = jnp.array([3.0, 10.0])
    loss, q = sac.critic_loss(params, batch, target, linear_q_values)
    # critic 1: q = 4, 8 -> errors 1, -2 -> mse 2.5; critic 2: q = 2, 4 -> errors -1, -6 -> mse 18.5
    np.testing.assert_allclose(q, [[4, 8], [2, 4]])
    np.testing.assert_allclose(loss, 21.0, rtol=1e-6)
    grad = jax.grad(lambda p: sac.critic_loss(p, batch, target, linear_q_values)[0])(params)
    # d/dw_i mean((w_i f - t)^2) = mean(2 (w_i f - t) f): critic 1: (2*1*4 + 2*-2*8)/2 = -12
    np.testing.assert_allclose(grad["w"], [-12.0, (2 * -1 * 4 + 2 * -6 * 8) / 2], rtol=1e-6)


def test_actor_and_alpha_losses_by_hand():
    def policy(params, obs, noise):  # action = m + noise, log_prob = -noise^2 (a stand-in)
        return params["m"] + noise, -(noise[:, 0] ** 2)

    obs, noise = jnp.zeros((2, 3)), jnp.array([[1.0], [-2.0]])
    critic_params = {"w": jnp.array([1.0, 3.0])}
    loss, log_prob = sac.actor_loss(
        {"m": jnp.array([0.5])}, critic_params, obs, noise, 0.1, policy, linear_q_values
    )
    # actions 1.5, -1.5; min over critics of w * a: 1.5 and -4.5; log_probs -1, -4
    np.testing.assert_allclose(log_prob, [-1.0, -4.0])
    np.testing.assert_allclose(loss, np.mean([0.1 * -1 - 1.5, 0.1 * -4 + 4.5]), rtol=1e-6)
    log_alpha = jnp.log(0.1)
    entropy = -jnp.mean(log_prob)  # 2.5
    value, grad = jax.value_and_grad(sac.alpha_loss)(log_alpha, entropy, -1.0)
    # alpha * (entropy - target) = 0.1 * (2.5 + 1) = 0.35; the gradient equals the value
    np.testing.assert_allclose([value, grad], [0.35, 0.35], rtol=1e-5)


def test_the_summed_loss_gives_each_part_its_own_gradient():
    """sac_loss sums the critics', the actor's and the temperature's losses, each taking the
    others' parameters as constants: the sum's gradient is, part by part, the gradient of that
    part's own loss, and alpha's gradient does not reach the actor nor the critics'."""
    agent = sac.make_agent(TINY)
    init, _, _ = sac.make_train(TINY)
    learner = jax.jit(init)(jax.random.key(0)).learner
    batch = transitions(np.arange(1.0, 17.0)).replace(terminated=jnp.zeros(16))
    keys = sac.UpdateKeys(batch=jax.random.key(0), noise=jax.random.key(1))
    noise = jax.random.normal(keys.noise, (2, 16, 1))  # as sac_loss draws it

    @jax.jit
    def gradients(params, target_critics):
        grads = jax.grad(lambda p: sac.sac_loss(p, target_critics, batch, keys, agent)[0])(params)
        parts = agent.unravel(params)
        alpha = jnp.exp(parts["log_alpha"])
        next_action, next_log_prob = agent.policy(parts["actor"], batch.next_obs, noise[1])
        next_q = agent.q_values(agent.unravel_critics(target_critics), batch.next_obs, next_action)
        target = sac.td_target(batch, next_q, next_log_prob, alpha, TINY.gamma)

        def critic(critic_params):
            return sac.critic_loss(critic_params, batch, target, agent.q_values)[0]

        def actor(actor_params):
            return sac.actor_loss(
                actor_params,
                parts["critics"],
                batch.obs,
                noise[0],
                alpha,
                agent.policy,
                agent.q_values,
            )[0]

        _, log_prob = agent.policy(parts["actor"], batch.obs, noise[0])
        entropy = -jnp.mean(log_prob)

        def temperature(log_alpha):
            return sac.alpha_loss(log_alpha, entropy, agent.target_entropy)

        separate = {
            "actor": jax.grad(actor)(parts["actor"]),
            "critics": jax.grad(critic)(parts["critics"]),
            "log_alpha": jax.grad(temperature)(parts["log_alpha"]),
        }
        return agent.unravel(grads), separate

    together, separate = gradients(learner.params, learner.target_critics)
    chex.assert_trees_all_close(together, separate, rtol=1e-5, atol=1e-6)
    assert float(jnp.abs(together["log_alpha"])) > 0  # alpha does learn (autotune)


def test_squashed_log_prob_matches_float64_change_of_variables():
    mean, log_std, scale = 0.3, np.log(0.7), 2.0
    pre_tanh = np.array([-20.0, -9.0, -3.0, -0.5, 0.0, 0.4, 2.5, 8.0, 20.0])
    got = sac.squashed_gaussian_log_prob(
        jnp.asarray(pre_tanh[:, None], jnp.float32), mean, log_std, scale
    )
    std = np.exp(log_std)
    gaussian = -0.5 * ((pre_tanh - mean) / std) ** 2 - np.log(std) - 0.5 * np.log(2 * np.pi)
    # |da/du| for a = scale * tanh(u): in float64, from a central difference where it resolves,
    # and from scale / cosh(u)^2 (log-cosh written without overflow) everywhere.
    log_cosh = np.abs(pre_tanh) + np.log1p(np.exp(-2 * np.abs(pre_tanh))) - np.log(2.0)
    reference = gaussian - (np.log(scale) - 2 * log_cosh)
    h = 1e-6
    moderate = np.abs(pre_tanh) <= 3
    jacobian = (
        scale * np.tanh(pre_tanh[moderate] + h) - scale * np.tanh(pre_tanh[moderate] - h)
    ) / (2 * h)
    np.testing.assert_allclose(
        gaussian[moderate] - np.log(jacobian), reference[moderate], rtol=1e-7
    )
    assert np.all(np.isfinite(got))  # the naive log(1 - tanh(u)^2) is -inf at |u| = 20 in float32
    np.testing.assert_allclose(got, reference, rtol=2e-5, atol=1e-4)


def test_squashed_density_integrates_to_one():
    """The log-prob is a density over actions in (-scale, scale): it integrates to 1."""
    mean, log_std, scale, offset = -0.4, np.log(0.8), 2.0, 0.0
    actions = np.linspace(-scale, scale, 200_001)[1:-1]
    pre_tanh = np.arctanh((actions - offset) / scale)
    density = np.exp(
        sac.squashed_gaussian_log_prob(
            jnp.asarray(pre_tanh[:, None], jnp.float32), mean, log_std, scale
        )
    )
    np.testing.assert_allclose(np.trapezoid(density, actions), 1.0, atol=1e-3)


def test_sample_is_reparameterised_and_in_bounds():
    noise = jax.random.normal(jax.random.key(0), (1000, 1))
    sample = jax.jit(sac.squashed_gaussian_sample, static_argnums=(3, 4))
    action, log_prob = sample(jnp.zeros((1000, 1)), jnp.full((1000, 1), 1.0), noise, 2.0, 0.0)
    assert action.shape == (1000, 1) and log_prob.shape == (1000,)
    assert float(jnp.abs(action).max()) <= 2.0
    grad = jax.jit(
        jax.grad(
            lambda m: sac.squashed_gaussian_sample(
                m, jnp.zeros((1, 1)), jnp.ones((1, 1)), 2.0, 0.0
            )[0].sum()
        )
    )
    np.testing.assert_allclose(grad(jnp.zeros((1, 1))), 2.0 / np.cosh(1.0) ** 2, rtol=1e-5)


# ---- training: seeds, bootstrapping ----


def test_time_limit_transitions_bootstrap_from_the_final_observation():
    config = dataclasses.replace(
        TINY, env=sac.EnvConfig(max_steps_in_episode=3), learning_starts=64
    )
    init, run_chunk, _ = sac.make_train(config)
    state, metrics = jax.jit(run_chunk)(
        jax.jit(init)(jax.random.key(0)), 0
    )  # 16 iterations, 4 envs
    data = stored(state.buffer)
    obs, next_obs = (
        np.asarray(data.obs[:64]).reshape(16, 4, 3),
        np.asarray(data.next_obs[:64]).reshape(16, 4, 3),
    )
    np.testing.assert_array_equal(data.terminated[:64], 0.0)  # Pendulum never terminates
    continues = np.arange(15) % 3 != 2  # steps 2, 5, ... end an episode (then the env resets)
    np.testing.assert_array_equal(next_obs[:-1][continues], obs[1:][continues])
    assert np.all(np.abs(next_obs[:-1][~continues] - obs[1:][~continues]).max(axis=-1) > 0)
    # and the stored final observation is the physics' next state, a valid unit-circle point
    np.testing.assert_allclose(np.hypot(next_obs[..., 0], next_obs[..., 1]), 1.0, rtol=1e-5)
    np.testing.assert_allclose(metrics.episode_length, 3.0)


@pytest.fixture(scope="module")
def two_seed_run():
    config = dataclasses.replace(TINY, seed=3, num_seeds=2)
    _, _, train = sac.make_train(config)
    return config, train, jax.jit(jax.vmap(train))(sac.seed_keys(config)["train"])


def test_vmapped_seed_equals_single_run_and_seeds_differ(two_seed_run):
    config, train, (state, metrics) = two_seed_run
    assert metrics.episode_return.shape == (2, sac.chunk_sizes(config)[1])
    assert int(metrics.updates[0, -1]) > 50  # it did train
    single_state, single_metrics = jax.jit(train)(
        sac.seed_keys(dataclasses.replace(config, seed=4, num_seeds=1))["train"][0]
    )  # seed 3 + 1 alone
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[1], state.learner.params),
        single_state.learner.params,
        rtol=1e-4,
        atol=1e-5,
    )
    np.testing.assert_allclose(metrics.critic_loss[1], single_metrics.critic_loss, rtol=1e-3)
    first, second = (
        jax.tree.map(lambda x: x[0], state.learner.params),
        single_state.learner.params,
    )
    assert not np.allclose(
        jax.flatten_util.ravel_pytree(first)[0], jax.flatten_util.ravel_pytree(second)[0]
    )


def test_cli_chunk_loop_equals_train(two_seed_run):
    """The CLI's path (init, then run_chunk from Python) is the same computation as train."""
    config, _, (state, metrics) = two_seed_run
    init, run_chunk, _ = sac.make_train(config)
    loop_state = jax.jit(jax.vmap(init))(sac.seed_keys(config)["train"])
    chunk = jax.jit(jax.vmap(run_chunk, in_axes=(0, None)))
    for index in range(sac.chunk_sizes(config)[1]):
        loop_state, loop_metrics = chunk(loop_state, index)
    chex.assert_trees_all_close(
        loop_state.learner.params, state.learner.params, rtol=1e-4, atol=1e-5
    )
    np.testing.assert_allclose(
        loop_metrics.episode_return, metrics.episode_return[:, -1], rtol=1e-4
    )


def test_evaluation_starts_from_other_states_than_training():
    """The evaluation's key is split from the seed's key beside training's, not folded from it:
    its first reset states share nothing with the training envs' first reset states."""
    config = dataclasses.replace(TINY, num_envs=8)
    keys = sac.seed_keys(config)
    init, _, _ = sac.make_train(config)
    training_obs = np.asarray(jax.jit(init)(keys["train"][0]).obs)
    env, env_params = sac.make_env(config)
    reset_key, _ = jax.random.split(keys["evaluate"][0])  # as make_evaluate splits it
    reset_keys = jax.random.split(reset_key, 8)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))  # one program, not eager ops
    evaluation_obs = np.asarray(reset(reset_keys, env_params)[0])
    assert not np.isclose(training_obs[:, None, :], evaluation_obs[None, :, :]).all(-1).any()
    assert (
        len({str(key) for key in [keys["train"][0], keys["evaluate"][0], keys["render"][0]]}) == 3
    )


# ---- the command line contract: whole runs (conftest.run_script) ----


def run(*flags, env=None) -> subprocess.CompletedProcess:
    return run_script(sac, *flags, env=env)


def test_help_lists_every_option():
    status, out, err = in_process(sac, "--help")
    assert status == 0
    for flag in [
        "--seed",
        "--num-seeds",
        "--num-envs",
        "--policy-lr",
        "--q-lr",
        "--no-autotune",
        "--alpha",
        "--tau",
        "--updates-per-step",
        "--max-grad-norm",
        "--no-capture-gif",
        "--eval-only",
        "--env.max-torque",
    ]:
        assert flag in out


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--gamma", "1.5"], "--gamma"),
        (["--batch-size", "512", "--buffer-size", "256"], "--batch-size"),
        (["--total-timesteps", "10"], "--total-timesteps"),
        (["--learning-starts", "40000"], "--learning-starts"),
        (["--env.dt", "0"], "--env.dt"),
        (["--lr-decay-start", "1.5"], "--lr-decay-start must be in [0, 1], got 1.5"),
        (["--lr-decay-to", "-0.1"], "--lr-decay-to must be >= 0"),
        (["--seed", "-1"], "--seed must be in [0, 2147483647], got -1"),
        (["--num-seeds", "4", "--seed", "2147483645"], "--seed must be in [0, 2147483644]"),
        (["--eval-only"], "--load-model"),
        (["--eval-only", "--load-model", "no/such/model.msgpack"], "--load-model"),
    ],
)
def test_bad_values_exit_2_with_one_line_before_compiling(flags, name):
    """In process: main validates before anything is compiled."""
    status, _, stderr = in_process(sac, *flags)
    assert status == 2 and len(stderr.strip().splitlines()) == 1 and name in stderr, stderr


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--no-such-flag", "3"], "--no-such-flag"),
        (["--num-envz", "3"], "--num-envs"),  # tyro's "Perhaps you meant"
        (["--num-envs", "many"], "--num-envs"),
        (["--env.no-such-option", "1"], "--env.no-such-option"),
    ],
)
def test_what_tyro_rejects_it_reports_with_exit_2(flags, name, capsys):
    with pytest.raises(SystemExit) as exit_:
        sac.parse_args(flags)
    assert exit_.value.code == 2
    assert name in capsys.readouterr().err


def test_bad_flags_from_the_command_line():
    status, out, err = in_process(sac, "--tau", "2")
    assert status == 2 and err.strip() == (
        "sac_pendulum.py: error: --tau must be in (0, 1], got 2.0"
    )
    status, out, err = in_process(sac, "--no-such-flag")
    assert status == 2 and "--no-such-flag" in err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    result = run(*TINY_FLAGS, "--num-seeds", "2", "--seed", "5", "--output-dir", str(out))
    assert result.returncode == 0, result.stderr
    return out, result


def test_run_writes_every_output(finished_run):
    out, result = finished_run
    assert (
        "compile cache: " in result.stdout.splitlines()[0]
        and "compiled in" in result.stdout
        and "SPS" in result.stdout
        and "(all 2 runs together)" in result.stdout  # the rates are of every run
        and "train return" in result.stdout
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
    assert json.loads((out / "config.json").read_text())["num_seeds"] == 2
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert tuple(rows[0]) == (
        "seed",
        "env_steps",
        "updates",
        "wall_seconds",
        "sps",
        *sac.METRIC_COLUMNS,
    )
    assert len(rows) == 2 * sac.chunk_sizes(TINY)[1] and {row["seed"] for row in rows} == {
        "5",
        "6",
    }
    summary = json.loads((out / "summary.json").read_text())
    for key in [
        "final_returns",
        "final_return_mean",
        "final_return_std",
        "final_return_iqm",  # of 2 runs: their mean, and no intervals (fewer than 3 runs)
        "train_seconds",
        "compile_seconds",
        "env_steps_per_second",
        "updates_per_second",
        "num_seeds",
        "num_envs",
        "device",
        "versions",
    ]:
        assert key in summary, key
    assert len(summary["final_returns"]) == 2 and summary["updates_per_second"] > 0
    assert summary["final_return_iqm"] == summary["final_return_mean"]
    assert summary["final_return_mean_ci"] is None and summary["final_return_iqm_ci"] is None
    assert "population std of 2 runs), 95% CI none (< 3 runs); IQM" in result.stdout
    assert set(summary["versions"]) == {"jax", "jaxlib", "flax", "optax", "numpy"}
    assert not summary["stopped_early"] and not (out / "checkpoint.msgpack").exists()
    from PIL import Image

    assert Image.open(out / "policy.gif").info["loop"] == 0  # it plays on, not once


def without_timing(path: Path) -> list[dict]:
    timing = {"wall_seconds", "sps"}
    return [
        {k: v for k, v in row.items() if k not in timing} for row in csv.DictReader(path.open())
    ]


def test_same_seed_gives_identical_metrics(finished_run, tmp_path):
    out, _ = finished_run
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
    )
    assert result.returncode == 0, result.stderr
    assert without_timing(out / "metrics.csv") == without_timing(tmp_path / "metrics.csv")


def test_eval_only_reproduces_the_saved_evaluation(finished_run, tmp_path):
    """The checkpoint brings its env (a 20-step limit here), network and seeds; no flags needed."""
    out, _ = finished_run
    result = run(
        "--eval-only",
        "--load-model",
        str(out / "model.msgpack"),
        "--eval-episodes",
        "4",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "summary.json").read_text())["final_returns"]
    assert json.loads((tmp_path / "summary.json").read_text())["final_returns"] == saved
    assert (tmp_path / "policy.gif").stat().st_size > 0 and not (
        tmp_path / "model.msgpack"
    ).exists()


def test_eval_only_refuses_flags_the_checkpoint_overrides(finished_run):
    out, _ = finished_run
    result = run("--eval-only", "--load-model", str(out / "model.msgpack"), "--hidden-sizes", "8")
    assert result.returncode == 2 and "--hidden-sizes" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


def test_the_model_names_its_networks_and_a_file_that_does_not_fit_names_its_array(
    finished_run, tmp_path
):
    """model.msgpack holds each run's parameter tree (flax.serialization's): another program
    reads the actor from it. A file whose arrays no longer fit names the first that differs; an
    older SAC model (one parameter vector a run) is refused in one line as well."""
    out, _ = finished_run
    payload = flax.serialization.msgpack_restore((out / "model.msgpack").read_bytes())
    params = payload["params"]["0"]  # the one structure's runs, seed first
    assert set(params) == {"actor", "critics", "log_alpha"} and params["log_alpha"].shape == (2,)
    first = jax.tree.map(lambda x: x[0], params)
    obs = jnp.ones((1, 3))
    mean, _ = sac.Actor((16, 16), 1).apply(first["actor"], obs)  # no script needed: flax alone
    act = sac.make_deterministic_policy(TINY)[2]
    np.testing.assert_allclose(act(first, obs), 2 * np.tanh(mean), rtol=1e-6)  # max torque 2
    smaller = {
        **payload,
        "config": json.dumps(json.loads(payload["config"]) | {"hidden_sizes": [8, 8]}),
    }
    vector = {**payload, "params": {"0": np.zeros((2, 1234), np.float32)}}
    for file, found in [
        (smaller, "params.0.actor.params.Dense_0.bias is (2, 16) in the file, (2, 8) here"),
        (vector, "params.0 is (2, 1234) in the file, absent here"),
    ]:
        (tmp_path / "model.msgpack").write_bytes(flax.serialization.msgpack_serialize(file))
        result = run("--eval-only", "--load-model", str(tmp_path / "model.msgpack"))
        assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1
        assert f"does not fit this sac_pendulum: {found}" in result.stderr, result.stderr


def test_eval_only_refuses_other_checkpoints(finished_run, tmp_path):
    out, _ = finished_run
    payload = flax.serialization.msgpack_restore((out / "model.msgpack").read_bytes())
    other = tmp_path / "other.msgpack"
    other.write_bytes(
        flax.serialization.msgpack_serialize(
            {**payload, "script": "sac_cartpole", "env": "CartPoleContinuous"}
        )
    )
    garbage = tmp_path / "garbage.msgpack"
    garbage.write_bytes(b"\x80")  # an empty msgpack map
    text = tmp_path / "notes.txt"
    text.write_text("a secret line that must not be echoed\n" * 50)
    for path, expected in [
        (other, "sac_cartpole checkpoint for CartPoleContinuous"),
        (garbage, "is not a checkpoint of"),
        (text, "is not a checkpoint of"),
    ]:
        result = run("--eval-only", "--load-model", str(path))
        assert result.returncode == 2 and expected in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "secret" not in result.stderr


def test_compile_cache_is_where_the_first_line_says_and_off_on_request(finished_run, tmp_path):
    """On --eval-only runs: the cache's place is the same, with one small program to compile."""
    quiet = ["--eval-only", "--load-model", str(finished_run[0]), "--no-capture-gif"]
    quiet += ["--output-dir", str(tmp_path), "--overwrite"]  # every run writes into tmp_path
    cache = tmp_path / "cache"
    result = run(*quiet, env={"JAX_COMPILATION_CACHE_DIR": str(cache)})
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[0].endswith(f"compile cache: {cache}")
    assert any(cache.iterdir())  # the programs were stored for the next run
    # Without $JAX_COMPILATION_CACHE_DIR: under the user's cache directory, unless turned off.
    environment = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "user_cache")}
    environment.pop("JAX_COMPILATION_CACHE_DIR", None)
    for flags, stored in [(["--no-compile-cache"], False), ([], True)]:
        result = subprocess.run(
            [sys.executable, str(SCRIPT), *quiet, *flags],
            capture_output=True,
            text=True,
            timeout=300,
            env=environment,
        )
        assert result.returncode == 0, result.stderr
        assert (tmp_path / "user_cache" / "jax-rl-scripts").exists() == stored, result.stdout


def test_two_devices_shard_the_seeds(finished_run, tmp_path):
    out, _ = finished_run
    two_devices = forced_cpu_devices(2)
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


def test_non_finite_loss_stops_with_chunk_seed_and_metric(tmp_path):
    result = run(
        *TINY_FLAGS,
        "--q-lr",
        "1e30",
        "--output-dir",
        str(tmp_path),
        "--no-plot",
        "--no-capture-gif",
    )
    assert result.returncode == 1
    assert "non-finite" in result.stderr and "chunk" in result.stderr and "seed 1" in result.stderr
    assert (
        len(list(csv.DictReader((tmp_path / "metrics.csv").open()))) >= 1
    )  # what was written stays valid


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
    assert process.returncode == 130, stderr  # as a shell expects of an interrupted program
    assert "stopping after this chunk" in stderr and "Traceback" not in stderr
    rows = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    assert 1 <= len(rows) < sac.chunk_sizes(dataclasses.replace(TINY, total_timesteps=200000))[1]
    for name in ["summary.json", "curves.png", "policy.gif", "model.msgpack"]:
        assert (tmp_path / name).exists(), name


def test_output_dir_that_is_a_file_or_cannot_be_made_is_one_line_and_exit_2(tmp_path):
    a_file = tmp_path / "a_file"
    a_file.write_text("mine\n")
    for where in [a_file, Path("/proc/no_such_folder")]:
        result = run(*TINY_FLAGS, "--output-dir", str(where))
        assert result.returncode == 2 and "--output-dir" in result.stderr, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1 and "compiled" not in result.stdout


def test_a_folder_with_files_needs_overwrite_which_keeps_the_users_files(tmp_path):
    (tmp_path / "notes.txt").write_text("mine\n")
    refused = run(*TINY_FLAGS, "--output-dir", str(tmp_path))
    assert refused.returncode == 2 and "--overwrite" in refused.stderr, refused.stderr
    quiet = ["--no-plot", "--no-capture-gif", "--no-save-model", "--overwrite"]
    result = run(*TINY_FLAGS, *quiet, "--output-dir", str(tmp_path))
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
    wrote = result.stdout.splitlines()[-1]
    assert (
        wrote.startswith("wrote config.json, metrics.csv, summary.json in") and "notes" not in wrote
    )
    # one run: its return alone, no spread of a single number
    assert (
        " ± " not in result.stdout.splitlines()[-2] and "return " in result.stdout.splitlines()[-2]
    )


def test_ctrl_c_during_compile_exits_130_without_a_traceback(tmp_path):
    out = tmp_path / "run"
    process = subprocess.Popen(
        [sys.executable, str(SCRIPT), *TINY_FLAGS, "--output-dir", str(out), "--no-compile-cache"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    process.stdout.readline()  # the first line comes just before the programs compile
    process.send_signal(signal.SIGINT)
    stdout, stderr = process.communicate(timeout=300)
    assert process.returncode == 130 and "Traceback" not in stderr, stderr
    assert "compiled" not in stdout and not (out / "metrics.csv").exists()


def test_a_cache_that_plain_jax_filled_gives_no_warnings(finished_run, tmp_path):
    """The README's Python path fills $JAX_COMPILATION_CACHE_DIR through JAX alone; a script run
    on the same folder afterwards (an --eval-only run: a small program to compile, and store)
    must neither warn nor fail to write its entries."""
    cache = tmp_path / "cache"
    environment = {"JAX_COMPILATION_CACHE_DIR": str(cache)}
    fill = "import jax; jax.config.update('jax_persistent_cache_min_compile_time_secs', 0); "
    fill += "jax.jit(lambda x: x + 1)(1.0)"
    subprocess.run([sys.executable, "-c", fill], check=True, env={**os.environ, **environment})
    quiet = ["--eval-only", "--load-model", str(finished_run[0]), "--no-capture-gif"]
    for attempt in range(2):
        out = tmp_path / f"run{attempt}"
        result = run(*quiet, "--output-dir", str(out), env=environment)
        assert result.returncode == 0 and "Warning" not in result.stderr, result.stderr


def test_the_curves_label_what_they_show_and_the_gif_says_what_it_shows(finished_run):
    from matplotlib.figure import Figure
    from PIL import Image

    out, _ = finished_run
    rows = [
        {name: float(value) for name, value in row.items()}
        for row in csv.DictReader((out / "metrics.csv").open())
    ]
    figure = Figure()
    config = dataclasses.replace(TINY, num_seeds=2)
    sac.draw_curves(figure, config, [{}], rows, frames=None)
    assert figure.get_suptitle() == "sac_pendulum on Pendulum-v1: 2 seeds"
    assert [axis.get_legend() for axis in figure.axes] == [None] * len(figure.axes)
    labels = [text.get_text() for text in figure.legends[0].get_texts()]  # one, below the panels
    assert labels == ["mean of 2 seeds", "min-max over seeds", "solved (-200)"]
    three = [row | {"seed": row["seed"] + 2} for row in rows[::2]]  # a third seed: an interval
    rows = [row for chunk in zip(rows[::2], rows[1::2], three, strict=True) for row in chunk]
    sac.draw_curves(figure, dataclasses.replace(config, num_seeds=3), [{}], rows, frames=None)
    labels = [text.get_text() for text in figure.legends[-1].get_texts()]
    interval = "95% interval of the mean over seeds (bootstrap)"
    assert labels == ["mean of 3 seeds", "min-max over seeds", interval, "solved (-200)"]
    ticks = figure.axes[0].xaxis.get_major_formatter().format_ticks([100_000, 1_200_000])
    assert ticks == ["100k", "1.2M"]  # short labels: long numbers collided on short runs
    caption = np.asarray(Image.open(out / "policy.gif").convert("L"))[:16]
    assert caption.min() < 100  # dark caption text above the white frames


def test_a_chunk_runs_without_any_host_transfer():
    init, run_chunk, _ = sac.make_train(TINY)
    chunk = jax.jit(run_chunk, donate_argnums=0)
    state = jax.jit(init)(jax.random.key(0))
    index = jnp.int32(0)
    state, _ = chunk(state, index)  # compiled outside the guard (compiling may transfer)
    index = jax.device_put(jnp.int32(1))
    with jax.transfer_guard("disallow"):
        state, metrics = chunk(state, index)
    assert int(metrics.updates) > 0


def test_policy_and_q_rates_are_separate_and_no_autotune_fixes_alpha():
    config = dataclasses.replace(TINY, q_lr=0.0, autotune=False, alpha=0.3)
    init, _, train = sac.make_train(config)
    start = jax.jit(init)(jax.random.key(1))
    state, metrics = jax.jit(train)(jax.random.key(1))
    critics = sac.make_agent(config).critic_part
    np.testing.assert_array_equal(state.learner.params[critics], start.learner.params[critics])
    assert not np.allclose(state.learner.params, start.learner.params)  # the actor learned
    learning = np.isfinite(metrics.alpha)
    np.testing.assert_allclose(metrics.alpha[learning], 0.3, rtol=1e-6)


def test_step_sizes_hold_then_decay_linearly_to_their_share():
    """Each part's Adam step size (the actor's --policy-lr, the critics' and alpha's --q-lr)
    stays until --lr-decay-start of the run's updates, then falls linearly to --lr-decay-to of
    itself at the end; --lr-decay-start 1 keeps it constant."""
    config = dataclasses.replace(
        TINY, policy_lr=2e-3, q_lr=4e-3, lr_decay_start=0.6, lr_decay_to=0.1
    )
    agent = sac.make_agent(config)
    actor, critics, alpha = np.split(
        np.arange(sum(agent.part_sizes)), np.cumsum(agent.part_sizes)[:-1]
    )
    for progress, share in [(0.0, 1.0), (0.6, 1.0), (0.8, 0.55), (1.0, 0.1)]:
        sizes = np.asarray(agent.step_sizes(jnp.float32(progress)))
        np.testing.assert_allclose(sizes[actor], 2e-3 * share, rtol=1e-5)
        np.testing.assert_allclose(sizes[np.concatenate([critics, alpha])], 4e-3 * share, rtol=1e-5)
    constant = sac.make_agent(dataclasses.replace(config, lr_decay_start=1.0))
    np.testing.assert_allclose(constant.step_sizes(jnp.float32(0.99))[actor], 2e-3, rtol=1e-6)


def test_a_new_random_draw_of_the_update_is_one_field_of_update_keys(monkeypatch):
    """A copy that needs one more draw in the update (REDQ's critic subset, say) adds a field to
    UpdateKeys and uses it by name: the iteration splits one key more, and nothing else changes."""

    @struct.dataclass
    class ThreeKeys:
        batch: jax.Array
        noise: jax.Array
        subset: jax.Array

    drawn = []
    sac_loss = sac.sac_loss

    def loss_with_a_subset(params, target_critics, batch, keys, agent):
        drawn.append(jax.random.randint(keys.subset, (), 0, 2))  # the new draw, by name
        return sac_loss(params, target_critics, batch, keys, agent)

    monkeypatch.setattr(sac, "UpdateKeys", ThreeKeys)
    monkeypatch.setattr(sac, "sac_loss", loss_with_a_subset)
    state, metrics = jax.jit(sac.make_train(TINY)[2])(jax.random.key(0))
    assert drawn and np.isfinite(metrics.critic_loss[-1])


class FloatBox:
    """gymnax's spaces.Box keeps its bounds as given: Python floats for gymnax's Pendulum-v1."""

    def __init__(self, low: float, high: float, shape: tuple[int, ...]):
        self.low = low
        self.high = high
        self.shape = shape


class FloatBoundsPendulum(envs.Pendulum):
    def action_space(self, params=None) -> FloatBox:
        return FloatBox(-2.0, 2.0, (1,))


def test_a_copy_runs_on_an_env_whose_box_has_float_bounds(monkeypatch):
    """make_env returning gymnax.make("Pendulum-v1") must just work: the same run as ours."""
    _, reference = jax.jit(sac.make_train(TINY)[2])(jax.random.key(0))
    make_env = sac.make_env
    monkeypatch.setattr(
        sac, "make_env", lambda config: (FloatBoundsPendulum(), make_env(config)[1])
    )
    _, metrics = jax.jit(sac.make_train(TINY)[2])(jax.random.key(0))
    chex.assert_trees_all_close(metrics, reference)
    init = sac.make_train(TINY)[0]
    params = sac.trained_params(TINY, jax.jit(init)(jax.random.key(0)))
    returns = jax.jit(sac.make_evaluate(TINY, 2))(params, jax.random.key(1))["episode_return"]
    assert returns.shape == (2,) and np.isfinite(returns).all()


# ---- learning ----


@pytest.mark.slow
def test_default_config_learns_to_swing_up():
    """Four seeds of the default config, shortened to 24k env steps (1,437 updates). A random
    policy scores about -1200; the threshold comes from measured runs with a wide margin (see
    docs/sac.md): every seed above -400 and the median above -250. No single seed's path is
    asserted, since XLA's CPU code (and so each trajectory) differs between processors."""
    config = dataclasses.replace(sac.Config(), num_seeds=4, total_timesteps=24_000)
    keys = sac.seed_keys(config)
    _, _, train = sac.make_train(config)
    state, metrics = jax.jit(jax.vmap(train), compiler_options=XLA_DEFAULT)(keys["train"])
    evaluate = jax.jit(
        jax.vmap(sac.make_evaluate(config, num_episodes=20)), compiler_options=XLA_DEFAULT
    )
    params = jax.vmap(lambda state: sac.trained_params(config, state))(state)  # each seed's
    returns = np.asarray(evaluate(params, keys["evaluate"])["episode_return"])
    returns = returns.mean(axis=1)
    assert np.all(returns > -400) and np.median(returns) > -250, returns
    assert np.all(metrics.episode_return[:, 0] < -900)  # and it started from a poor policy
