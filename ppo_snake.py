"""PPO on Snake with a convolutional policy (or a transformer over the cells), fully on device:
ppo_cartpole.py's loop with a board-sized network, as CleanRL's ppo_atari.py is ppo.py's sibling
(Schulman et al. 2017; GAE, Schulman et al. 2016; the details of Huang et al. 2022). Docs: docs/ppo.md

    python ppo_snake.py                          # 10x10 board: train, evaluate, write runs/ppo_snake__0__<time>/
    python ppo_snake.py --env.grid-size 6        # any board from 6x6 to 20x20
    python ppo_snake.py --network transformer    # a small transformer over the cells instead of the CNN
    python ppo_snake.py --eval-only --load-model runs/<run>/model.msgpack
"""

import contextlib
import csv
import dataclasses
import io
import json
import math
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, Literal, NamedTuple

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from flax import serialization, struct
from jax import flatten_util
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import envs

SCRIPT = "ppo_snake"
ENV_ID = "Snake"
GRID_SIZES = range(6, 21)  # the boards --env.grid-size accepts
LOSS_NAMES = ("value_loss", "policy_loss", "entropy", "approx_kl", "clip_frac")
METRIC_NAMES = ("episode_return", "episode_length", "score", "win_rate", *LOSS_NAMES)
CSV_COLUMNS = ("seed", "env_steps", "updates", "wall_seconds", "sps", *METRIC_NAMES)

# ---- config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class EnvConfig:
    """Snake's board and hunger limit (envs.SnakeParams)."""

    grid_size: int = 10
    """side of the square board in cells, 6 to 20"""
    max_steps_without_food: int | None = None
    """steps without food before a truncation; None: grid_size**2, enough to sweep the whole board"""


@dataclass(frozen=True)
class Config:
    seed: int = 0
    """seed of the first run; seed i of --num-seeds uses seed + i"""
    num_seeds: int = 1
    """independent runs trained at once in one vmapped program"""
    total_timesteps: int = 2_621_440
    """env steps per seed, all envs together (rounded down to whole chunks)"""
    learning_rate: float = 2e-3
    """Adam step size"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over training"""
    num_envs: int = 64
    """parallel envs per seed"""
    num_steps: int = 128
    """steps per env per rollout: one PPO iteration uses num_envs * num_steps env steps"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 32
    """minibatches per epoch; must divide num_envs * num_steps"""
    update_epochs: int = 2
    """passes over each rollout"""
    norm_adv: bool = True
    """normalise the advantages within each minibatch"""
    clip_coef: float = 0.2
    """clip range of the probability ratio (and of the value change with --clip-vloss)"""
    clip_vloss: bool = False
    """clip the value loss around the rollout's value estimates"""
    ent_coef: float = 0.01
    """weight of the entropy bonus"""
    vf_coef: float = 0.5
    """weight of the value loss"""
    max_grad_norm: float = 0.5
    """clip the gradient to this global norm (optax.clip_by_global_norm)"""
    food_shaping: float = 1.0
    """weight of a potential-based reward for moving towards the food (0: off); see food_potential"""
    network: Literal["conv", "transformer"] = "conv"
    """trunk under the policy and value heads: a small CNN over the board, or a transformer over its cells"""
    conv_channels: tuple[int, ...] = (16, 32)
    """channels of the conv trunk's 3x3 convolutions, one number per layer"""
    hidden_size: int = 128
    """width of the dense ReLU layer on top of either trunk"""
    eval_episodes: int = 32
    """greedy-policy episodes per seed in the final evaluation (a good snake's scores vary widely)"""
    log_every: int = 65_536
    """env steps per chunk (whole iterations): one progress line and one metrics row per seed"""
    output_dir: str | None = None
    """where outputs go; None: runs/ppo_snake__<seed>__<unix time>"""
    save_model: bool = True
    """write model.msgpack (every seed's parameters and this config)"""
    capture_gif: bool = True
    """write policy.gif (the first seed's greedy policy on four boards side by side)"""
    plot: bool = True
    """write curves.png (score, return, length, wins and losses against env steps)"""
    load_model: str | None = None
    """model.msgpack to evaluate with --eval-only"""
    eval_only: bool = False
    """evaluate (and render) the --load-model checkpoint instead of training, with the checkpoint's own config
    (board, network, seeds): only --eval-episodes, --output-dir and --capture-gif apply"""
    env: EnvConfig = EnvConfig()
    """Snake's board"""


class UsageError(Exception):
    """A user error: reported as one line, exit status 2, no traceback."""


def parse_config(args: Sequence[str] | None = None) -> Config:
    """tyro.cli, with tyro's boxed parse errors reduced to one line (exit status 2)."""
    captured = io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(Config, args=args, description=__doc__.splitlines()[0])
    except SystemExit as exit_:
        if (
            exit_.code
        ):  # not --help: the message under the box's title, wrapped lines joined, up to a rule
            texts = [line.strip().strip("│|").strip() for line in captured.getvalue().splitlines()]
            message = []  # a box in UTF-8, or ASCII rules without one: title, rule(s), message, rule
            for text in texts[1:]:
                if text.strip("─-+╭╮╰╯ "):
                    message.append(text)
                elif message:
                    break
            hints = [
                texts[i + 1] for i, text in enumerate(texts[:-1]) if text == "Perhaps you meant:"
            ]  # a typo
            hint = f"; perhaps you meant {hints[0]}" if hints else ""
            print(
                f"{SCRIPT}.py: error: {' '.join(message) or 'bad arguments'}{hint} (see --help)",
                file=sys.stderr,
            )
        raise


class Sizes(NamedTuple):  # the counts that follow from the config
    batch_size: int  # env steps per PPO iteration, all envs
    updates_per_iteration: int  # gradient steps
    iterations_per_chunk: int
    num_chunks: int
    num_iterations: int
    chunk_steps: int  # env steps per chunk
    env_steps: int  # env steps per seed: total_timesteps rounded down to whole chunks


def sizes(config: Config) -> Sizes:
    batch_size = config.num_envs * config.num_steps
    iterations_per_chunk = max(1, config.log_every // batch_size)
    num_chunks = config.total_timesteps // (iterations_per_chunk * batch_size)
    return Sizes(
        batch_size,
        config.update_epochs * config.num_minibatches,
        iterations_per_chunk,
        num_chunks,
        num_chunks * iterations_per_chunk,
        iterations_per_chunk * batch_size,
        num_chunks * iterations_per_chunk * batch_size,
    )


def validate(config: Config) -> None:
    """Raise UsageError naming the first bad flag and its allowed range; compiles nothing."""
    hunger_limit = config.env.max_steps_without_food
    rules = [
        (
            ">= 1",
            lambda value: value >= 1,
            [
                "num_seeds",
                "total_timesteps",
                "num_envs",
                "num_steps",
                "log_every",
                "num_minibatches",
                "update_epochs",
                "hidden_size",
                "eval_episodes",
            ],
        ),
        ("> 0", lambda value: value > 0, ["learning_rate", "clip_coef", "max_grad_norm"]),
        (">= 0", lambda value: value >= 0, ["ent_coef", "vf_coef", "food_shaping"]),
        ("in (0, 1]", lambda value: 0 < value <= 1, ["gamma"]),
        ("in [0, 1]", lambda value: 0 <= value <= 1, ["gae_lambda"]),
        (
            "in [0, 2**31 - num_seeds)",
            lambda value: 0 <= value < 2**31 - config.num_seeds,
            ["seed"],
        ),
        (
            "one or more counts >= 1",
            lambda value: len(value) > 0 and min(value) >= 1,
            ["conv_channels"],
        ),
    ]
    for allowed, holds, names in rules:
        for name in names:
            if not holds(getattr(config, name)):
                raise UsageError(
                    f"--{name.replace('_', '-')} must be {allowed}, got {getattr(config, name)}"
                )
    if config.env.grid_size not in GRID_SIZES:
        raise UsageError(
            f"--env.grid-size must be in [{GRID_SIZES[0]}, {GRID_SIZES[-1]}], got {config.env.grid_size}"
        )
    if hunger_limit is not None and hunger_limit < 1:
        raise UsageError(f"--env.max-steps-without-food must be >= 1 (or None), got {hunger_limit}")
    size = sizes(config)
    if size.batch_size % config.num_minibatches:
        raise UsageError(
            f"--num-minibatches must divide --num-envs * --num-steps = {size.batch_size}, "
            f"got {config.num_minibatches}"
        )
    if size.num_chunks < 1 and not config.eval_only:
        raise UsageError(
            f"--total-timesteps must be at least one chunk, {size.chunk_steps} env steps (--log-every "
            f"in whole iterations of {size.batch_size}), got {config.total_timesteps}"
        )
    if config.eval_only != (config.load_model is not None):
        raise UsageError("--eval-only and --load-model PATH go together (evaluate a checkpoint)")
    if config.num_seeds % jax.device_count():
        raise UsageError(
            f"--num-seeds must be a multiple of the {jax.device_count()} visible devices, "
            f"over which the seeds are sharded; got {config.num_seeds}"
        )


# ---- networks -------------------------------------------------------------------------------


def reverse_move_mask(obs: chex.Array) -> chex.Array:
    """bool[..., 4]: True for the move back into the neck, which envs.Snake turns into "keep going"
    (for a snake longer than one): masked, the policy picks among three distinct moves. The neck
    is the head's neighbour of highest body recency (channel 1: head 1, neck (length - 1) / length)."""
    head, recency = obs[..., 0], obs[..., 1]
    size = obs.shape[-2]
    padded = jnp.pad(recency, [(0, 0)] * (recency.ndim - 2) + [(1, 1), (1, 1)])
    neighbour_recency = jnp.stack(
        [  # the recency of the cell each move enters, read at the head
            (head * padded[..., 1 + row : 1 + row + size, 1 + col : 1 + col + size]).sum((-2, -1))
            for row, col in np.asarray(envs.SNAKE_MOVES)
        ],
        axis=-1,
    )
    return (neighbour_recency == neighbour_recency.max(-1, keepdims=True)) & (neighbour_recency > 0)


def orthogonal(gain: float) -> Callable:
    """A Dense kernel initialiser: gain x a random orthogonal matrix, as flax's orthogonal (Huang et
    al. 2022, detail 2), but the polar factor G (G^T G)^-1/2 of a Gaussian G by Newton-Schulz steps
    instead of a QR: batched LAPACK QR, as vmap(init) over seeds makes it, can deadlock on CPU
    (docs/ppo.md). Same distribution: uniform over the orthogonal matrices."""

    def init(key: chex.PRNGKey, shape: Sequence[int], dtype: Any = jnp.float32) -> chex.Array:
        gaussian = jax.random.normal(key, shape, dtype)
        x = gaussian / jnp.linalg.norm(gaussian)  # singular values in (0, 1]
        # A step maps each singular value s to s (3 - s^2) / 2: towards 1, x 1.5 while small.
        return gain * jax.lax.fori_loop(0, 60, lambda _, x: 1.5 * x - 0.5 * x @ (x.T @ x), x)

    return init


def patches_3x3(x: chex.Array) -> chex.Array:
    """[..., rows, cols, 9 * channels]: each cell's 3x3 neighbourhood, zeros beyond the board; a
    dense layer on it is a 3x3 'same' convolution."""
    rows, cols = x.shape[-3:-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(1, 1), (1, 1), (0, 0)])
    return jnp.concatenate(
        [padded[..., i : i + rows, j : j + cols, :] for i in range(3) for j in range(3)], axis=-1
    )


class ConvTrunk(nn.Module):
    """3x3 'same' convolutions with ReLU, flattened into a dense ReLU layer (the shape of Mnih et
    al. 2015's Atari network, sized for a small board; the dense layer knows where each cell is).
    Each convolution is a dense layer on 3x3 patches: nn.Conv's function, but a batched matrix
    product under vmap over seeds, where nn.Conv becomes a grouped convolution whose gradient XLA's
    CPU backend computes 3.3x slower (2 seeds, 2 cores: 576 against 176 ms per seed and 2,048
    samples). For one seed alone nn.Conv would be faster (docs/ppo.md)."""

    channels: Sequence[int]
    hidden_size: int

    @nn.compact
    def __call__(self, board: chex.Array) -> chex.Array:
        x = board
        for channels in self.channels:
            x = nn.relu(nn.Dense(channels, kernel_init=orthogonal(math.sqrt(2)))(patches_3x3(x)))
        x = x.reshape(*x.shape[:-3], -1)
        return nn.relu(nn.Dense(self.hidden_size, kernel_init=orthogonal(math.sqrt(2)))(x))


class TransformerTrunk(nn.Module):
    """The cells as tokens: a linear embedding plus a learned position embedding, pre-norm
    self-attention blocks (Vaswani et al. 2017, the layer norms first as in Xiong et al. 2020),
    then the head's token into a dense ReLU layer: the head's view of the board, where a mean over
    the cells would bury the few that matter among the empty ones."""

    hidden_size: int
    embed_dim: int = 32
    num_blocks: int = 2
    num_heads: int = 2

    @nn.compact
    def __call__(self, board: chex.Array) -> chex.Array:
        tokens = board.reshape(*board.shape[:-3], -1, board.shape[-1])  # [..., cells, channels]
        position = self.param(
            "position", nn.initializers.normal(0.02), (tokens.shape[-2], self.embed_dim)
        )
        x = nn.Dense(self.embed_dim)(tokens) + position
        for _ in range(self.num_blocks):
            x = x + nn.MultiHeadDotProductAttention(self.num_heads)(nn.LayerNorm()(x))
            x = x + nn.Dense(self.embed_dim)(
                nn.gelu(nn.Dense(4 * self.embed_dim)(nn.LayerNorm()(x)))
            )
        head_token = jnp.einsum(
            "...t,...te->...e", tokens[..., 0], nn.LayerNorm()(x)
        )  # channel 0: the head
        return nn.relu(nn.Dense(self.hidden_size, kernel_init=orthogonal(math.sqrt(2)))(head_token))


class ActorCritic(nn.Module):
    """Policy logits and value on one shared trunk, as ppo_atari.py: the features that find the
    food and the walls serve both heads, and one trunk costs half of two."""

    trunk: nn.Module
    num_actions: int

    @nn.compact
    def __call__(self, obs: chex.Array) -> tuple[chex.Array, chex.Array]:
        # A channel of ones marks the board, so that the zero padding beyond it reads as wall.
        features = self.trunk(jnp.concatenate([obs, jnp.ones_like(obs[..., :1])], axis=-1))
        # Head gains 0.01 (a near-uniform first policy) and 1 (Huang et al. 2022, detail 2).
        logits = nn.Dense(self.num_actions, kernel_init=orthogonal(0.01))(features)
        logits = jnp.where(
            reverse_move_mask(obs), -1e9, logits
        )  # finite: 0 * log-prob stays 0 in the entropy
        return logits, nn.Dense(1, kernel_init=orthogonal(1.0))(features)[..., 0]


def make_network(config: Config, num_actions: int) -> ActorCritic:
    if config.network == "conv":
        return ActorCritic(ConvTrunk(tuple(config.conv_channels), config.hidden_size), num_actions)
    return ActorCritic(TransformerTrunk(config.hidden_size), num_actions)


def categorical_log_prob(logits: chex.Array, action: chex.Array) -> chex.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)[..., 0]


# ---- train state and losses -----------------------------------------------------------------


@struct.dataclass
class TrainState:
    params: dict  # the ActorCritic's
    opt_state: optax.OptState
    env_state: envs.EpisodeStatsState  # batched over num_envs
    obs: chex.Array  # [num_envs, grid, grid, 3], what each env shows now
    key: chex.PRNGKey


@struct.dataclass
class Transition:  # one rollout step of every env; [num_steps, num_envs, ...] after the scan
    obs: chex.Array
    action: chex.Array
    log_prob: chex.Array
    value: chex.Array  # the critic's, from the same forward pass as the action (one shared trunk)
    reward: chex.Array
    terminated: chex.Array
    truncated: chex.Array
    won: chex.Array  # the snake filled the board (a termination)
    final_obs: chex.Array  # the observation the step reached, before any auto-reset
    episode_done: chex.Array
    episode_return: chex.Array  # of the episode that ended at this step, 0 elsewhere
    episode_length: chex.Array


@struct.dataclass
class Batch:  # what the PPO update needs of each sample; leading axis: samples
    obs: chex.Array
    action: chex.Array
    log_prob: chex.Array
    value: chex.Array
    advantage: chex.Array
    target: chex.Array  # the lambda-return: advantage + value


def compute_gae(rewards, values, next_values, terminated, truncated, gamma, gae_lambda):
    """GAE(lambda) over [num_steps, num_envs] arrays by a reverse scan (Schulman et al. 2016).

    next_values[t] is the value of the state step t reached: the next observation's, or at an
    episode end the final observation's (before the auto-reset). A termination bootstraps
    nothing; a truncation (here the hunger limit) bootstraps next_values[t], as the state is not
    terminal. Either end stops the advantage from flowing back across the episode boundary.
    Returns (advantages, targets = advantages + values)."""
    chex.assert_equal_shape([rewards, values, next_values, terminated, truncated])
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values
    continues = 1.0 - jnp.logical_or(terminated, truncated)

    def backward(next_advantage, delta_and_continues):
        delta, continuing = delta_and_continues
        advantage = delta + gamma * gae_lambda * continuing * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(values[0]), (deltas, continues), reverse=True
    )
    return advantages, advantages + values


def food_potential(obs: chex.Array) -> chex.Array:
    """-(Manhattan distance from the head to the food) / grid size, per observation. Learning on
    reward + c * (gamma * potential(s') - potential(s)), with potential 0 at a termination, rewards
    each step towards the food and leaves the optimal policy as it was (Ng et al. 1999)."""
    size = obs.shape[-2]
    lines = jnp.arange(size, dtype=jnp.float32)
    rows = jnp.einsum(
        "...ijc,i->...c", obs, lines
    )  # the row of each one-hot channel (0 head, 2 food)
    cols = jnp.einsum("...ijc,j->...c", obs, lines)
    return -(jnp.abs(rows[..., 0] - rows[..., 2]) + jnp.abs(cols[..., 0] - cols[..., 2])) / size


def policy_loss(log_prob, old_log_prob, advantages, clip_coef):
    """PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), negated for descent.
    Returns (loss, approx_kl, clip_frac); approx_kl is the (ratio - 1) - log ratio estimator."""
    chex.assert_equal_shape([log_prob, old_log_prob, advantages])
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    loss = jnp.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    return loss, ((ratio - 1.0) - log_ratio).mean(), (jnp.abs(ratio - 1.0) > clip_coef).mean()


def value_loss(values, old_values, targets, clip_coef, clip_vloss: bool):
    """Half the mean squared error to the lambda-returns; with clip_vloss, the larger of the plain
    and the clipped error, as PPO's reference code (Huang et al. 2022, detail 9)."""
    chex.assert_equal_shape([values, old_values, targets])
    squared_error = (values - targets) ** 2
    if clip_vloss:
        clipped_values = old_values + jnp.clip(values - old_values, -clip_coef, clip_coef)
        squared_error = jnp.maximum(squared_error, (clipped_values - targets) ** 2)
    return 0.5 * squared_error.mean()


def minibatch_indices(
    key: chex.PRNGKey, num_epochs: int, batch_size: int, num_minibatches: int
) -> chex.Array:
    """A fresh permutation of the batch per epoch, cut into minibatches: int[num_epochs,
    num_minibatches, batch_size // num_minibatches]. Each permutation sorts random 32-bit keys,
    as jax.random.permutation does, but all epochs share one random draw."""
    permutations = jnp.argsort(jax.random.bits(key, (num_epochs, batch_size)), axis=-1)
    return permutations.reshape(num_epochs, num_minibatches, batch_size // num_minibatches)


# ---- training -------------------------------------------------------------------------------


def make_env(config: Config) -> tuple[envs.Environment, envs.SnakeParams]:
    env, _ = envs.make(ENV_ID)
    grid_size, hunger_limit = config.env.grid_size, config.env.max_steps_without_food
    return env, envs.SnakeParams(grid_size, grid_size**2 if hunger_limit is None else hunger_limit)


def make_train(config: Config) -> tuple[Callable, Callable, Callable]:
    """Static work once; returns pure init(key) -> state, run_chunk(state) -> (state, metrics)
    and train(key) -> (state, metrics with a leading chunk axis)."""
    size = sizes(config)
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    obs_shape = env.observation_space(env_params).shape
    network = make_network(config, env.num_actions)
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def learning_rate(
        count: chex.Array,
    ) -> chex.Array:  # linear to 0, constant within an iteration (CleanRL)
        fraction_left = 1.0 - (count // size.updates_per_iteration) / size.num_iterations
        return config.learning_rate * (fraction_left if config.anneal_lr else 1.0)

    # On one flat vector of all parameters (optax.flatten): the same maths, in a few fused
    # kernels rather than a few per parameter array, which keeps the compile time down.
    optimizer = optax.flatten(
        optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adam(
                learning_rate, eps=1e-5
            ),  # eps of PPO's reference code (Huang et al. 2022, detail 3)
        )
    )

    def init(key: chex.PRNGKey) -> TrainState:
        key_params, key_envs, key = jax.random.split(key, 3)
        params = network.init(key_params, jnp.zeros(obs_shape))
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(key_envs, config.num_envs), env_params
        )
        return TrainState(params, optimizer.init(params), env_state, obs, key)

    def rollout(state: TrainState, key_actions: chex.PRNGKey, key_envs: chex.PRNGKey):
        # All the rollout's randomness in two draws before the scan: Gumbel noise to sample the
        # actions (argmax(logits + Gumbel) ~ softmax(logits)) and one key per env step.
        gumbel = jax.random.gumbel(
            key_actions, (config.num_steps, config.num_envs, env.num_actions)
        )
        env_keys = jax.random.split(key_envs, (config.num_steps, config.num_envs))

        def env_step(carry, noise_and_keys):
            env_state, obs = carry
            noise, keys = noise_and_keys
            logits, value = network.apply(state.params, obs)
            action = jnp.argmax(logits + noise, axis=-1)
            next_obs, env_state, reward, terminated, truncated, info = step_envs(
                keys, env_state, action, env_params
            )
            transition = Transition(
                obs,
                action,
                categorical_log_prob(logits, action),
                value,
                reward,
                terminated,
                truncated,
                info["won"],
                info["final_observation"],
                info["returned_episode"],
                info["episode_return"],
                info["episode_length"],
            )
            return (env_state, next_obs), transition

        (env_state, obs), transitions = jax.lax.scan(
            env_step, (state.env_state, state.obs), (gumbel, env_keys)
        )
        return state.replace(env_state=env_state, obs=obs), transitions

    def loss_fn(params: dict, minibatch: Batch) -> tuple[chex.Array, dict]:
        logits, values = network.apply(params, minibatch.obs)
        log_probs = jax.nn.log_softmax(logits)
        entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
        advantages = minibatch.advantage
        if config.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        pg_loss, approx_kl, clip_frac = policy_loss(
            categorical_log_prob(logits, minibatch.action),
            minibatch.log_prob,
            advantages,
            config.clip_coef,
        )
        v_loss = value_loss(
            values, minibatch.value, minibatch.target, config.clip_coef, config.clip_vloss
        )
        loss = pg_loss - config.ent_coef * entropy + config.vf_coef * v_loss
        return loss, dict(
            zip(LOSS_NAMES, (v_loss, pg_loss, entropy, approx_kl, clip_frac), strict=True)
        )

    def update_minibatch(carry, minibatch: Batch):
        params, opt_state = carry
        grads, losses = jax.grad(loss_fn, has_aux=True)(params, minibatch)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return (optax.apply_updates(params, updates), opt_state), losses

    def update_epoch(batch: Batch, carry, indices: chex.Array):
        return jax.lax.scan(update_minibatch, carry, jax.tree.map(lambda x: x[indices], batch))

    def run_iteration(state: TrainState, _) -> tuple[TrainState, dict]:
        # One rollout, GAE, then update_epochs x num_minibatches steps. One key split per
        # iteration: on CPU every random-draw site is costly code to compile.
        key, key_actions, key_envs, key_minibatches = jax.random.split(state.key, 4)
        state, transitions = rollout(state, key_actions, key_envs)
        chex.assert_shape(transitions.reward, (config.num_steps, config.num_envs))
        _, next_values = network.apply(state.params, transitions.final_obs)
        shaping = (
            config.gamma * food_potential(transitions.final_obs) * (1.0 - transitions.terminated)
        )
        rewards = transitions.reward + config.food_shaping * (
            shaping - food_potential(transitions.obs)
        )
        advantages, targets = compute_gae(
            rewards,
            transitions.value,
            next_values,
            transitions.terminated,
            transitions.truncated,
            config.gamma,
            config.gae_lambda,
        )
        batch = Batch(
            transitions.obs,
            transitions.action,
            transitions.log_prob,
            transitions.value,
            advantages,
            targets,
        )
        batch = jax.tree.map(lambda x: x.reshape(size.batch_size, *x.shape[2:]), batch)
        indices = minibatch_indices(
            key_minibatches, config.update_epochs, size.batch_size, config.num_minibatches
        )
        (params, opt_state), losses = jax.lax.scan(
            partial(update_epoch, batch), (state.params, state.opt_state), indices
        )
        done = transitions.episode_done
        # The score is the food eaten: the return counts +1 per food and -1 for a death (an end that is no win).
        score = transitions.episode_return + (transitions.terminated & ~transitions.won)
        stats = {name: loss.mean() for name, loss in losses.items()}
        stats |= dict(
            episodes=done.sum(),
            return_sum=jnp.where(done, transitions.episode_return, 0.0).sum(),
            length_sum=jnp.where(done, transitions.episode_length, 0).sum(),
            score_sum=jnp.where(done, score, 0.0).sum(),
            wins=transitions.won.sum(),
        )
        return state.replace(params=params, opt_state=opt_state, key=key), stats

    def run_chunk(state: TrainState) -> tuple[TrainState, dict]:
        state, stats = jax.lax.scan(run_iteration, state, None, length=size.iterations_per_chunk)
        episodes = stats["episodes"].sum()
        per_episode = 1.0 / jnp.where(episodes > 0, episodes, jnp.nan)  # NaN when no episode ended
        metrics = {name: stats[name].mean() for name in LOSS_NAMES}
        metrics |= dict(
            episode_return=stats["return_sum"].sum() * per_episode,
            episode_length=stats["length_sum"].sum() * per_episode,
            score=stats["score_sum"].sum() * per_episode,
            win_rate=stats["wins"].sum() * per_episode,
            params_finite=jnp.isfinite(flatten_util.ravel_pytree(state.params)[0]).all(),
        )
        return state, metrics

    def train(key: chex.PRNGKey) -> tuple[TrainState, dict]:
        return jax.lax.scan(
            lambda state, _: run_chunk(state), init(key), None, length=size.num_chunks
        )

    return init, run_chunk, train


# ---- evaluation, checkpoint, plots, GIF -----------------------------------------------------


def make_evaluate(config: Config) -> Callable:
    """evaluate(params, key) -> {episode_return, score, episode_length, won}, each [eval_episodes],
    of the greedy policy. An episode plays to its end in a while loop, without auto-reset: a good
    snake lives long, but the hunger limit ends every episode."""
    env, env_params = make_env(config)
    network = make_network(config, env.num_actions)

    def episode(params: dict, key: chex.PRNGKey) -> dict:
        key_reset, key_steps = jax.random.split(key)

        def step(carry):
            obs, env_state, _, _ = carry
            action = jnp.argmax(network.apply(params, obs)[0])
            step_key = jax.random.fold_in(key_steps, env_state.time)
            obs, env_state, _, terminated, _ = env.step_env(step_key, env_state, action, env_params)
            return obs, env_state, terminated, env.is_truncated(env_state, env_params)

        carry = (*env.reset(key_reset, env_params), jnp.bool_(False), jnp.bool_(False))
        _, final, terminated, _ = jax.lax.while_loop(
            lambda carry: ~(carry[2] | carry[3]), step, carry
        )
        score, won = final.length - 1, final.length == config.env.grid_size**2
        return dict(
            episode_return=(score - (terminated & ~won)).astype(jnp.float32),
            score=score,
            episode_length=final.time,
            won=won,
        )

    def evaluate(params: dict, key: chex.PRNGKey) -> dict:
        return jax.vmap(episode, in_axes=(None, 0))(
            params, jax.random.split(key, config.eval_episodes)
        )

    return evaluate


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """write(temporary path), then a rename: a reader never sees a half-written file."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    os.replace(temporary, path)


def write_csv(path: Path, rows: list[dict]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=CSV_COLUMNS)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, lambda temporary: temporary.write_text(text.getvalue()))


def save_checkpoint(path: Path, config: Config, params: dict) -> None:
    """Every seed's parameters (leading seed axis), with the config, script and env id."""
    payload = {
        "script": SCRIPT,
        "env_id": ENV_ID,
        "config": json.dumps(dataclasses.asdict(config)),
        "params": jax.device_get(params),
    }
    write_atomic(
        path, lambda temporary: temporary.write_bytes(serialization.msgpack_serialize(payload))
    )


def load_checkpoint(config: Config) -> tuple[Config, dict]:
    """(the checkpoint's config with this run's evaluation and output flags, every seed's
    params); UsageError for a file that is not a checkpoint of this script and env."""
    try:
        payload = serialization.msgpack_restore(Path(config.load_model).read_bytes())
        script, env_id = payload["script"], payload["env_id"]
        if (script, env_id) == (SCRIPT, ENV_ID):
            saved = json.loads(payload["config"])
            saved = Config(
                **{
                    **saved,
                    "env": EnvConfig(**saved["env"]),
                    "conv_channels": tuple(saved["conv_channels"]),
                }
            )
    except Exception as error:  # any unreadable file is the same user error
        raise UsageError(
            f"--load-model {config.load_model} is not a readable model.msgpack ({error})"
        ) from None
    if (script, env_id) != (SCRIPT, ENV_ID):
        raise UsageError(
            f"--load-model {config.load_model} is a {script} checkpoint for {env_id}; "
            f"this script evaluates {SCRIPT} on {ENV_ID}"
        )
    config = dataclasses.replace(
        saved,
        eval_episodes=config.eval_episodes,
        output_dir=config.output_dir,
        capture_gif=config.capture_gif,
        load_model=config.load_model,
        eval_only=True,
    )
    validate(config)  # e.g. its seeds on the devices visible now
    return config, payload["params"]


def plot_curves(path: Path, rows: list[dict], grid_size: int) -> None:
    """Score, return, length, win rate and losses against env steps: the mean over seeds and the
    min-max band."""
    from matplotlib.figure import (
        Figure,
    )  # imported here: only this output needs it, and it is slow to import

    seeds = sorted({row["seed"] for row in rows})
    steps = [row["env_steps"] for row in rows if row["seed"] == seeds[0]]
    fig = Figure(figsize=(13, 10), layout="tight")
    axes = fig.subplots(3, 3)
    for ax, name in zip(
        axes.flat,
        ["score", "episode_return", "episode_length", "win_rate", *LOSS_NAMES],
        strict=True,
    ):
        values = np.array(
            [[row[name] for row in rows if row["seed"] == seed] for seed in seeds], float
        )
        ax.plot(steps, np.nanmean(values, axis=0))
        ax.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), alpha=0.25)
        ax.set(title=name, xlabel="env steps")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    fig.suptitle(f"PPO on {ENV_ID} {grid_size}x{grid_size}, {len(seeds)} seed(s)")
    write_atomic(path, lambda temporary: fig.savefig(temporary, format="png", dpi=90))


def write_gif(
    path: Path,
    config: Config,
    params: dict,
    key: chex.PRNGKey,
    num_boards: int = 4,
    num_frames: int = 200,
) -> None:
    """The greedy policy on `num_boards` boards side by side for `num_frames` steps, drawn by the
    env's own renderer; a board whose game ends starts a new one. Unlike CartPole's, the GIF
    replays no evaluation episode: a good snake's episodes are too long to keep every state."""
    from PIL import Image  # matplotlib's dependency

    env, env_params = make_env(config)
    network = make_network(config, env.num_actions)
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    cell_pixels = max(4, 120 // config.env.grid_size)  # about 120 pixels a board, whatever its size

    def frame(carry, frame_key):
        obs, env_state = carry
        boards = jax.vmap(lambda state: env.render(state, env_params, cell_pixels=cell_pixels))(
            env_state
        )
        gap = jnp.full((boards.shape[1], cell_pixels, 3), 255, jnp.uint8)
        image = jnp.concatenate([part for board in boards for part in (board, gap)][:-1], axis=1)
        action = jnp.argmax(network.apply(params, obs)[0], axis=-1)
        obs, env_state, *_ = step_envs(
            jax.random.split(frame_key, num_boards), env_state, action, env_params
        )
        return (obs, env_state), image

    @jax.jit
    def frames(key: chex.PRNGKey) -> chex.Array:
        key_reset, key_frames = jax.random.split(key)
        carry = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(key_reset, num_boards), env_params
        )
        return jax.lax.scan(frame, carry, jax.random.split(key_frames, num_frames))[1]

    images = [Image.fromarray(image) for image in np.asarray(frames(key))]
    write_atomic(
        path,
        lambda temporary: images[0].save(
            temporary, format="GIF", save_all=True, loop=0, append_images=images[1:], duration=100
        ),
    )


# ---- main -----------------------------------------------------------------------------------


def seed_keys(config: Config) -> chex.PRNGKey:
    """One key per seed: seed i of a vmapped run is the same run as --seed seed+i alone."""
    return jax.vmap(jax.random.key)(config.seed + jnp.arange(config.num_seeds))


def train_with_progress(
    config: Config, sharding: NamedSharding, out: Path
) -> tuple[dict, dict, list[dict]]:
    """The CLI's training: the jitted, vmapped run_chunk called once per chunk with the state
    donated; in between, one progress line and the metrics rows. Ctrl-C stops it after the
    chunk. Returns (every seed's params, summary, metrics rows); exits on a non-finite value."""
    size = sizes(config)
    init, run_chunk, _ = make_train(config)
    start = time.perf_counter()
    state = jax.jit(jax.vmap(init), out_shardings=sharding)(
        jax.device_put(seed_keys(config), sharding)
    )
    run_chunk = (
        jax.jit(jax.vmap(run_chunk), out_shardings=sharding, donate_argnums=0)
        .lower(state)
        .compile()
    )
    compile_seconds = time.perf_counter() - start
    print(f"compiled in {compile_seconds:.1f} s", flush=True)

    stop = threading.Event()

    def request_stop(signum, frame):
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        print("\nCtrl-C: stopping after this chunk (press again to abort)", flush=True)

    previous_handler = signal.signal(signal.SIGINT, request_stop)
    rows: list[dict] = []
    start = last = time.perf_counter()
    for chunk in range(1, size.num_chunks + 1):
        state, metrics = run_chunk(state)
        metrics = jax.device_get(
            metrics
        )  # waits for the chunk; the only transfer, a few numbers per seed
        now = time.perf_counter()
        elapsed, sps, last = now - start, size.chunk_steps / (now - last), now
        env_steps, updates = (
            chunk * size.chunk_steps,
            chunk * size.iterations_per_chunk * size.updates_per_iteration,
        )
        rows += [
            dict(
                seed=config.seed + i,
                env_steps=env_steps,
                updates=updates,
                wall_seconds=round(elapsed, 3),
                sps=round(sps),
                **{name: float(metrics[name][i]) for name in METRIC_NAMES},
            )
            for i in range(config.num_seeds)
        ]
        write_csv(out / "metrics.csv", rows)  # all rows so far: valid whenever the run stops
        scores = metrics["score"]
        spread = (
            f" ± {np.nanstd(scores):.2f} (min {np.nanmin(scores):.2f})"
            if config.num_seeds > 1
            else ""
        )
        print(
            f"steps {env_steps:,}/{size.env_steps:,} ({env_steps / size.env_steps:.0%}) | SPS {sps:,.0f} | "
            f"updates/s {size.iterations_per_chunk * size.updates_per_iteration * sps / size.chunk_steps:,.0f} | "
            f"score {np.nanmean(scores):.2f}{spread}, length {np.nanmean(metrics['episode_length']):.0f}, "
            f"wins {np.nanmean(metrics['win_rate']):.1%} | "
            + " ".join(f"{name} {np.mean(metrics[name]):.3g}" for name in LOSS_NAMES)
            + f" | {elapsed:.1f} s, ETA {elapsed / chunk * (size.num_chunks - chunk):.1f} s",
            flush=True,
        )
        finite = {name: np.isfinite(metrics[name]) for name in LOSS_NAMES} | {
            "parameter": metrics["params_finite"]
        }
        for name, ok in finite.items():
            if not ok.all():
                print(
                    f"{SCRIPT}: non-finite {name} in chunk {chunk}, seed {config.seed + int(np.argmin(ok))}; "
                    f"stopped, the files in {out} hold the chunks so far",
                    file=sys.stderr,
                )
                sys.exit(1)
        if stop.is_set():
            break
    train_seconds = time.perf_counter() - start
    signal.signal(signal.SIGINT, previous_handler)
    summary = dict(
        train_seconds=train_seconds,
        compile_seconds=compile_seconds,
        env_steps=env_steps,
        env_steps_per_second=env_steps / train_seconds,
        updates=updates,
        updates_per_second=updates / train_seconds,
        stopped_early=chunk < size.num_chunks,
    )
    return state.params, summary, rows


def main(config: Config) -> None:
    try:
        validate(config)
        if config.eval_only:
            config, params = load_checkpoint(config)
    except UsageError as error:
        print(f"{SCRIPT}.py: error: {error}", file=sys.stderr)
        sys.exit(2)

    devices = jax.devices()
    sharding = NamedSharding(
        Mesh(np.array(devices), ("seeds",)), PartitionSpec("seeds")
    )  # seed axis over devices
    device = f"{len(devices)} x {devices[0].device_kind}"
    out = Path(config.output_dir or f"runs/{SCRIPT}__{config.seed}__{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    write_atomic(
        out / "config.json",
        lambda temporary: temporary.write_text(json.dumps(dataclasses.asdict(config), indent=2)),
    )
    size, env_params = sizes(config), make_env(config)[1]
    print(
        f"{SCRIPT}: {ENV_ID} {env_params.grid_size}x{env_params.grid_size} (truncated after "
        f"{env_params.max_steps_without_food} steps without food), {config.network} network, on {device}, "
        f"{config.num_seeds} seed(s) x {config.num_envs} envs"
        + (
            " (all from the checkpoint)"
            if config.eval_only
            else f", {size.num_iterations} iterations of "
            f"{size.batch_size} steps in {size.num_chunks} chunks ({size.env_steps:,} env steps per seed)"
        )
        + f"; outputs in {out}",
        flush=True,
    )
    summary: dict[str, Any] = dict(eval_only=config.eval_only)
    if not config.eval_only:
        params, train_summary, rows = train_with_progress(config, sharding, out)
        summary |= train_summary
        if config.save_model:
            save_checkpoint(out / "model.msgpack", config, params)

    evaluate = jax.jit(jax.vmap(make_evaluate(config)))
    eval_keys = jax.vmap(lambda key: jax.random.fold_in(key, 1))(
        seed_keys(config)
    )  # a stream apart from training
    episodes = jax.device_get(
        evaluate(jax.device_put(params, sharding), jax.device_put(eval_keys, sharding))
    )
    per_seed = {
        name: values.mean(axis=1) for name, values in episodes.items()
    }  # each [num_seeds, eval_episodes]
    scores = per_seed["score"]
    print(
        f"greedy evaluation, {config.eval_episodes} episodes per seed: score {scores.mean():.2f}"
        + (f" ± {scores.std():.2f} (min {scores.min():.2f})" if config.num_seeds > 1 else "")
        + f", best game {episodes['score'].max()}, wins {episodes['won'].mean():.1%}, "
        f"length {per_seed['episode_length'].mean():.0f} steps",
        flush=True,
    )
    for name, values in [("return", per_seed["episode_return"]), ("score", scores)]:  # per seed
        summary |= {
            f"final_{name}s": values.tolist(),
            f"final_{name}_mean": float(values.mean()),
            f"final_{name}_std": float(values.std()),
        }
    summary |= dict(
        final_win_fraction=float(episodes["won"].mean()),
        num_seeds=config.num_seeds,
        final_episode_length_mean=float(per_seed["episode_length"].mean()),
        num_envs=config.num_envs,
        eval_episodes=config.eval_episodes,
        device=device,
    )
    write_atomic(
        out / "summary.json", lambda temporary: temporary.write_text(json.dumps(summary, indent=2))
    )
    if config.plot and not config.eval_only:
        plot_curves(out / "curves.png", rows, config.env.grid_size)
    if config.capture_gif:
        write_gif(
            out / "policy.gif",
            config,
            jax.device_get(jax.tree.map(lambda x: x[0], params)),
            jax.random.key(config.seed),
        )
    print(f"wrote {', '.join(sorted(path.name for path in out.iterdir()))}")


if __name__ == "__main__":
    main(parse_config())
