"""Tests of ppo_snake.py: the networks and their initialiser, the reverse-move mask against
envs.Snake's neck rule, the losses by hand, seeds under vmap, the CLI contract where it depends on
the script (in process and in subprocesses) and, marked slow, that a short run learns to eat.
The command-line block's own behaviour (Ctrl-C, output folders, the compile cache, refused
files) is tested once, in test_sac_pendulum.py: test_cli_block.py keeps the four blocks one."""

import csv
import dataclasses
import functools
import json
import os
import subprocess
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import XLA_DEFAULT, forced_cpu_devices, in_process, run_script
from test_envs import snake_state

import envs
import ppo_snake as ppo

# A run small enough to compile and train in seconds: 2 chunks of 2 iterations of 4 envs x 16
# steps on a 6x6 board, each iteration 2 epochs of 2 minibatches.
TINY = ppo.Config(
    num_envs=4,
    num_steps=16,
    num_minibatches=2,
    update_epochs=2,
    conv_channels=(4,),
    hidden_size=16,
    log_every=128,
    total_timesteps=256,
    env=ppo.EnvConfig(grid_size=6),
)
EVAL_EPISODES = 2  # as --eval-episodes in TINY_FLAGS
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


# ---- networks, their initialiser and the reverse-move mask ----


@pytest.mark.parametrize("network", ["conv", "transformer"])
def test_network_output_shapes(network):
    for grid_size in [6, 10, 13, 20]:
        config = dataclasses.replace(
            ppo.Config(), network=network, env=ppo.EnvConfig(grid_size=grid_size)
        )
        net = ppo.make_network(config, 4)
        obs = jax.ShapeDtypeStruct((3, 2, grid_size, grid_size, 3), jnp.float32)  # any batch axes
        params = jax.eval_shape(net.init, jax.random.key(0), obs)
        logits, value = jax.eval_shape(net.apply, params, obs)
        assert logits.shape == (3, 2, 4) and value.shape == (3, 2), grid_size


def test_the_trunk_sees_how_soon_each_body_cell_is_free():
    """Besides the env's three channels, the trunk gets 1/k for a body cell free in k steps (the
    tail 1, the cell behind it 1/2: the env's recency, k/length, tells them apart by 1/length)
    and a channel of ones; a snake of 5 along the top row of the fixed board, tail at column 0."""
    env = envs.Snake()
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)
    head_to_tail = [(0, column) for column in range(4, -1, -1)]
    state = snake_state(6, head_to_tail, food=(3, 3), direction=0)
    network = ppo.make_network(ppo.Config(), 4)
    obs = jax.jit(env.get_obs)(state, params)

    @jax.jit  # one program (the suite compiles fewer, larger programs than eager ops)
    def trunk_input(obs):
        trunk_inputs = []

        def record_trunk_input(next_fun, args, kwargs, context):
            if isinstance(context.module, ppo.ConvTrunk):
                trunk_inputs.append(args[0])
            return next_fun(*args, **kwargs)

        with nn.intercept_methods(record_trunk_input):
            network.init(jax.random.key(0), obs)
        return trunk_inputs[0]

    board = np.asarray(trunk_input(obs))
    assert board.shape == (6, 6, 5)
    np.testing.assert_array_equal(board[..., :3], obs)
    soon_free = np.zeros((6, 6), np.float32)
    soon_free[0, :5] = [1, 1 / 2, 1 / 3, 1 / 4, 1 / 5]
    np.testing.assert_allclose(board[..., 3], soon_free, rtol=1e-6)
    np.testing.assert_array_equal(board[..., 4], 1.0)


@functools.cache  # each view's play serves several tests
def play_randomly(egocentric: bool) -> tuple:
    """States and observations of 64 random-playing snakes on a 6x6 board over 400 steps, with
    the key each step used; on this small board random snakes eat and grow."""
    env = envs.Snake(egocentric=egocentric)
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)

    def step(carry, key):
        obs, state = carry
        key_action, key_step = jax.random.split(key)
        action = jax.random.randint(key_action, (), 0, env.num_actions)
        next_obs, next_state, *_ = env.step(key_step, state, action, params)
        return (next_obs, next_state), (obs, state, key_step)

    def play(key):
        key_reset, key_steps = jax.random.split(key)
        return jax.lax.scan(step, env.reset(key_reset, params), jax.random.split(key_steps, 400))[1]

    obs, states, keys = jax.jit(jax.vmap(play))(jax.random.split(jax.random.key(0), 64))
    flat = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), (obs, states, keys))
    return env, params, *flat


@pytest.fixture(scope="module")
def random_play():
    return play_randomly(False)


@pytest.mark.parametrize("egocentric", [True, False])
def test_deadly_move_mask_is_the_envs_death_rule(egocentric):
    """Every move of every state of random play: masked exactly when the env's step kills (a
    wall, or a body cell other than the tail, also on the step after a meal, when the tail
    stays). The fixed board's move back into the neck is the reverse-move mask's."""
    env, params, obs, states, keys = play_randomly(egocentric)
    network = ppo.make_network(ppo.Config(), env.num_actions)
    variables = jax.jit(network.init)(jax.random.key(0), obs[0])
    logits = np.asarray(jax.jit(network.apply)(variables, obs)[0])
    moves = np.arange(env.num_actions)
    step = jax.vmap(jax.vmap(env.step_env, (None, None, 0, None)), (0, 0, None, None))
    _, _, reward, done, info = jax.jit(step)(keys, states, moves, params)
    dies = np.asarray(done & ~info["won"])
    masked = logits < -1e8
    if not egocentric:
        reverse = np.asarray(jax.jit(ppo.reverse_move_mask)(obs))
        masked, dies = masked[~reverse], dies[~reverse]
    just_ate = np.asarray(states.steps_since_food == 0) & (np.asarray(states.length) > 1)
    assert dies.mean() > 0.1 and just_ate.sum() > 100  # deaths of every kind, and meals
    np.testing.assert_array_equal(masked, dies)


def room_by_hand(body_order: np.ndarray, cell: tuple[int, int]) -> int:
    """room_after_move's rule cell by cell: grow the region R from the entered cell, adding a
    neighbour that is free (0) or free in k <= |R| + 1 moves, until nothing can be added."""
    size = len(body_order)
    if not (0 <= cell[0] < size and 0 <= cell[1] < size) or body_order[cell] > 1:
        return 0
    region, grew = {cell}, True
    while grew:
        near = {(r + dr, c + dc) for r, c in region for dr, dc in envs.SNAKE_MOVES}
        near = {(r, c) for r, c in near - region if 0 <= r < size and 0 <= c < size}
        joining = {n for n in near if body_order[n] <= len(region) + 1}
        region, grew = region | joining, bool(joining)
    return len(region)


@pytest.mark.parametrize("egocentric", [True, False])
def test_no_room_is_the_envs_death_rule(egocentric):
    """Every move of every state of random play: room_after_move is 0 exactly when the env's step
    kills, so the shield forbids every deadly move (the fixed board's move back into the neck,
    which the env turns into "keep going", aside)."""
    env, params, obs, states, keys = play_randomly(egocentric)
    room = np.asarray(jax.jit(ppo.room_after_move, static_argnums=1)(obs, env.num_actions))
    moves = np.arange(env.num_actions)
    step = jax.vmap(jax.vmap(env.step_env, (None, None, 0, None)), (0, 0, None, None))
    _, _, reward, done, info = jax.jit(step)(keys, states, moves, params)
    dies = np.asarray(done & ~info["won"])
    if not egocentric:
        reverse = np.asarray(ppo.reverse_move_mask(obs))
        room, dies = room[~reverse], dies[~reverse]
    assert dies.mean() > 0.1
    np.testing.assert_array_equal(room == 0, dies)


def random_long_snakes(num_snakes: int, size: int = 6) -> np.ndarray:
    """int[num_snakes, size, size] bodies (head = length .. tail 1): random self-avoiding walks
    of up to 3 * size cells, which coil into pockets as random play's short snakes never do."""
    rng = np.random.default_rng(0)
    bodies = np.zeros((num_snakes, size, size), np.int64)
    for body in bodies:
        walk = [tuple(rng.integers(0, size, 2))]
        while len(walk) < 3 * size:
            r, c = walk[-1]
            steps = [(r + dr, c + dc) for dr, dc in envs.SNAKE_MOVES]
            steps = [p for p in steps if 0 <= min(p) and max(p) < size and p not in walk]
            if not steps:
                break
            walk.append(steps[rng.integers(len(steps))])
        for order, cell in enumerate(walk):  # the walk's first cell is the tail
            body[cell] = order + 1
    return bodies


@pytest.mark.parametrize("egocentric", [True, False])
def test_room_is_a_flood_fill_by_hand_and_the_shield_leaves_the_most_room(egocentric):
    """Long random snakes, every heading and mirror: room_after_move equals room_by_hand; the
    shield forbids the moves without room and those with less room than the snake's length where
    another move has more, and never the move with the most room (unless it has none)."""
    env, params = envs.Snake(egocentric=egocentric), envs.SnakeParams(grid_size=6)
    bodies = random_long_snakes(1000)
    heads = [np.argwhere(body == body.max())[0] for body in bodies]
    state = jax.jit(env.reset)(jax.random.key(0), params)[1]
    states = jax.jit(
        jax.vmap(
            lambda body, head, direction, mirrored: state.replace(
                body=body, head=head, direction=direction, length=body.max(), mirrored=mirrored
            )
        )
    )(
        jnp.asarray(bodies, jnp.int32),
        jnp.asarray(np.array(heads), jnp.int32),
        jnp.arange(1000, dtype=jnp.int32) % 4,
        jnp.arange(1000) % 8 < 4,
    )
    obs = jax.jit(jax.vmap(env.get_obs, (0, None)))(states, params)
    room = np.asarray(jax.jit(ppo.room_after_move, static_argnums=1)(obs, env.num_actions))
    view_moves = ((0, -1), (-1, 0), (0, 1)) if egocentric else envs.SNAKE_MOVES
    body_order = np.round(np.asarray(obs[..., 1]) * bodies.max((1, 2))[:, None, None])
    for i, view in enumerate(body_order):
        head = np.argwhere(view == view.max())[0]
        by_hand = [room_by_hand(view, (head[0] + r, head[1] + c)) for r, c in view_moves]
        np.testing.assert_array_equal(room[i], by_hand)
    length = bodies.max((1, 2))[:, None]
    dead_end = (room < np.minimum(length, room.max(-1, keepdims=True))) & (room > 0)
    assert dead_end.sum() > 20 and ((room > 0) & (room < 36)).sum() > 80  # pockets of all sizes
    shielded = np.asarray(jax.jit(ppo.dead_end_mask, static_argnums=1)(obs, env.num_actions))
    np.testing.assert_array_equal(shielded, (room == 0) | dead_end)
    most_room = np.take_along_axis(shielded, room.argmax(-1)[:, None], axis=-1)[:, 0]
    np.testing.assert_array_equal(most_room, room.max(-1) == 0)


def pocket_state() -> tuple[envs.Snake, envs.SnakeParams, envs.SnakeState]:
    """Fixed board, a snake of 12 whose head at (1, 0) has a 2-cell pocket (1, 1)-(1, 2) on its
    right, closed by body cells that stay for 4 moves or more; below it, the open board."""
    env = envs.Snake()
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)
    head_to_tail = [(1, 0), (0, 0), (0, 1), (0, 2), (0, 3), (1, 3), (2, 3), (2, 2), (2, 1)]
    head_to_tail += [(3, 1), (3, 2), (3, 3)]
    return env, params, snake_state(6, head_to_tail, food=(1, 2), direction=2)


def test_the_shield_turns_a_greedy_policy_away_from_a_pocket_smaller_than_the_snake():
    """The pocket holds the food and the policy's bias points right, into it: greedy without the
    shield it enters the pocket; with the shield it goes down, into the open board (the moves:
    up, right, down, left)."""
    env, params, state = pocket_state()
    obs = jax.jit(env.get_obs)(state, params)
    # Down: the 24 free cells, then every body cell as the tail leaves it: the whole board.
    np.testing.assert_array_equal(ppo.room_after_move(obs, 4), [0, 2, 36, 0])
    np.testing.assert_array_equal(ppo.dead_end_mask(obs, 4), [True, True, False, True])
    config = dataclasses.replace(ppo.Config(), env=ppo.EnvConfig(grid_size=6, egocentric=False))
    _, _, act = ppo.make_greedy_policy(config)
    network = ppo.make_network(config, 4)
    variables = jax.jit(network.init)(jax.random.key(0), obs)
    variables["params"]["policy"]["bias"] = jnp.array([0.0, 100.0, 0.0, 0.0])
    assert act(variables, obs, shield=False) == 1 and act(variables, obs) == 2


def test_a_boxed_in_snake_has_every_move_masked_and_a_uniform_policy():
    """A snake of 6 curled into the top-left corner, its head in the corner facing the wall."""
    env = envs.Snake(egocentric=True)
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)
    head_to_tail = [(0, 0), (0, 1), (1, 1), (1, 0), (2, 0), (2, 1)]
    state = snake_state(6, head_to_tail, food=(4, 4), direction=3)  # moved left
    moves = jnp.arange(3)
    _, _, reward, done, _ = jax.jit(jax.vmap(env.step_env, (None, None, 0, None)))(
        jax.random.key(1), state, moves, params
    )
    assert (np.asarray(reward) == -1).all() and np.asarray(done).all()
    network = ppo.make_network(ppo.Config(), 3)
    obs = jax.jit(env.get_obs)(state, params)
    logits = jax.jit(lambda obs: network.apply(network.init(jax.random.key(0), obs), obs)[0])(obs)
    assert (np.asarray(logits) < -1e8).all()
    np.testing.assert_allclose(jax.nn.softmax(logits), 1 / 3, rtol=1e-5)


def test_reverse_move_mask_is_the_envs_neck_rule(random_play):
    env, params, obs, states, keys = random_play
    assert (states.length >= 3).sum() > 100  # the test sees long snakes, not only fresh ones
    mask = np.asarray(jax.jit(ppo.reverse_move_mask)(obs))
    moves = np.arange(4)
    reverse = (moves + 2) % 4 == np.asarray(states.direction)[:, None]
    np.testing.assert_array_equal(mask, reverse & (np.asarray(states.length)[:, None] > 1))
    # What the env does with the masked move is exactly what it does with "keep going".
    long = np.flatnonzero(np.asarray(states.length) > 1)
    step = jax.jit(jax.vmap(env.step_env, in_axes=(0, 0, 0, None)))
    states = jax.tree.map(lambda x: x[long], states)
    after_masked = step(keys[long], states, jnp.argmax(mask[long], axis=-1), params)[1]
    after_straight = step(keys[long], states, states.direction, params)[1]
    jax.tree.map(np.testing.assert_array_equal, after_masked, after_straight)


def test_the_default_view_is_egocentric_and_the_first_policy_uniform_over_the_safe_moves():
    env, params = ppo.make_env(ppo.Config())
    assert env.egocentric and env.num_actions == 3 and params.max_steps_without_food == 200
    obs = play_randomly(True)[2][::8]
    net = ppo.make_network(ppo.Config(), env.num_actions)
    logits = jax.jit(lambda obs: net.apply(net.init(jax.random.key(0), obs[0]), obs)[0])(obs)
    masked = np.asarray(logits < -1e8)
    assert 0 < masked.mean() < 0.5
    allowed = np.where(masked.all(-1, keepdims=True), 3, 3 - masked.sum(-1, keepdims=True))
    expected = np.where(masked & ~masked.all(-1, keepdims=True), 0.0, 1.0 / allowed)
    np.testing.assert_allclose(jax.nn.softmax(logits), expected, atol=0.02)


@pytest.mark.parametrize("network", ["conv", "transformer"])
def test_policy_starts_near_uniform_and_never_chooses_the_reverse_move(random_play, network):
    obs = random_play[2][::8]
    config = dataclasses.replace(ppo.Config(), network=network, move_mask=False)
    net = ppo.make_network(config, 4)

    @jax.jit
    def policies(obs):
        params = net.init(jax.random.key(0), obs[0])
        confident = jax.tree.map(lambda x: 30.0 * x, params)  # a policy far from uniform
        fresh_policy = jax.nn.softmax(net.apply(params, obs)[0])
        confident_policy = jax.nn.softmax(net.apply(confident, obs)[0])
        return fresh_policy, confident_policy, ppo.reverse_move_mask(obs)

    fresh, confident, mask = map(np.asarray, policies(obs))
    assert mask.any(axis=-1).sum() > 100
    assert np.isfinite(fresh).all() and np.isfinite(confident).all()
    # At first (head gain 0.01) near uniform over the allowed moves: three with a neck, else four.
    allowed = 4 - mask.sum(-1, keepdims=True)
    np.testing.assert_allclose(fresh, np.where(mask, 0.0, 1.0 / allowed), atol=0.02)
    assert (fresh[mask] == 0).all() and (confident[mask] == 0).all()
    np.testing.assert_allclose(confident.sum(-1), 1.0, rtol=1e-5)
    assert confident.max(-1).mean() > 0.5


def test_init_is_orthogonal_with_the_gains_of_huang_et_al_under_vmap():
    """Every conv-trunk kernel is gain x orthogonal, two seeds initialised in one vmapped call
    (where flax's QR-based initialiser deadlocks on CPU); the seeds differ; the biases are 0."""
    net = ppo.make_network(ppo.Config(), 4)
    params = jax.jit(jax.vmap(net.init, in_axes=(0, None)))(
        jax.random.split(jax.random.key(0), 2), jnp.zeros((10, 10, 3))
    )["params"]
    gains = {
        ("trunk", "conv_0"): np.sqrt(2),
        ("trunk", "conv_1"): np.sqrt(2),
        ("trunk", "dense"): np.sqrt(2),
        ("policy",): 0.01,
        ("value",): 1.0,
    }
    for path, gain in gains.items():
        layer = params
        for name in path:
            layer = layer[name]
        assert not np.allclose(layer["kernel"][0], layer["kernel"][1])
        for kernel in np.asarray(layer["kernel"]) / gain:
            gram = kernel.T @ kernel if kernel.shape[0] >= kernel.shape[1] else kernel @ kernel.T
            np.testing.assert_allclose(gram, np.eye(len(gram)), atol=1e-5, err_msg=str(path))
        np.testing.assert_array_equal(layer["bias"], 0.0)


# ---- losses and advantages, by hand ----


def test_gae_by_hand_stops_at_episode_ends_and_bootstraps_only_truncations():
    """One env, three steps: step 0 continues, step 1 is truncated, step 2 terminates."""
    rewards = jnp.array([[1.0], [2.0], [3.0]])
    values = jnp.array([[0.5], [1.0], [1.5]])
    next_values = jnp.array([[1.0], [4.0], [9.0]])  # 9: after a termination, never used
    terminated = jnp.array([[False], [False], [True]])
    truncated = jnp.array([[False], [True], [False]])
    advantages, targets = ppo.compute_gae(
        rewards, values, next_values, terminated, truncated, gamma=0.9, gae_lambda=0.5
    )
    # step 2: 3 - 1.5 = 1.5; step 1: 2 + 0.9 * 4 - 1 = 4.6 (its own end: nothing flows back);
    # step 0: delta 1 + 0.9 * 1 - 0.5 = 1.4, plus 0.9 * 0.5 * 4.6 = 2.07 from step 1.
    np.testing.assert_allclose(advantages[:, 0], [3.47, 4.6, 1.5], rtol=1e-6)
    np.testing.assert_allclose(targets, advantages + values)


def test_policy_and_value_losses_by_hand():
    log_prob = jnp.log(jnp.array([0.5, 0.3, 0.2]))
    old_log_prob = jnp.log(jnp.array([0.25, 0.3, 0.4]))  # ratios 2, 1, 0.5
    advantages = jnp.array([1.0, -2.0, 3.0])
    loss, approx_kl, clip_frac = ppo.policy_loss(log_prob, old_log_prob, advantages, 0.2)
    # max(-A r, -A clip(r)): max(-2, -1.2) = -1.2; max(2, 2) = 2; max(-1.5, -2.4) = -1.5
    np.testing.assert_allclose(loss, np.mean([-1.2, 2.0, -1.5]), rtol=1e-6)
    np.testing.assert_allclose(
        approx_kl, np.mean([1 - np.log(2), 0.0, -0.5 - np.log(0.5)]), rtol=1e-5
    )
    np.testing.assert_allclose(clip_frac, 2 / 3, rtol=1e-6)
    values = jnp.array([1.0, 3.0])
    old_values = jnp.array([0.0, 2.9])
    targets = jnp.array([2.0, 0.0])
    np.testing.assert_allclose(ppo.value_loss(values, old_values, targets, 0.2, False), 2.5)
    # clipped: values 0.2 and 3.0 (within 0.2 of old): errors max(1, 3.24) and max(9, 9)
    np.testing.assert_allclose(
        ppo.value_loss(values, old_values, targets, 0.2, True), 0.5 * (3.24 + 9) / 2, rtol=1e-6
    )


def test_food_shaping_by_hand():
    env = envs.Snake()
    params = envs.SnakeParams(grid_size=6, max_steps_without_food=36)
    _, state = env.reset(jax.random.key(0), params)
    state = state.replace(head=jnp.array([1, 1]), food=jnp.array([4, 3]))
    obs = env.get_obs(state, params)
    closer = env.get_obs(state.replace(head=jnp.array([2, 1])), params)
    np.testing.assert_allclose(ppo.food_potential(obs), -5 / 6, rtol=1e-6)
    shaped = ppo.shaped_reward(
        jnp.array([0.0, -1.0]),
        jnp.stack([obs, obs]),
        jnp.stack([closer, closer]),
        jnp.array([False, True]),
        gamma=0.9,
        weight=2.0,
    )
    # a step closer: 2 (0.9 * -4/6 + 5/6); a death: -1 + 2 (0 + 5/6), the potential 0 there
    np.testing.assert_allclose(shaped, [2 * (0.9 * -4 / 6 + 5 / 6), -1 + 2 * 5 / 6], rtol=1e-6)


# ---- training: seeds, determinism, the metrics ----


@pytest.fixture(scope="module")
def two_seed_run():
    """Seeds 3 and 4 of TINY in one vmapped program."""
    config = dataclasses.replace(TINY, seed=3, num_seeds=2)
    _, _, train = ppo.make_train(config)
    return config, train, jax.jit(jax.vmap(train))(ppo.seed_keys(config)["train"])


def test_vmapped_seed_equals_single_run_and_seeds_differ(two_seed_run):
    config, train, (state, metrics) = two_seed_run
    assert metrics.value_loss.shape == (2, ppo.chunk_sizes(config)[1])
    assert int(state.updates[0]) == 2 * 2 * 2 * 2  # chunks x iterations x epochs x minibatches
    single_key = ppo.seed_keys(dataclasses.replace(config, seed=4, num_seeds=1))["train"][0]
    single_state, single_metrics = jax.jit(train)(single_key)  # seed 3 + 1 alone
    close = dict(rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(
        jax.tree.map(lambda x: x[1], state.params), single_state.params, **close
    )
    for name in ppo.METRIC_COLUMNS:
        np.testing.assert_allclose(
            getattr(metrics, name)[1], getattr(single_metrics, name), **close, err_msg=name
        )
    kernel = state.params["params"]["trunk"]["conv_0"]["kernel"]
    assert not np.allclose(kernel[0], kernel[1])


def test_same_seed_gives_identical_metrics_in_process(two_seed_run):
    config, train, (_, metrics) = two_seed_run
    _, again = jax.jit(jax.vmap(train))(ppo.seed_keys(config)["train"])
    chex.assert_trees_all_equal(metrics, again)


def test_cli_chunk_loop_equals_train(two_seed_run):
    """The CLI's path (init, then run_chunk from Python) is the same computation as train."""
    config, _, (state, metrics) = two_seed_run
    init, run_chunk, _ = ppo.make_train(config)
    loop_state = jax.jit(jax.vmap(init))(ppo.seed_keys(config)["train"])
    chunk = jax.jit(jax.vmap(run_chunk, in_axes=(0, None)))
    for index in range(ppo.chunk_sizes(config)[1]):
        loop_state, loop_metrics = chunk(loop_state, index)
    chex.assert_trees_all_close(loop_state.params, state.params, rtol=1e-4, atol=1e-5)
    chex.assert_trees_all_close(
        loop_metrics, jax.tree.map(lambda x: x[:, -1], metrics), rtol=1e-4, atol=1e-5
    )


def test_a_chunk_runs_without_any_host_transfer():
    init, run_chunk, _ = ppo.make_train(TINY)
    chunk = jax.jit(run_chunk, donate_argnums=0)
    state = jax.jit(init)(jax.random.key(0))
    index = jnp.int32(0)
    state, _ = chunk(state, index)  # compiled outside the guard (compiling may transfer)
    index = jax.device_put(jnp.int32(1))
    with jax.transfer_guard("disallow"):
        state, metrics = chunk(state, index)
    assert int(metrics.updates) > 0


def test_score_counts_food():
    """Food eaten = return + 1 for an episode that ended in a death: between return and + 1.
    Without the move mask, as TINY's short run with it ends no episode (it dies only boxed in)."""
    config = dataclasses.replace(TINY, seed=3, num_seeds=2, move_mask=False)
    _, _, train = ppo.make_train(config)
    _, metrics = jax.jit(jax.vmap(train))(ppo.seed_keys(config)["train"])
    surplus = np.asarray(metrics.score - metrics.episode_return)
    assert ((surplus >= 0) & (surplus <= 1 + 1e-6)).all() and (surplus > 0).any()
    assert (np.asarray(metrics.score) >= 0).all() and (np.asarray(metrics.win_rate) == 0).all()


def test_rewind_points_by_hand():
    """Four envs, a game's point standing for its state: env 0 eats (its points move up), env 1
    dies and rewinds (to its point after the meal before last), env 2 dies or hungers and
    restarts (both points become the reset), env 3 just moves."""
    ate = jnp.array([True, False, False, False])
    rewinds = jnp.array([False, True, False, False])
    restarts = jnp.array([False, False, True, False])
    now = jnp.array([10.0, 11, 12, 13]), jnp.array([[10.0], [11], [12], [13]])
    last_meal = jnp.array([20.0, 21, 22, 23]), jnp.array([[20.0], [21], [22], [23]])
    meal_before = jnp.array([30.0, 31, 32, 33]), jnp.array([[30.0], [31], [32], [33]])
    got = jax.vmap(ppo.rewind_points)(ate, rewinds, restarts, now, last_meal, meal_before)
    want = [[10, 31, 12, 13], [10, 31, 12, 23], [20, 31, 12, 33]]  # now, last meal, meal before
    for points, expected in zip(got, want, strict=True):
        np.testing.assert_array_equal(points[0], expected)
        np.testing.assert_array_equal(points[1][:, 0], expected)


def test_rewind_points_are_whole_states_one_meal_apart():
    """After training with every death rewound, each env's rewind points are states with their
    own observations, the older one meal shorter or equal (after a reset or a rewind)."""
    init, run_chunk, _ = ppo.make_train(dataclasses.replace(TINY, rewind_prob=1.0))
    state, _ = jax.jit(run_chunk)(jax.jit(init)(jax.random.key(1)), 0)
    env, _ = ppo.make_env(TINY)
    length = {}
    for name in ("last_meal", "meal_before"):
        stats, obs = getattr(state, name)
        np.testing.assert_array_equal(jax.jit(jax.vmap(env.get_obs))(stats.env_state), obs)
        length[name] = np.asarray(stats.env_state.length)
    assert np.isin(length["last_meal"] - length["meal_before"], [0, 1]).all()
    assert (np.asarray(state.env_state.env_state.length) >= length["last_meal"]).all()


def test_evaluation_starts_from_other_states_than_training():
    """The evaluation's key is split from the seed's key beside training's, not folded from it:
    its first reset states share nothing with the training envs' first reset states (a reset
    state is the head's and the food's cells: 159,600 of them on 20x20, so no pair of 64 meets
    by chance)."""
    config = dataclasses.replace(TINY, num_envs=8, env=ppo.EnvConfig(20))
    keys = ppo.seed_keys(config)
    init, _, _ = ppo.make_train(config)
    training_obs = np.asarray(jax.jit(init)(keys["train"][0]).obs)
    env, env_params = ppo.make_env(config)
    episode_keys = jax.random.split(keys["evaluate"][0], 8)  # as evaluate does for 8 episodes
    reset_keys = jax.vmap(lambda key: jax.random.split(key)[0])(episode_keys)
    reset = jax.jit(jax.vmap(env.reset, in_axes=(0, None)))
    evaluation_obs = np.asarray(reset(reset_keys, env_params)[0])
    same = (training_obs[:, None] == evaluation_obs[None, :]).all(axis=(-3, -2, -1))
    assert not same.any()
    assert (
        len({str(key) for key in [keys["train"][0], keys["evaluate"][0], keys["render"][0]]}) == 3
    )


def test_evaluate_and_render_shapes(two_seed_run):
    config, _, (state, _) = two_seed_run
    keys = ppo.seed_keys(config)
    params = ppo.trained_params(config, state)
    episodes = jax.jit(jax.vmap(ppo.make_evaluate(config, EVAL_EPISODES)))(params, keys["evaluate"])
    unshielded = {"score_unshielded", "win_unshielded"}  # the same games without the shield
    assert set(episodes) == {"episode_return", "score", "win", "episode_length"} | unshielded
    for values in episodes.values():
        assert values.shape == (2, EVAL_EPISODES)
    died = episodes["score"] - episodes["episode_return"]
    assert np.isin(np.asarray(died), [0.0, 1.0]).all()
    no_shield = dataclasses.replace(config, shield=False)
    alone = jax.jit(jax.vmap(ppo.make_evaluate(no_shield, EVAL_EPISODES)))(params, keys["evaluate"])
    assert set(alone) == {"episode_return", "score", "win", "episode_length"}
    for name in ["score", "win"]:
        np.testing.assert_array_equal(alone[name], episodes[f"{name}_unshielded"])
    render, seconds_per_frame = ppo.make_render(config)
    frames = jax.jit(render)(jax.tree.map(lambda x: x[0], params), keys["render"][0])
    cell_pixels = 120 // 6
    board = 6 * cell_pixels
    width = ppo.GIF_BOARDS * board + (ppo.GIF_BOARDS - 1) * cell_pixels
    assert frames.shape == (ppo.GIF_FRAMES, board, width, 3) and frames.dtype == jnp.uint8
    assert seconds_per_frame > 0


# ---- the command line contract: in process ----


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
        (dict(ent_coef=-0.1), "--ent-coef"),
        (dict(gamma=0.0), "--gamma"),
        (dict(gae_lambda=1.5), "--gae-lambda"),
        (dict(num_minibatches=3), "--num-minibatches"),
        (dict(total_timesteps=100), "--total-timesteps"),
        (dict(seed=-1), "--seed"),
    ],
)
def test_validate_names_the_bad_flag(change, flag):
    with pytest.raises(ppo.UsageError, match=flag):
        ppo.validate(dataclasses.replace(TINY, **change))
    ppo.validate(TINY)


@pytest.mark.parametrize(
    "options, flag",
    [
        (ppo.Options(eval_only=True), "--eval-only"),
        (ppo.Options(load_model="model.msgpack"), "--load-model"),
        (ppo.Options(eval_episodes=0), "--eval-episodes"),
    ],
)
def test_check_options_names_the_bad_flag(options, flag):
    with pytest.raises(ppo.UsageError, match=flag):
        ppo.check_options(options)
    ppo.check_options(ppo.Options())


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--env.grid-size", "21"], "--env.grid-size must be in [6, 20], got 21"),
        (["--num-minibatches", "3"], "--num-minibatches"),
        (["--total-timesteps", "100"], "--total-timesteps"),
        (["--eval-only"], "--load-model"),
        (["--eval-only", "--load-model", "no/such/model.msgpack"], "--load-model"),
    ],
)
def test_bad_values_exit_2_with_one_line_before_compiling(flags, name):
    """In process: main validates before anything is compiled."""
    status, _, stderr = in_process(ppo, *flags)
    assert status == 2 and len(stderr.strip().splitlines()) == 1 and name in stderr, stderr


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--no-such-flag", "3"], "--no-such-flag"),
        (["--grid-size", "8"], "--env.grid-size"),  # tyro's "Perhaps you meant"
        (["--network", "mlp"], "--network"),
        (["--num-envs", "many"], "--num-envs"),
    ],
)
def test_what_tyro_rejects_it_reports_with_exit_2(flags, name, capsys):
    with pytest.raises(SystemExit) as exit_:
        ppo.parse_args(flags)
    assert exit_.value.code == 2
    assert name in capsys.readouterr().err


# ---- the command line contract: whole runs (conftest.run_script) ----


def run(*flags, env=None) -> subprocess.CompletedProcess:
    return run_script(ppo, *flags, env=env)


def test_help_lists_every_option():
    status, out, err = in_process(ppo, "--help")
    assert status == 0
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
        "--overwrite",
        "--no-save-model",
        "--no-capture-gif",
        "--no-plot",
        "--no-compile-cache",
        "--eval-episodes",
        "--log-every",
        "--load-model",
        "--eval-only",
        "--network",
        "--conv-channels",
        "--env.grid-size",
        "--env.max-steps-without-food",
    ]:
        assert flag in out, flag
    assert "shaped_reward" not in out  # a function's name is no help


def test_bad_flags_from_the_command_line():
    status, out, err = in_process(ppo, "--env.grid-size", "21")
    assert status == 2 and err.strip() == (
        "ppo_snake.py: error: --env.grid-size must be in [6, 20], got 21"
    )
    status, out, err = in_process(ppo, "--no-such-flag")
    assert status == 2 and "--no-such-flag" in err


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    flags = [*TINY_FLAGS, "--num-seeds", "2", "--seed", "5", "--output-dir", str(out)]
    result = run(*flags)
    assert result.returncode == 0, result.stderr
    return out, result


def test_run_writes_every_output(finished_run):
    out, result = finished_run
    first_line = result.stdout.splitlines()[0]
    assert first_line.endswith(f"compile cache: {os.environ['JAX_COMPILATION_CACHE_DIR']}")
    assert "Snake 6x6" in first_line and "compiled in" in result.stdout
    progress = [line for line in result.stdout.splitlines() if line.startswith("steps ")]
    assert len(progress) == 2 and all("score" in line and "win_rate" in line for line in progress)
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
    config = json.loads((out / "config.json").read_text())
    assert config["num_seeds"] == 2 and config["env"]["grid_size"] == 6
    rows = list(csv.DictReader((out / "metrics.csv").open()))
    assert tuple(rows[0]) == (
        "seed",
        "env_steps",
        "updates",
        "wall_seconds",
        "sps",
        *ppo.METRIC_COLUMNS,
    )
    assert len(rows) == 2 * ppo.chunk_sizes(TINY)[1]
    assert [row["seed"] for row in rows] == ["5", "6", "5", "6"]
    summary = json.loads((out / "summary.json").read_text())
    for key in [
        "final_returns",
        "final_return_mean",
        "final_return_std",
        "final_score",
        "final_win",
        "final_episode_length",
        "final_score_unshielded",
        "final_win_unshielded",
        "train_seconds",
        "compile_seconds",
        "env_steps_per_second",
        "updates_per_second",
        "num_seeds",
        "num_envs",
        "device",
    ]:
        assert key in summary, key
    assert len(summary["final_returns"]) == len(summary["final_score"]) == 2
    assert summary["env_steps"] == 256
    assert min(summary["final_score"]) >= 0
    assert all(0 <= win <= 1 for win in summary["final_win"])
    evaluation = result.stdout.splitlines()[-2]  # the means of the evaluation's other metrics
    assert evaluation.startswith("evaluation, 2 deterministic episodes per run")
    assert all(name in evaluation for name in [" ± ", "score ", "win ", "episode_length "])


def test_the_curves_show_every_metric_and_the_policy_in_the_last_panel(finished_run):
    """Snake has nine metric columns: the figure grows a row, so that each has its panel and the
    policy keeps the last one; the solved line is labelled and the GIF has its caption."""
    from PIL import Image

    out, _ = finished_run
    rows = [
        {name: float(value) for name, value in row.items()}
        for row in csv.DictReader((out / "metrics.csv").open())
    ]
    from matplotlib.figure import Figure

    figure = Figure()
    ppo.draw_curves(figure, TINY, [{}], rows, np.zeros((2, 8, 8, 3), np.uint8))
    axes = list(figure.axes)
    titles = [axis.get_title() for axis in axes[: len(ppo.METRIC_COLUMNS)]]
    assert titles == list(ppo.METRIC_COLUMNS)
    assert len(axes) > len(ppo.METRIC_COLUMNS) and axes[-1].images
    assert not any(axis.images for axis in axes[: len(ppo.METRIC_COLUMNS)])
    assert "solved (33)" in axes[0].get_legend_handles_labels()[1]
    caption = np.asarray(Image.open(out / "policy.gif").convert("L"))[:16]
    assert caption.min() < 100  # dark caption text above the white frames


def without_timing(path: Path) -> list[dict]:
    timing = {"wall_seconds", "sps"}
    rows = csv.DictReader(path.open())
    return [{name: value for name, value in row.items() if name not in timing} for row in rows]


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
    """The checkpoint brings its board, network and seeds; no flags needed."""
    out, _ = finished_run
    result = run(
        "--eval-only",
        "--load-model",
        str(out / "model.msgpack"),
        "--eval-episodes",
        "2",
        "--output-dir",
        str(tmp_path),
    )
    assert result.returncode == 0, result.stderr
    saved = json.loads((out / "summary.json").read_text())
    evaluated = json.loads((tmp_path / "summary.json").read_text())
    for name in ["final_returns", "final_score", "final_win", "final_episode_length"]:
        assert evaluated[name] == saved[name], name
    assert (tmp_path / "policy.gif").stat().st_size > 0
    assert not (tmp_path / "model.msgpack").exists()


@pytest.mark.parametrize(
    "flags, name",
    [
        (["--hidden-size", "8"], "--hidden-size"),
        (["--network", "transformer"], "--network"),
        (["--env.grid-size", "8"], "--env.grid-size"),
        (["--env.no-egocentric"], "--env.egocentric"),  # 4 moves, not the model's 3
    ],
)
def test_eval_only_refuses_flags_the_checkpoint_overrides(finished_run, flags, name):
    out, _ = finished_run
    result = run("--eval-only", "--load-model", str(out / "model.msgpack"), *flags)
    assert result.returncode == 2 and name in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


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
    one = list(csv.DictReader((out / "metrics.csv").open()))
    two = list(csv.DictReader((tmp_path / "metrics.csv").open()))
    for name in ppo.METRIC_COLUMNS:
        np.testing.assert_allclose(
            [float(row[name]) for row in two],
            [float(row[name]) for row in one],
            rtol=1e-4,
            atol=1e-5,
            err_msg=name,
        )


def test_non_finite_loss_stops_with_chunk_seed_and_metric(tmp_path):
    result = run(
        *TINY_FLAGS,
        "--learning-rate",
        "inf",
        "--output-dir",
        str(tmp_path),
        "--no-plot",
        "--no-capture-gif",
    )
    assert result.returncode == 1
    assert "non-finite" in result.stderr and "chunk 1, seed 1" in result.stderr, result.stderr
    assert len(list(csv.DictReader((tmp_path / "metrics.csv").open()))) == 1  # still valid


# ---- learning ----


@pytest.mark.slow
def test_short_run_learns_to_eat():
    """Four seeds, 196,608 env steps each on a 6x6 board (35 food fill it) with a small CNN,
    gamma 0.995 and the default egocentric view, move mask and shield. Uniformly random moves eat
    about 0.15 food per episode; near-uniform play over the moves the mask leaves dies only boxed
    in and eats far more. The bars: every seed below 8 in the first chunk (it starts near random
    play), then a greedy score over 100 episodes of at least 10 on every seed and 14 on the median
    one. Measured for them (2-core AMD EPYC CPU, jax 0.10.2, seeds 1-12 in groups of 4): 4.2-6.0
    in the first chunk; greedy 16.5-32.3, median 25.2 (15.9-32.2 without the shield). At 163,840
    steps and 20 episodes (this test's earlier setting) one seed scored 9.85 on this machine and
    17.2-22.7 on another: greedy play this early varies from game to game and between processors
    (XLA's CPU code, and so each trajectory, differs), so the test trains longer and plays 100
    games. The 10x10 default's gamma 0.999, a horizon for 1,000-step games, learns more slowly
    in so short a run (docs/log/ppo_snake.md)."""
    config = dataclasses.replace(
        ppo.Config(),
        num_seeds=4,
        env=ppo.EnvConfig(grid_size=6),
        conv_channels=(8, 16),
        hidden_size=64,
        num_envs=32,
        num_steps=64,
        num_minibatches=8,
        update_epochs=2,
        total_timesteps=196_608,
        log_every=16_384,
        gamma=0.995,
    )
    keys = ppo.seed_keys(config)
    _, _, train = ppo.make_train(config)
    state, metrics = jax.jit(jax.vmap(train), compiler_options=XLA_DEFAULT)(keys["train"])
    evaluate = jax.jit(
        jax.vmap(ppo.make_evaluate(config, num_episodes=100)), compiler_options=XLA_DEFAULT
    )
    scores = np.asarray(
        evaluate(ppo.trained_params(config, state), keys["evaluate"])["score"]
    ).mean(axis=1)
    first_chunk = np.asarray(metrics.score[:, 0])
    assert np.all(first_chunk < 8.0), first_chunk
    assert np.all(scores >= 10.0) and np.median(scores) >= 14.0, scores
