"""envs.py's Brax adapter (README: "Your own env"): it steps as Brax does, reports the time limit
as a truncation with the last observation kept, resets to a fresh random state, and a copy of
sac_pendulum.py trains, resumes and evaluates on it. Brax is a test-only dependency: without it,
these tests are skipped. The smallest task and the backend quickest to compile (inverted_pendulum,
spring) keep the suite's added time small."""

import importlib
import json
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import test_sac_pendulum
from test_cli_block import ROOT

import envs

brax_envs = pytest.importorskip("brax.envs")
TASK, BACKEND = "inverted_pendulum", "spring"


@pytest.fixture(scope="module")
def env_and_params():
    return envs.make(f"brax/{TASK}", backend=BACKEND)


def test_make_names_the_task_and_its_spaces(env_and_params):
    env, params = env_and_params
    assert env.name == f"brax/{TASK}" and params.max_steps_in_episode == 1000
    brax_env = brax_envs.get_environment(TASK, backend=BACKEND)
    assert env.observation_space(params).shape == (brax_env.observation_size,)
    action_space = env.action_space(params)
    assert action_space.shape == (brax_env.action_size,) == (env.num_actions,)
    assert float(action_space.low[0]) == -1.0 and float(action_space.high[0]) == 1.0
    with pytest.raises(ValueError, match="brax/<task>"):
        envs.make("inverted_pendulum")


def test_steps_are_brax_own_steps(env_and_params):
    """reset_env and step_env are Brax's reset and step: the same observations, rewards and
    terminations, bit for bit, over a random-action rollout through a fall."""
    env, params = env_and_params
    brax_env = brax_envs.get_environment(TASK, backend=BACKEND)
    key = jax.random.key(3)
    actions = jax.random.uniform(jax.random.key(4), (40, 1), minval=-1.0, maxval=1.0)

    def ours(key):
        obs, state = env.reset_env(key, params)

        def step(state, action):
            obs, state, reward, terminated, _ = env.step_env(key, state, action, params)
            return state, (obs, reward, terminated)

        return obs, jax.lax.scan(step, state, actions)[1]

    def theirs(key):
        state = brax_env.reset(key)

        def step(state, action):
            state = brax_env.step(state, action)
            return state, (state.obs, state.reward, state.done > 0)

        return state.obs, jax.lax.scan(step, state, actions)[1]

    (first, ours_steps), (first_brax, brax_steps) = jax.jit(ours)(key), jax.jit(theirs)(key)
    np.testing.assert_array_equal(first, first_brax)
    for got, expected in zip(ours_steps, brax_steps, strict=True):
        np.testing.assert_array_equal(got, expected)
    assert bool(brax_steps[2].any())  # the pole fell within the rollout


def test_the_time_limit_is_a_truncation_with_the_last_observation_kept(env_and_params):
    """At the limit `step` says truncated (not terminated), keeps the observation the episode
    ended on in info["final_observation"], and starts a new episode from a fresh random state;
    a fall says terminated. Brax's own wrappers would say done and drop that observation."""
    env, _ = env_and_params
    params = envs.BraxParams(max_steps_in_episode=3)
    step, step_env = jax.jit(env.step), jax.jit(env.step_env)
    obs, state = env.reset(jax.random.key(0), params)
    no_push = jnp.zeros(1)
    for time in range(1, 4):
        key = jax.random.key(time)
        expected_obs, *_ = step_env(key, state, no_push, params)
        obs, state, reward, terminated, truncated, info = step(key, state, no_push, params)
        assert not terminated and bool(truncated) == (time == 3)
        np.testing.assert_array_equal(info["final_observation"], expected_obs)
    assert int(state.time) == 0 and not np.array_equal(obs, expected_obs)
    np.testing.assert_array_equal(obs, state.brax_state.obs)
    restarted = [env.reset(jax.random.key(seed), params)[0] for seed in (7, 8)]
    assert not np.array_equal(*restarted)  # each episode draws its own start

    push = jnp.ones(1)  # full force one way: the pole falls long before 1,000 steps
    obs, state = env.reset(jax.random.key(1), env.default_params)
    for time in range(1, 1000):
        obs, state, reward, terminated, truncated, info = step(
            jax.random.key(time), state, push, env.default_params
        )
        if terminated:
            break
    assert terminated and not truncated and int(state.time) == 0
    assert not np.array_equal(info["final_observation"], obs)


def test_a_copy_of_sac_pendulum_trains_resumes_and_evaluates_on_brax(tmp_path, monkeypatch):
    """sac.md's Brax edit to sac_pendulum.py (EnvConfig, make_env, names): the copy trains two
    chunks, stops after the first, resumes from its checkpoint (Brax's state in it), evaluates."""
    text = (ROOT / "sac_pendulum.py").read_text()
    edits = [
        (
            r"^class EnvConfig:.*?\n\n\n",
            "class EnvConfig:\n    max_steps_in_episode: int = 50\n\n\n",
        ),
        (
            r"(^def make_env\(.*?\n    \"\"\".*?\"\"\"\n)    return .*?\n",
            rf'\1    env, params = envs.make("brax/{TASK}", backend="{BACKEND}")\n'
            "    return env, params.replace(**dataclasses.asdict(config.env))\n",
        ),
        (r'^SCRIPT = ".*?"\n', 'SCRIPT = "sac_brax"\n'),
        (r"(^def env_name\(.*?\n)    return .*?\n", rf'\1    return "brax/{TASK}"\n'),
        (r"(^def solved_return\(.*?\n)    return .*?\n", r"\1    return 45.0\n"),
    ]
    for pattern, replacement in edits:
        text, count = re.subn(pattern, replacement, text, count=1, flags=re.S | re.M)
        assert count == 1, pattern
    (tmp_path / "sac_brax.py").write_text(text)
    monkeypatch.syspath_prepend(str(tmp_path))
    module = importlib.import_module("sac_brax")
    flags = [*test_sac_pendulum.TINY_FLAGS, "--total-timesteps", "128"]  # the session's cache
    out = tmp_path / "run"
    with monkeypatch.context() as stopped:  # a Ctrl-C during the first chunk
        stopped.setattr(module, "stop_on_signals", lambda stop: stop.__setitem__(0, 130))
        with pytest.raises(SystemExit) as exit_:
            module.main(*module.parse_args([*flags, "--no-plot", "--output-dir", str(out)]))
    assert exit_.value.code == 130 and (out / "checkpoint.msgpack").exists()
    module.main(*module.parse_args(["--resume", str(out), "--no-plot"]))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["env_steps"] == 128 and not summary["stopped_early"]
    assert all(0 < value <= 50 for value in summary["final_returns"])  # 1 a step alive, 50 steps
