"""Tests of envs.py: parity with gymnasium, properties of every env (hypothesis), the Snake
rules, the episode-statistics wrapper and the renderers. Docs: docs/envs.md"""

import functools
import json
from typing import Any

import gymnasium
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import envs

ENV_NAMES = list(envs.REGISTRY)
CONTINUOUS = {"CartPoleContinuous", "CartPoleSwingup", "Pendulum-v1"}
TOLERANCE = 1e-5  # float32 here, float64 in gymnasium
# Property tests: few examples, each a whole compiled rollout; a fixed seed keeps CI repeatable.
PROPERTY_SETTINGS = settings(max_examples=15, deadline=None, derandomize=True)
ROLLOUT_STEPS = 64


def key_batch(seed: int, count: int) -> jax.Array:
    return jax.random.split(jax.random.key(seed), count)


# ---------------------------------------------------------------------------------------------
# parity with gymnasium: single transitions from random states, and whole rollouts
# ---------------------------------------------------------------------------------------------


def gymnasium_env(name: str) -> Any:
    """gymnasium's env under its TimeLimit wrapper, without the checker's warnings."""
    env = gymnasium.make(name, disable_env_checker=True)
    env.reset(seed=0)
    return env


def set_gymnasium_state(gym_env: Any, name: str, state: Any, elapsed_steps: int) -> None:
    core = gym_env.unwrapped
    if name == "CartPole-v1":
        core.state = np.array([state.x, state.x_dot, state.theta, state.theta_dot], np.float64)
        core.steps_beyond_terminated = None  # else a step after a termination pays 0
    else:
        core.state = np.array([state.theta, state.theta_dot], np.float64)
    gym_env._elapsed_steps = elapsed_steps  # the TimeLimit wrapper's counter


def state_vector(name: str, state: Any) -> np.ndarray:
    fields = (
        ["x", "x_dot", "theta", "theta_dot"] if name == "CartPole-v1" else ["theta", "theta_dot"]
    )
    return np.stack([np.asarray(getattr(state, field), np.float64) for field in fields], axis=-1)


def random_states(name: str, count: int, rng: np.random.Generator) -> tuple[Any, np.ndarray]:
    """States across (and slightly beyond) the region an episode visits, random elapsed times,
    and random actions (Pendulum's beyond the torque limit, to test the clipping)."""
    time = jnp.asarray(rng.integers(0, 501 if name == "CartPole-v1" else 201, count), jnp.int32)
    if name == "CartPole-v1":
        state = envs.CartPoleState(
            x=jnp.asarray(rng.uniform(-2.6, 2.6, count), jnp.float32),
            x_dot=jnp.asarray(rng.uniform(-3.0, 3.0, count), jnp.float32),
            theta=jnp.asarray(rng.uniform(-0.25, 0.25, count), jnp.float32),
            theta_dot=jnp.asarray(rng.uniform(-3.5, 3.5, count), jnp.float32),
            time=time,
        )
        return state, rng.integers(0, 2, count)
    state = envs.PendulumState(
        theta=jnp.asarray(rng.uniform(-3 * np.pi, 3 * np.pi, count), jnp.float32),
        theta_dot=jnp.asarray(rng.uniform(-8.0, 8.0, count), jnp.float32),
        last_u=jnp.zeros(count, jnp.float32),
        time=time,
    )
    return state, rng.uniform(-3.0, 3.0, (count, 1)).astype(np.float32)


def distance_to_termination(name: str, next_state: np.ndarray) -> np.ndarray:
    """How far the next state is from CartPole's termination thresholds (inf for Pendulum)."""
    if name != "CartPole-v1":
        return np.full(len(next_state), np.inf)
    params = envs.CartPoleParams()
    return np.minimum(
        np.abs(np.abs(next_state[:, 0]) - params.x_threshold),
        np.abs(np.abs(next_state[:, 2]) - params.theta_threshold_radians),
    )


@pytest.mark.parametrize("name", ["CartPole-v1", "Pendulum-v1"])
def test_random_transitions_match_gymnasium(name):
    count = 3000
    env, params = envs.make(name)
    state, actions = random_states(name, count, np.random.default_rng(0))
    keys = key_batch(0, count)
    step = jax.jit(jax.vmap(env.step, in_axes=(0, 0, 0, None)))
    step_env = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    _, _, reward, terminated, truncated, info = step(keys, state, jnp.asarray(actions), params)
    _, next_state, _, _, _ = step_env(keys, state, jnp.asarray(actions), params)
    ours_next = state_vector(name, next_state)

    gym_env = gymnasium_env(name)
    gym_next, gym_obs, gym_reward, gym_terminated, gym_truncated = [], [], [], [], []
    host_state = jax.tree.map(np.asarray, state)
    for index in range(count):
        set_gymnasium_state(
            gym_env,
            name,
            jax.tree.map(lambda leaf, i=index: leaf[i], host_state),
            host_state.time[index],
        )
        obs, rew, term, trunc, _ = gym_env.step(actions[index])
        gym_next.append(np.array(gym_env.unwrapped.state, np.float64))
        gym_obs.append(obs)
        gym_reward.append(rew)
        gym_terminated.append(term)
        gym_truncated.append(trunc)

    np.testing.assert_allclose(ours_next, np.array(gym_next), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(info["final_observation"], np.array(gym_obs), rtol=0, atol=TOLERANCE)
    np.testing.assert_allclose(reward, np.array(gym_reward), rtol=0, atol=TOLERANCE)
    np.testing.assert_array_equal(truncated, np.array(gym_truncated))
    # float32 and float64 may disagree on a next state within rounding of a threshold.
    clear = distance_to_termination(name, np.array(gym_next)) > TOLERANCE
    assert clear.mean() > 0.99
    np.testing.assert_array_equal(np.asarray(terminated)[clear], np.array(gym_terminated)[clear])
    assert 0 < np.sum(gym_terminated) < count or name == "Pendulum-v1"
    assert 0 < np.sum(gym_truncated) < count


def balancing_action(obs: np.ndarray, rng: np.random.Generator, random_fraction: float) -> int:
    """With random_fraction 0.1, keeps CartPole up for the whole 500 steps (so the time limit
    is reached) while staying random: a PD rule on the pole and the cart, with one action in
    ten random. With 1.0, random actions that soon end the episode."""
    if rng.random() < random_fraction:
        return int(rng.integers(0, 2))
    x, x_dot, theta, theta_dot = obs
    return int(theta + 0.5 * theta_dot + 0.01 * x + 0.05 * x_dot > 0)


@pytest.mark.parametrize(("name", "num_steps"), [("CartPole-v1", 1400), ("Pendulum-v1", 650)])
def test_rollouts_match_gymnasium(name, num_steps):
    """Whole episodes through our auto-resetting `step` and gymnasium's env under its
    TimeLimit: every transition, the time-limit truncations at 500 / 200 and the resets. After
    each step gymnasium's state is set to ours, so float32 rounding does not accumulate."""
    env, params = envs.make(name)
    step = jax.jit(env.step)
    rng = np.random.default_rng(1)
    obs, state = env.reset(jax.random.key(1), params)
    gym_env = gymnasium_env(name)
    set_gymnasium_state(gym_env, name, state, 0)
    episode_ends = {"terminated": 0, "truncated": 0}
    for t in range(num_steps):
        if name == "CartPole-v1":
            first_episode = sum(episode_ends.values()) == 0
            action = balancing_action(np.asarray(obs), rng, 1.0 if first_episode else 0.1)
        else:
            action = rng.uniform(-2.0, 2.0, (1,)).astype(np.float32)
        obs, state, reward, terminated, truncated, info = step(
            jax.random.key(1000 + t), state, action, params
        )
        gym_obs, gym_reward, gym_terminated, gym_truncated, _ = gym_env.step(action)
        np.testing.assert_allclose(
            info["final_observation"], gym_obs, rtol=0, atol=TOLERANCE, err_msg=f"step {t}"
        )
        np.testing.assert_allclose(reward, gym_reward, rtol=0, atol=TOLERANCE, err_msg=f"step {t}")
        assert (bool(terminated), bool(truncated)) == (gym_terminated, gym_truncated), f"step {t}"
        if gym_terminated or gym_truncated:
            episode_ends["terminated" if gym_terminated else "truncated"] += 1
            assert int(state.time) == 0
            gym_env.reset()
        else:
            assert int(state.time) == gym_env._elapsed_steps
        set_gymnasium_state(gym_env, name, state, int(state.time))
    assert episode_ends["truncated"] >= 2  # the 500 / 200 step limit was reached and compared
    if name == "CartPole-v1":
        assert episode_ends["terminated"] >= 1


def test_reset_distributions_match_gymnasium():
    """Resets are uniform in gymnasium's ranges: CartPole's four values in [-0.05, 0.05),
    Pendulum's theta in [-pi, pi) and theta_dot in [-1, 1)."""
    for name, high in [("CartPole-v1", [0.05] * 4), ("Pendulum-v1", [np.pi, 1.0])]:
        env, params = envs.make(name)
        _, state = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))(key_batch(2, 20000), params)
        scaled = state_vector(name, state) / np.array(high)  # uniform in [-1, 1) if right
        assert np.all(np.abs(scaled) <= 1.0)
        np.testing.assert_allclose(scaled.mean(0), 0.0, atol=0.02)
        np.testing.assert_allclose(scaled.std(0), 1 / np.sqrt(3), rtol=0.02)
        assert np.all(state.time == 0)


# ---------------------------------------------------------------------------------------------
# properties of every env (hypothesis): finite, in the observation space, auto-reset, time
# ---------------------------------------------------------------------------------------------


@functools.cache
def compiled_rollout(name: str):
    """jit(rollout)(key, state, actions, params): `len(actions)` auto-resetting steps, with each
    step's input state and what `step_env` (no reset) returns from it, for the checks below.
    Compiled once per env; hypothesis examples only feed new arrays and params."""
    env, _ = envs.make(name)

    def rollout(key, state, actions, params):
        def body(state, inputs):
            key, action = inputs
            obs, next_state, reward, terminated, truncated, info = env.step(
                key, state, action, params
            )
            plain_obs, plain_state, _, _, _ = env.step_env(key, state, action, params)
            record = {
                "state_before": state,
                "obs": obs,
                "state": next_state,
                "reward": reward,
                "terminated": terminated,
                "truncated": truncated,
                "final_observation": info["final_observation"],
                "plain_obs": plain_obs,
                "plain_state": plain_state,
            }
            return next_state, record

        return jax.lax.scan(body, state, (jax.random.split(key, actions.shape[0]), actions))[1]

    return jax.jit(rollout)


def action_arrays(name: str, num_steps: int) -> st.SearchStrategy:
    """Any action: for continuous envs every float32 including nan, +-inf and +-3.4e38; for
    discrete ones the valid actions and any other int32."""
    if name in CONTINUOUS:
        return hnp.arrays(np.float32, (num_steps, 1), elements=st.floats(width=32))
    num_actions = envs.make(name)[0].num_actions
    valid = st.integers(0, num_actions - 1)
    elements = st.one_of(valid, valid, valid, st.integers(-(2**31), 2**31 - 1))
    return hnp.arrays(np.int32, (num_steps,), elements=elements)


def with_limit(name: str, params: Any, limit: int) -> Any:
    """Params with a short time limit (Snake: steps without food), so truncations and their
    resets happen within a short rollout."""
    if name == "Snake":
        return params.replace(max_steps_without_food=limit)
    return params.replace(max_steps_in_episode=limit)


def is_fresh_reset(name: str, state: Any) -> np.ndarray:
    """Whether each state (batched on axis 0) is one that `reset` can return."""
    if name == "Snake":
        return (
            (np.asarray(state.length) == 1)
            & (np.asarray(state.steps_since_food) == 0)
            & (np.asarray(state.body).sum(axis=(1, 2)) == 1)
        )
    if name == "Pendulum-v1":
        return (
            (np.abs(state.theta) <= np.pi)
            & (np.abs(state.theta_dot) <= 1.0)
            & (np.asarray(state.last_u) == 0)
        )
    theta = np.asarray(state.theta) - (np.pi if name == "CartPoleSwingup" else 0.0)
    values = np.stack([state.x, state.x_dot, theta, state.theta_dot], axis=-1)
    return np.all(np.abs(values) <= 0.05 + 1e-6, axis=-1)


def select(tree: Any, mask: np.ndarray) -> Any:
    return jax.tree.map(lambda leaf: np.asarray(leaf)[mask], tree)


def assert_trees_equal(actual: Any, expected: Any, err_msg: str = "") -> None:
    for actual_leaf, expected_leaf in zip(
        jax.tree.leaves(actual), jax.tree.leaves(expected), strict=True
    ):
        np.testing.assert_array_equal(actual_leaf, expected_leaf, err_msg=err_msg)


def check_rollout(name: str, record: dict, params: Any, limit: int) -> None:
    env, _ = envs.make(name)
    done = np.asarray(record["terminated"]) | np.asarray(record["truncated"])
    # Finite everywhere, whatever the actions were, and inside the observation space.
    space = env.observation_space(params)
    for key in ("obs", "final_observation", "plain_obs"):
        values = np.asarray(record[key])
        assert np.all(np.isfinite(values)), key
        assert np.all((values >= np.asarray(space.low)) & (values <= np.asarray(space.high))), key
    assert np.all(np.isfinite(record["reward"]))
    # The returned observation is always the observation of the returned state.
    obs_of_state = jax.vmap(env.get_obs, in_axes=(0, None))(record["state"], params)
    np.testing.assert_array_equal(record["obs"], obs_of_state)
    # Steps that go on: exactly step_env's result, the clock advanced by one.
    going_on = ~done
    assert_trees_equal(select(record["state"], going_on), select(record["plain_state"], going_on))
    np.testing.assert_array_equal(
        np.asarray(record["final_observation"])[going_on], np.asarray(record["obs"])[going_on]
    )
    time_before = np.asarray(record["state_before"].time)[going_on]
    np.testing.assert_array_equal(np.asarray(record["state"].time)[going_on], time_before + 1)
    # Steps that end an episode: a fresh reset state at time 0, and the observation the episode
    # ended on kept in final_observation.
    assert np.all(np.asarray(record["state"].time)[done] == 0)
    assert np.all(is_fresh_reset(name, select(record["state"], done)))
    np.testing.assert_array_equal(
        np.asarray(record["final_observation"])[done], np.asarray(record["plain_obs"])[done]
    )
    # Truncation is the time limit (Snake: steps without food), never reported as termination.
    plain = record["plain_state"]
    clock = plain.steps_since_food if name == "Snake" else plain.time
    np.testing.assert_array_equal(record["truncated"], np.asarray(clock) >= limit)
    if name == "Pendulum-v1":
        assert not np.any(record["terminated"])


@pytest.mark.parametrize("name", ENV_NAMES)
def test_properties_of_every_env(name):
    env, default_params = envs.make(name)
    rollout = compiled_rollout(name)

    @PROPERTY_SETTINGS
    @given(
        seed=st.integers(0, 2**31 - 1),
        actions=action_arrays(name, ROLLOUT_STEPS),
        limit=st.one_of(st.integers(1, 40), st.just(500)),
    )
    def check(seed, actions, limit):
        params = with_limit(name, default_params, limit)
        _, state = env.reset(jax.random.key(seed), params)
        record = rollout(jax.random.key(seed + 1), state, jnp.asarray(actions), params)
        check_rollout(name, record, params, limit)
        if name == "Snake":
            check_food_is_free(record)

    check()


def check_food_is_free(record: dict) -> None:
    """Food is never on the body (but on a win there is no free cell left)."""
    for key in ("state", "plain_state"):
        state = record[key]
        food = np.asarray(state.food)
        under_food = np.asarray(state.body)[np.arange(len(food)), food[:, 0], food[:, 1]]
        won = np.asarray(state.length) == state.body.shape[-1] ** 2
        assert np.all((under_food == 0) | won), key


@pytest.mark.parametrize("name", ENV_NAMES)
def test_jit_and_vmap_match_a_python_loop(name):
    """A Python loop of single `step` calls, the scan, and a vmapped batch of scans agree."""
    env, params = envs.make(name)
    num_steps, num_seeds = ROLLOUT_STEPS, 3
    rng = np.random.default_rng(3)
    if name in CONTINUOUS:
        actions = rng.uniform(-1.5, 1.5, (num_seeds, num_steps, 1)).astype(np.float32)
    else:
        actions = rng.integers(0, env.num_actions, (num_seeds, num_steps)).astype(np.int32)
    reset_keys, run_keys = key_batch(4, num_seeds), key_batch(5, num_seeds)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, params)
    batched = jax.vmap(compiled_rollout(name), in_axes=(0, 0, 0, None))(
        run_keys, states, jnp.asarray(actions), params
    )
    seed = 1
    _, state = env.reset(reset_keys[seed], params)
    single = compiled_rollout(name)(run_keys[seed], state, jnp.asarray(actions[seed]), params)
    loop_obs, loop_rewards, loop_states = [], [], []
    step = jax.jit(env.step)
    for key, action in zip(jax.random.split(run_keys[seed], num_steps), actions[seed], strict=True):
        obs, state, reward, _, _, _ = step(key, state, jnp.asarray(action), params)
        loop_obs.append(obs)
        loop_rewards.append(reward)
        loop_states.append(state)
    loop_states = jax.tree.map(lambda *leaves: np.stack(leaves), *loop_states)
    for jitted in (single, jax.tree.map(lambda leaf: leaf[seed], batched)):
        np.testing.assert_allclose(jitted["obs"], np.stack(loop_obs), rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(jitted["reward"], np.stack(loop_rewards), rtol=1e-6, atol=1e-6)
        for actual, expected in zip(
            jax.tree.leaves(jitted["state"]), jax.tree.leaves(loop_states), strict=True
        ):
            np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("name", ENV_NAMES)
def test_shapes_and_dtypes_are_fixed(name):
    env, params = envs.make(name)
    obs, state = env.reset(jax.random.key(0), params)
    action = env.action_space(params).sample(jax.random.key(1))
    out = jax.eval_shape(env.step, jax.random.key(2), state, action, params)
    next_obs, next_state, reward, terminated, truncated, info = out
    space = env.observation_space(params)
    assert obs.shape == next_obs.shape == info["final_observation"].shape == space.shape
    assert obs.dtype == next_obs.dtype == jnp.float32
    assert jax.tree.map(lambda leaf: (leaf.shape, leaf.dtype), state) == jax.tree.map(
        lambda leaf: (leaf.shape, leaf.dtype), next_state
    )
    assert (reward.shape, reward.dtype) == ((), jnp.float32)
    assert (
        (terminated.shape, terminated.dtype)
        == (truncated.shape, truncated.dtype)
        == ((), jnp.bool_)
    )
    assert env.name == name


@pytest.mark.parametrize("name", sorted(CONTINUOUS))
def test_nan_and_infinite_actions_are_safe(name):
    """NaN acts as 0 and +-inf as the bound, so a diverging policy cannot poison the state."""
    env, params = envs.make(name)
    _, state = env.reset(jax.random.key(0), params)
    step = jax.jit(env.step_env)
    bound = env.action_space(params).high[0]
    for action, equivalent in [(np.nan, 0.0), (np.inf, bound), (-np.inf, -bound), (1e30, bound)]:
        _, actual, reward, _, _ = step(
            jax.random.key(1), state, jnp.array([action], jnp.float32), params
        )
        _, expected, expected_reward, _, _ = step(
            jax.random.key(1), state, jnp.array([equivalent]), params
        )
        assert_trees_equal(actual, expected, err_msg=f"action {action}")
        assert reward == expected_reward


def test_make_and_spaces():
    with pytest.raises(ValueError, match="unknown env"):
        envs.make("MountainCar-v0")
    for name in ENV_NAMES:
        env, params = envs.make(name)
        space = env.action_space(params)
        samples_inside = jax.jit(
            lambda keys, space=space: jax.vmap(space.contains)(jax.vmap(space.sample)(keys))
        )
        assert bool(samples_inside(key_batch(0, 256)).all())
        assert env.num_actions == (space.n if hasattr(space, "n") else space.shape[0])


# ---------------------------------------------------------------------------------------------
# Snake rules, on hand-made boards
# ---------------------------------------------------------------------------------------------

UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3


def snake_state(
    size: int, cells: list[tuple[int, int]], food: tuple[int, int], direction: int, **fields
) -> Any:
    """A board with the snake on `cells` (head first) and food at `food`."""
    body = np.zeros((size, size), np.int32)
    for age, (row, col) in enumerate(cells):
        body[row, col] = len(cells) - age  # head = length, tail = 1
    values = {"steps_since_food": 0, "time": 0, **fields}
    return envs.SnakeState(
        body=jnp.asarray(body),
        head=jnp.asarray(cells[0], jnp.int32),
        direction=jnp.int32(direction),
        food=jnp.asarray(food, jnp.int32),
        length=jnp.int32(len(cells)),
        steps_since_food=jnp.int32(values["steps_since_food"]),
        time=jnp.int32(values["time"]),
        mirrored=jnp.bool_(values.get("mirrored", False)),
    )


@functools.cache
def snake_step(size: int, auto_reset: bool = False):
    """Jitted Snake step (auto-resetting `step` or plain `step_env`) on a size x size grid."""
    env = envs.Snake()
    params = envs.SnakeParams(grid_size=size)
    return jax.jit(functools.partial(env.step if auto_reset else env.step_env, params=params))


def occupied(state: Any) -> set[tuple[int, int]]:
    return {
        (int(row), int(col)) for row, col in zip(*np.nonzero(np.asarray(state.body)), strict=True)
    }


def test_snake_grows_by_one_per_food_and_food_reappears_uniformly_on_a_free_cell():
    size = 5
    state = snake_state(
        size, [(2, 2), (2, 1), (2, 0)], food=(2, 3), direction=RIGHT, steps_since_food=7
    )
    count = 10500
    step = jax.jit(jax.vmap(snake_step(size), in_axes=(0, None, None)))
    _, after, reward, terminated, info = step(key_batch(0, count), state, RIGHT)
    assert np.all(reward == 1.0) and not np.any(terminated) and not np.any(info["won"])
    first = jax.tree.map(lambda leaf: np.asarray(leaf)[0], after)
    assert int(first.length) == 4 and int(first.steps_since_food) == 0
    expected_body = np.zeros((size, size), np.int32)
    expected_body[2, :4] = [1, 2, 3, 4]  # the tail stays: the snake grew into the food
    np.testing.assert_array_equal(first.body, expected_body)
    np.testing.assert_array_equal(first.head, [2, 3])
    # The new food is on one of the 21 free cells, each about equally often.
    food = np.asarray(after.food)
    cells, counts = np.unique(food[:, 0] * size + food[:, 1], return_counts=True)
    free = [index for index in range(size * size) if expected_body.reshape(-1)[index] == 0]
    np.testing.assert_array_equal(cells, free)
    expected = count / len(free)
    assert np.all(np.abs(counts - expected) < 5 * np.sqrt(expected)), counts


def test_snake_food_on_an_almost_full_board():
    """Eating the second-last free cell of a 3x3 board leaves one free cell: food goes there."""
    path = [(0, 0), (0, 1), (0, 2), (1, 2), (1, 1), (1, 0), (2, 0), (2, 1), (2, 2)]
    # Snake on path[2:] heading towards path[1] (food); path[0] stays free.
    state = snake_state(3, path[2:], food=path[1], direction=UP)
    _, after, reward, terminated, _ = jax.vmap(snake_step(3), in_axes=(0, None, None))(
        key_batch(1, 64), state, LEFT
    )
    assert np.all(reward == 1.0) and not np.any(terminated)
    np.testing.assert_array_equal(after.food, np.tile([0, 0], (64, 1)))


def serpentine(size: int) -> list[tuple[int, int]]:
    """Every cell of the grid, row by row, alternating direction: a path through the board."""
    return [
        (row, col if row % 2 == 0 else size - 1 - col) for row in range(size) for col in range(size)
    ]


@pytest.mark.parametrize("size", [3, 4])
def test_snake_wins_on_a_full_board(size):
    path = serpentine(size)
    # The snake fills every cell but path[0], where the food is; its head is at path[1].
    state = snake_state(size, path[1:], food=path[0], direction=LEFT)
    obs, after, reward, terminated, info = snake_step(size)(jax.random.key(0), state, LEFT)
    assert float(reward) == 1.0 and bool(terminated) and bool(info["won"])
    assert int(after.length) == size * size and len(occupied(after)) == size * size
    np.testing.assert_array_equal(after.head, path[0])
    assert np.all(np.asarray(obs)[..., 1] > 0)  # body recency covers the board
    # Through the auto-resetting step: a new game, with the full board kept for bootstrapping.
    obs, reset, reward, terminated, truncated, info = snake_step(size, auto_reset=True)(
        jax.random.key(0), state, LEFT
    )
    assert bool(terminated) and not bool(truncated) and float(reward) == 1.0
    assert int(reset.length) == 1 and int(reset.time) == 0
    assert np.all(np.asarray(info["final_observation"])[..., 1] > 0)


def test_snake_dies_at_the_wall():
    state = snake_state(5, [(0, 2), (1, 2)], food=(4, 4), direction=UP)
    _, after, reward, terminated, info = snake_step(5)(jax.random.key(0), state, UP)
    assert float(reward) == -1.0 and bool(terminated) and not bool(info["won"])
    assert_trees_equal(after.body, state.body)  # a dying snake does not move
    for action, edge in [
        (LEFT, [(2, 0), (2, 1)]),
        (DOWN, [(4, 1), (3, 1)]),
        (RIGHT, [(1, 4), (1, 3)]),
    ]:
        state = snake_state(5, edge, food=(0, 0), direction=action)
        _, _, reward, terminated, _ = snake_step(5)(jax.random.key(0), state, action)
        assert float(reward) == -1.0 and bool(terminated), action


def test_snake_dies_on_its_body():
    # Head (1, 1) came from (1, 2); moving down enters (2, 1), the body's fourth cell.
    state = snake_state(5, [(1, 1), (1, 2), (2, 2), (2, 1), (2, 0)], food=(4, 4), direction=LEFT)
    _, after, reward, terminated, _ = snake_step(5)(jax.random.key(0), state, DOWN)
    assert float(reward) == -1.0 and bool(terminated)
    np.testing.assert_array_equal(after.head, [1, 1])


def test_snake_may_enter_the_cell_its_tail_leaves():
    # A 2x2 loop: the head at (0, 0) moves down into (1, 0), which the tail leaves this step.
    state = snake_state(4, [(0, 0), (0, 1), (1, 1), (1, 0)], food=(3, 3), direction=LEFT)
    _, after, reward, terminated, _ = snake_step(4)(jax.random.key(0), state, DOWN)
    assert float(reward) == 0.0 and not bool(terminated)
    expected = snake_state(4, [(1, 0), (0, 0), (0, 1), (1, 1)], food=(3, 3), direction=DOWN)
    np.testing.assert_array_equal(after.body, expected.body)
    np.testing.assert_array_equal(after.head, [1, 0])


def test_snake_neck_rule():
    """A move straight back keeps the current direction when there is a neck to run into; a
    snake of length one may turn around."""
    state = snake_state(5, [(2, 2), (2, 1)], food=(0, 0), direction=RIGHT)
    _, after, reward, terminated, _ = snake_step(5)(jax.random.key(0), state, LEFT)
    np.testing.assert_array_equal(after.head, [2, 3])
    assert int(after.direction) == RIGHT and float(reward) == 0.0 and not bool(terminated)
    single = snake_state(5, [(2, 2)], food=(0, 0), direction=RIGHT)
    _, after, _, terminated, _ = snake_step(5)(jax.random.key(0), single, LEFT)
    np.testing.assert_array_equal(after.head, [2, 1])
    assert int(after.direction) == LEFT and not bool(terminated)


def test_snake_truncates_after_max_steps_without_food():
    limit = envs.SnakeParams().max_steps_without_food
    step = snake_step(5, auto_reset=True)
    for steps_since_food, expect_truncated in [(limit - 2, False), (limit - 1, True)]:
        state = snake_state(
            5, [(2, 2)], food=(0, 0), direction=RIGHT, steps_since_food=steps_since_food, time=150
        )
        _, after, reward, terminated, truncated, info = step(jax.random.key(0), state, RIGHT)
        assert bool(truncated) == expect_truncated and not bool(terminated) and float(reward) == 0.0
        assert int(after.time) == (0 if expect_truncated else 151)
        np.testing.assert_array_equal(np.asarray(info["final_observation"])[2, 3], [1.0, 1.0, 0.0])


def test_snake_observation_channels():
    state = snake_state(5, [(2, 2), (2, 1), (1, 1)], food=(4, 0), direction=RIGHT)
    obs = np.asarray(envs.Snake().get_obs(state, envs.SnakeParams(grid_size=5)))
    assert obs.shape == (5, 5, 3)
    head, recency, food = obs[..., 0], obs[..., 1], obs[..., 2]
    assert head[2, 2] == 1.0 and head.sum() == 1.0
    assert food[4, 0] == 1.0 and food.sum() == 1.0
    np.testing.assert_allclose(
        [recency[2, 2], recency[2, 1], recency[1, 1]], [1.0, 2 / 3, 1 / 3], rtol=1e-6
    )
    assert recency.sum() == pytest.approx(2.0)


EGOCENTRIC_OBS = jax.jit(envs.Snake(egocentric=True).get_obs)  # one program, not eager ops


def egocentric_obs(state: Any) -> np.ndarray:
    return np.asarray(EGOCENTRIC_OBS(state, envs.SnakeParams(grid_size=5)))


def view_cell(obs: np.ndarray, channel: int) -> tuple[int, int]:
    (row,), (col,) = np.nonzero(obs[..., channel])
    return int(row), int(col)


@pytest.mark.parametrize("mirrored", [False, True])
def test_snake_egocentric_view_turns_the_heading_up_and_mirrors(mirrored):
    """Heading right: the food two cells ahead shows straight above the head; food on the snake's
    right (the board's down) shows on the view's right, on its left when mirrored."""
    cells = [(2, 2), (2, 1), (2, 0)]
    ahead = snake_state(5, cells, food=(2, 4), direction=RIGHT, mirrored=mirrored)
    head_row, head_col = view_cell(egocentric_obs(ahead), 0)
    assert view_cell(egocentric_obs(ahead), 2) == (head_row - 2, head_col)
    # The neck, behind the head, shows below it.
    assert egocentric_obs(ahead)[head_row + 1, head_col, 1] == pytest.approx(2 / 3)
    right = snake_state(5, cells, food=(3, 2), direction=RIGHT, mirrored=mirrored)
    side = -1 if mirrored else 1
    assert view_cell(egocentric_obs(right), 2) == (head_row, head_col + side)
    # Every heading: the view is the board turned a quarter anticlockwise per quarter clockwise.
    for direction in (UP, RIGHT, DOWN, LEFT):
        state = snake_state(5, cells, food=(4, 1), direction=direction, mirrored=mirrored)
        board = np.asarray(envs.Snake().get_obs(state, envs.SnakeParams(grid_size=5)))
        turned = np.rot90(board, direction)
        np.testing.assert_array_equal(
            egocentric_obs(state), turned[:, ::-1] if mirrored else turned
        )


@pytest.mark.parametrize("mirrored", [False, True])
def test_snake_egocentric_moves_are_left_straight_right_as_seen(mirrored):
    env = envs.Snake(egocentric=True)
    params = envs.SnakeParams(grid_size=5)
    assert env.num_actions == env.action_space(params).n == 3
    state = snake_state(5, [(2, 2), (2, 1)], food=(0, 0), direction=RIGHT, mirrored=mirrored)
    head_row, head_col = view_cell(egocentric_obs(state), 0)
    left, right = (DOWN, UP) if mirrored else (UP, DOWN)
    step = jax.jit(env.step_env)
    for action, direction, seen in [(0, left, (0, -1)), (1, RIGHT, (-1, 0)), (2, right, (0, 1))]:
        _, after, *_ = step(jax.random.key(0), state, action, params)
        assert int(after.direction) == direction and bool(after.mirrored) == mirrored
        # The cell the head entered, as the view showed it before the move (marked by food there).
        entered = view_cell(egocentric_obs(state.replace(food=after.head)), 2)
        assert entered == (head_row + seen[0], head_col + seen[1]), action


def test_snake_egocentric_is_the_fixed_board_under_a_turn_of_moves_and_view():
    """Over random play (12,800 states, some of long snakes): each egocentric step is the fixed
    board's step with the absolute move the turn names, and each view is the board turned
    and mirrored."""
    egocentric, fixed = envs.Snake(egocentric=True), envs.Snake()
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)

    def play(key):
        def step(state, key):
            key_action, key_step = jax.random.split(key)
            action = jax.random.randint(key_action, (), 0, 3)
            obs, after, *_ = egocentric.step(key_step, state, action, params)
            return after, (state, action, key_step, obs, after)

        key_reset, key_steps = jax.random.split(key)
        state = egocentric.reset(key_reset, params)[1]
        return jax.lax.scan(step, state, jax.random.split(key_steps, 200))[1]

    states, actions, keys, obs, after = jax.tree.map(
        lambda x: x.reshape(-1, *x.shape[2:]),
        jax.jit(jax.vmap(play))(key_batch(7, 64)),
    )
    assert (np.asarray(states.length) >= 3).sum() > 100
    direction, mirrored = np.asarray(states.direction), np.asarray(states.mirrored)
    turn = (np.asarray(actions) - 1) * np.where(mirrored, -1, 1)
    absolute = (direction + turn) % 4

    def step_all(env: envs.Snake, moves: Any) -> Any:
        step = jax.vmap(lambda key, state, move: env.step_env(key, state, move, params)[1:3])
        return jax.jit(step)(keys, states, jnp.asarray(moves))

    ego_state, ego_reward = step_all(egocentric, actions)
    fixed_state, fixed_reward = step_all(fixed, absolute)
    assert_trees_equal(ego_state, fixed_state)
    np.testing.assert_array_equal(ego_reward, fixed_reward)
    boards = np.asarray(jax.jit(jax.vmap(fixed.get_obs, in_axes=(0, None)))(after, params))
    turned = np.stack(
        [np.rot90(board, k) for board, k in zip(boards, after.direction, strict=True)]
    )
    views = np.where(np.asarray(after.mirrored)[:, None, None, None], turned[:, :, ::-1], turned)
    np.testing.assert_array_equal(obs, views)


def test_snake_egocentric_reset_draws_heading_and_mirror_uniformly():
    count = 8000
    params = envs.SnakeParams(grid_size=6)
    reset = jax.jit(jax.vmap(envs.Snake(egocentric=True).reset, in_axes=(0, None)))
    _, states = reset(key_batch(3, count), params)
    headings = np.bincount(np.asarray(states.direction), minlength=4)
    assert np.all(np.abs(headings - count / 4) < 5 * np.sqrt(count / 4)), headings
    mirrored = np.asarray(states.mirrored)
    assert abs(mirrored.sum() - count / 2) < 5 * np.sqrt(count / 4)
    # Heading and mirror independent: each of the 8 views about equally often.
    views = np.bincount(np.asarray(states.direction) * 2 + mirrored, minlength=8)
    assert np.all(np.abs(views - count / 8) < 5 * np.sqrt(count / 8)), views
    _, fixed = jax.jit(jax.vmap(envs.Snake().reset, in_axes=(0, None)))(key_batch(3, 64), params)
    assert not np.asarray(fixed.direction).any() and not np.asarray(fixed.mirrored).any()


# ---------------------------------------------------------------------------------------------
# episode statistics and renderers
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "limit"), [("CartPole-v1", 500), ("Pendulum-v1", 30), ("Snake", 20)]
)
def test_episode_stats_report_the_sums_over_each_episode(name, limit):
    base, params = envs.make(name)
    env = envs.EpisodeStats(base)
    params = with_limit(name, params, limit)
    num_envs, num_steps = 4, 150

    @jax.jit
    def run(key):
        _, state = jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)

        def body(state, key):
            key_action, key_step = jax.random.split(key)
            actions = jax.vmap(base.action_space(params).sample)(
                jax.random.split(key_action, num_envs)
            )
            step = jax.vmap(env.step, in_axes=(0, 0, 0, None))
            _, state, reward, terminated, truncated, info = step(
                jax.random.split(key_step, num_envs), state, actions, params
            )
            return state, (reward, terminated | truncated, info)

        return jax.lax.scan(body, state, jax.random.split(key, num_steps))[1]

    rewards, dones, info = jax.tree.map(np.asarray, run(jax.random.key(0)))
    np.testing.assert_array_equal(info["returned_episode"], dones)
    completed = 0
    for env_index in range(num_envs):
        episode_return, episode_length = 0.0, 0
        for t in range(num_steps):
            episode_return += float(rewards[t, env_index])
            episode_length += 1
            if dones[t, env_index]:
                assert info["episode_return"][t, env_index] == pytest.approx(
                    episode_return, rel=1e-5, abs=1e-4
                )
                assert info["episode_length"][t, env_index] == episode_length
                episode_return, episode_length = 0.0, 0
                completed += 1
            else:
                assert (
                    info["episode_return"][t, env_index] == 0
                    and info["episode_length"][t, env_index] == 0
                )
    assert completed >= num_envs


@pytest.mark.parametrize("name", ENV_NAMES)
def test_renderers_draw_uint8_frames_and_vmap(name):
    env, params = envs.make(name)
    _, states = jax.vmap(env.reset, in_axes=(0, None))(key_batch(6, 3), params)
    if name == "Snake":  # a longer snake, to draw a body
        states = jax.tree.map(
            lambda *leaves: jnp.stack(leaves),
            *[
                snake_state(10, [(2, 2 + i), (2, 1 + i), (3, 1 + i)], food=(7, i), direction=RIGHT)
                for i in range(3)
            ],
        )
    else:  # different positions, so that the frames differ
        field = "x" if name.startswith("CartPole") else "theta"
        states = states.replace(**{field: jnp.array([-1.0, 0.0, 1.0])})
    frames = np.asarray(jax.jit(jax.vmap(env.render, in_axes=(0, None)))(states, params))
    single = np.asarray(jax.jit(env.render)(jax.tree.map(lambda leaf: leaf[0], states), params))
    assert frames.dtype == single.dtype == np.uint8
    assert frames.ndim == 4 and frames.shape[-1] == 3 and frames.shape[1:] == single.shape
    np.testing.assert_array_equal(frames[0], single)
    for frame in frames:
        assert (
            len(np.unique(frame.reshape(-1, 3), axis=0)) >= 3
        )  # background and two shapes at least
    assert not np.array_equal(frames[0], frames[1]) and not np.array_equal(frames[1], frames[2])
    wrapped = envs.EpisodeStats(env)
    _, wrapped_state = wrapped.reset(jax.random.key(0), params)
    assert jax.eval_shape(wrapped.render, wrapped_state, params).shape == single.shape


# ---------------------------------------------------------------------------------------------
# benchmark.py envs: runs, and merges its rows into the results file
# ---------------------------------------------------------------------------------------------


def test_benchmark_envs_writes_rows_and_keeps_other_rows(tmp_path, monkeypatch):
    import benchmark

    output = tmp_path / "benchmarks.json"
    other = {
        "benchmark": "train_throughput",
        "library": "some_script",
        "env": "x",
        "num_envs": 2,
        "device": "d",
    }
    output.write_text(json.dumps({"description": "rows", "rows": [other]}))
    argv = [
        "benchmark.py",
        "--output",
        str(output),
        "envs",
        "--num-envs",
        "2",
        "--quick",
        "--repeats",
        "2",
    ]
    monkeypatch.setattr("sys.argv", [*argv, "--envs", "CartPole-v1", "Snake", "--no-reference"])
    benchmark.main()
    rows = json.loads(output.read_text())["rows"]
    assert other in rows
    measured = [row for row in rows if row["benchmark"] == "env_steps"]
    assert sorted(row["env"] for row in measured) == ["CartPole-v1", "Snake"]
    for row in measured:
        assert row["library"] == "ours" and row["num_envs"] == 2 and row["repeats"] == 2
        assert (
            row["steps_per_second"] > 0
            and row["compile_seconds"] > 0
            and len(row["steps_per_second_runs"]) == 2
        )
        assert row["device"] and row["jax_version"] == jax.__version__ and row["date"]
    assert (tmp_path / "benchmark_envs.png").stat().st_size > 0
    # A second run replaces rows with the same key instead of adding duplicates.
    monkeypatch.setattr("sys.argv", [*argv, "--envs", "Snake", "--no-reference"])
    benchmark.main()
    rows = json.loads(output.read_text())["rows"]
    assert len(rows) == 3 and other in rows
