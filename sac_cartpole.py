"""SAC on continuous CartPole, balance and swing-up, fully on device. Docs: docs/sac.md

sac_pendulum.py's soft actor-critic (the same buffer, losses and compiled chunk loop) on
envs.CartPoleContinuous (balance) or envs.CartPoleSwingup (swing the pole up from hanging down).
Terminations (the pole past 12 degrees, the cart off the track) stop bootstrapping; the time limit does not.

    python sac_cartpole.py --num-envs 1024           # balance; writes runs/sac_cartpole__1__<time>/
    python sac_cartpole.py --env-id CartPoleSwingup  # swing-up, with its own defaults (see --help)
    python sac_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

from __future__ import annotations

import collections
import contextlib
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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from chex import Array, PRNGKey
from flax import struct
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import envs

SCRIPT = "sac_cartpole"
Params = Any  # a flax parameter tree

# ---- config ----


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """CartPole physics (envs.CartPoleParams); the defaults are gymnasium's CartPole-v1."""

    gravity: float = 9.8
    """gravity (m/s^2)"""
    masscart: float = 1.0
    """mass of the cart (kg)"""
    masspole: float = 0.1
    """mass of the pole (kg)"""
    length: float = 0.5
    """half the pole's length (m)"""
    force_mag: float = 10.0
    """force of a full action (N); the policy's actions in [-1, 1] scale it"""
    tau: float = 0.02
    """seconds per step (Euler integration)"""
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    """balance ends when |theta| exceeds this (swing-up ignores it)"""
    x_threshold: float = 2.4
    """the episode ends when |x| exceeds this (the track's half length, m)"""
    max_steps_in_episode: int = 500
    """time limit in steps (a truncation: the TD target still bootstraps there)"""


@dataclasses.dataclass(frozen=True)
class Config:
    env_id: Literal["CartPoleContinuous", "CartPoleSwingup"] = "CartPoleContinuous"
    """balance (CartPoleContinuous) or swing-up (CartPoleSwingup); each task has its own defaults"""
    seed: int = 1
    """seed of the first run; seed i of --num-seeds uses seed + i"""
    num_seeds: int = 1
    """independent runs trained at once in one vmapped program"""
    num_envs: int = 1024
    """parallel envs per seed"""
    total_timesteps: int = 4_096_000
    """env steps per seed (all envs together), warm-up included"""
    learning_rate: float = 3e-3
    """Adam step size of the actor, the critics and the temperature"""
    gamma: float = 0.99
    """discount factor"""
    tau: float = 0.2
    """Polyak step of the target critics: target <- tau * critic + (1 - tau) * target"""
    batch_size: int = 128
    """transitions per gradient update"""
    buffer_size: int = 100_000
    """replay buffer capacity in transitions (per seed)"""
    learning_starts: int = 1_000
    """env steps of uniformly random actions before the first update"""
    updates_per_step: int = 1
    """gradient updates per vectorised env step (each step adds num_envs transitions)"""
    hidden_sizes: tuple[int, ...] = (128, 128)
    """hidden layer widths of the actor and of each critic"""
    max_grad_norm: float | None = None
    """clip the actor's and critics' gradients to this global norm (optax.clip_by_global_norm)"""
    target_entropy: float | None = None
    """entropy that the temperature is tuned towards; None: -|A| (the SAC paper's choice)"""
    eval_episodes: int = 100
    """deterministic-policy episodes per seed in the final evaluation"""
    log_every: int = 204_800
    """env steps (all envs) per chunk: one progress line and one metrics row per seed"""
    output_dir: str | None = None
    """where the outputs go; None: runs/sac_cartpole__<seed>__<unix time>"""
    save_model: bool = True
    """write model.msgpack (every seed's parameters and this config)"""
    capture_gif: bool = True
    """write policy.gif (the first seed's evaluation episodes side by side)"""
    plot: bool = True
    """write curves.png (return and losses against env steps)"""
    load_model: str | None = None
    """a model.msgpack to evaluate with --eval-only"""
    eval_only: bool = False
    """evaluate (and render) the --load-model checkpoint instead of training"""
    env: EnvConfig = EnvConfig()
    """CartPole physics"""


class UsageError(Exception):
    """A user error: reported as one line, exit status 2, no traceback."""


def chunk_counts(config: Config) -> tuple[int, int]:
    """(iterations per chunk, number of chunks); an iteration steps every env once."""
    iterations_per_chunk = max(config.log_every // max(config.num_envs, 1), 1)
    return iterations_per_chunk, config.total_timesteps // (
        iterations_per_chunk * max(config.num_envs, 1)
    )


def validate(config: Config) -> None:
    """Raise UsageError naming the first bad flag and its allowed range; compiles nothing."""
    c, e, (iterations_per_chunk, num_chunks) = config, config.env, chunk_counts(config)
    chunk_steps, trained_steps = (
        iterations_per_chunk * c.num_envs,
        num_chunks * iterations_per_chunk * c.num_envs,
    )
    rules = (
        [
            (name, getattr(c, name) >= 1, ">= 1")
            for name in [
                "num_seeds",
                "num_envs",
                "total_timesteps",
                "batch_size",
                "buffer_size",
                "updates_per_step",
                "eval_episodes",
                "log_every",
            ]
        ]
        + [
            (f"env.{name}", getattr(e, name) > 0, "> 0")
            for name in [
                "gravity",
                "masscart",
                "masspole",
                "length",
                "force_mag",
                "tau",
                "theta_threshold_radians",
                "x_threshold",
                "max_steps_in_episode",
            ]
        ]
        + [
            ("seed", 0 <= c.seed < 2**31 - c.num_seeds, "in [0, 2**31 - num-seeds)"),
            ("learning_rate", c.learning_rate > 0, "> 0"),
            ("gamma", 0 < c.gamma <= 1, "in (0, 1]"),
            ("tau", 0 < c.tau <= 1, "in (0, 1]"),
            ("buffer_size", c.buffer_size >= c.num_envs, f">= --num-envs ({c.num_envs})"),
            ("batch_size", c.batch_size <= c.buffer_size, f"<= --buffer-size ({c.buffer_size})"),
            ("max_grad_norm", c.max_grad_norm is None or c.max_grad_norm > 0, "> 0 or None"),
            (
                "hidden_sizes",
                len(c.hidden_sizes) > 0 and min(c.hidden_sizes) >= 1,
                "one or more widths >= 1",
            ),
            (
                "total_timesteps",
                c.eval_only or num_chunks >= 1,
                f">= one chunk ({chunk_steps} env steps, see --log-every)",
            ),
            (
                "learning_starts",
                c.eval_only or 0 <= c.learning_starts < trained_steps,
                f"in [0, {trained_steps}) (the env steps trained)",
            ),
            (
                "num_seeds",
                c.num_seeds % jax.device_count() == 0,
                f"a multiple of the {jax.device_count()} devices",
            ),
            (
                "load_model",
                c.eval_only == (c.load_model is not None),
                "given with --eval-only, and only then",
            ),
            (
                "load_model",
                c.load_model is None or Path(c.load_model).is_file(),
                "an existing file",
            ),
        ]
    )
    for name, ok, allowed in rules:
        if not ok:
            value = getattr(e, name[4:]) if name.startswith("env.") else getattr(c, name)
            raise UsageError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def default_config(env_id: str | None = None) -> Config:
    """A task's defaults (flags override them). Swing-up explores more (target entropy 0, not -1), remembers
    longer (1,000 steps of all envs) and trains twice as long: with these 8/8 seeds swung up (docs/sac.md)."""
    swingup = dict(
        target_entropy=0.0,
        tau=0.1,
        buffer_size=1_000_000,
        total_timesteps=8_192_000,
        log_every=1_024_000,
    )
    return Config(env_id="CartPoleSwingup", **swingup) if env_id == "CartPoleSwingup" else Config()


def parse_config(args: Sequence[str] | None = None) -> Config:
    """tyro.cli over the defaults of the task that --env-id names (so --help lists those), with
    tyro's boxed parse errors reduced to one line (exit status 2)."""
    args = sys.argv[1:] if args is None else list(args)
    # A peek at the task (in either of tyro's spellings, the last one wins) for the defaults to parse over.
    named = [
        value
        for flag, value in zip(args, args[1:], strict=False)
        if flag in ("--env-id", "--env_id")
    ]
    named += [arg.split("=", 1)[1] for arg in args if arg.startswith(("--env-id=", "--env_id="))]
    default, captured = default_config(named[-1] if named else None), io.StringIO()
    try:
        with contextlib.redirect_stderr(captured):
            return tyro.cli(Config, args=args, default=default, description=__doc__.splitlines()[0])
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


# Everything else derived from the config, once; actions are action_offset + action_scale * tanh(u).
Setup = collections.namedtuple(
    "Setup",
    "env env_params actor critic obs_dim action_dim action_scale action_offset target_entropy",
)


def make_setup(config: Config) -> Setup:
    env, env_params = (
        envs.make(config.env_id)[0],
        envs.CartPoleParams(**dataclasses.asdict(config.env)),
    )
    space = env.action_space(env_params)
    action_dim = space.shape[0]
    target_entropy = -action_dim if config.target_entropy is None else config.target_entropy
    return Setup(
        env,
        env_params,
        Actor(config.hidden_sizes, action_dim),
        Critic(config.hidden_sizes),
        env.observation_space(env_params).shape[0],
        action_dim,
        (space.high - space.low) / 2,
        (space.high + space.low) / 2,
        target_entropy,
    )


# ---- networks ----

LOG_STD_MIN, LOG_STD_MAX = -5.0, 2.0  # CleanRL's sac_continuous_action (from SpinningUp)


class Actor(nn.Module):
    """obs -> (mean, log_std) of the Gaussian that tanh then squashes into the action bounds."""

    hidden_sizes: Sequence[int]
    action_dim: int

    @nn.compact
    def __call__(self, x: Array) -> tuple[Array, Array]:  # x: observations
        for size in self.hidden_sizes:
            x = nn.relu(nn.Dense(size)(x))
        mean, log_std = jnp.split(nn.Dense(2 * self.action_dim)(x), 2, axis=-1)
        # A smooth clamp into [LOG_STD_MIN, LOG_STD_MAX], as CleanRL does.
        return mean, LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (jnp.tanh(log_std) + 1)


class Critic(nn.Module):
    """(obs, action) -> Q. The twin critics are two parameter sets of this one module."""

    hidden_sizes: Sequence[int]

    @nn.compact
    def __call__(self, obs: Array, action: Array) -> Array:
        x = jnp.concatenate([obs, action], axis=-1)
        for size in self.hidden_sizes:
            x = nn.relu(nn.Dense(size)(x))
        return nn.Dense(1)(x).squeeze(-1)


def init_params(module: nn.Module, key: PRNGKey, *inputs: Array) -> Params:
    """PyTorch's default weights U(+-1/sqrt(fan_in)) (as CleanRL's networks), zero biases, in one
    draw: flax draws per layer, and on CPU every draw site is costly code to compile."""
    shapes = jax.eval_shape(module.init, jax.random.key(0), *inputs)
    flat, unflatten = jax.flatten_util.ravel_pytree(
        jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    )
    uniform = unflatten(jax.random.uniform(key, flat.shape, flat.dtype, minval=-1.0, maxval=1.0))
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x / np.sqrt(x.shape[0]) if path[-1].key == "kernel" else jnp.zeros_like(x),
        uniform,
    )


def squashed_gaussian_log_prob(
    pre_tanh: Array, mean: Array, log_std: Array, action_scale: Array
) -> Array:
    """log density of offset + scale * tanh(u), u ~ N(mean, exp(log_std)^2) (change of variables),
    with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)): finite where the naive form is log 0."""
    gaussian = (
        -0.5 * ((pre_tanh - mean) / jnp.exp(log_std)) ** 2 - log_std - 0.5 * jnp.log(2 * jnp.pi)
    )
    log_abs_det = 2 * (jnp.log(2.0) - pre_tanh - jax.nn.softplus(-2 * pre_tanh)) + jnp.log(
        action_scale
    )
    return jnp.sum(gaussian - log_abs_det, axis=-1)


def squashed_gaussian_sample(
    mean: Array, log_std: Array, noise: Array, action_scale: Array, action_offset: Array
) -> tuple[Array, Array]:
    """The reparameterised sample for standard-normal `noise` (drawn by the caller), and its log-prob."""
    chex.assert_equal_shape([mean, log_std, noise])
    pre_tanh = mean + jnp.exp(log_std) * noise
    return action_offset + action_scale * jnp.tanh(pre_tanh), squashed_gaussian_log_prob(
        pre_tanh, mean, log_std, action_scale
    )


# ---- replay buffer ----


@struct.dataclass
class Transition:
    obs: Array  # [..., obs_dim]
    action: Array  # [..., action_dim]
    reward: Array  # [...]
    next_obs: Array  # [..., obs_dim]; at an episode's end the last obs, not the reset one
    terminated: Array  # [...], 1.0 where the episode terminated: no bootstrapping there


@struct.dataclass
class Buffer:
    data: Transition  # preallocated, leading axis = capacity
    position: Array  # int32, the next slot to write
    size: Array  # int32, how many slots hold data


def buffer_init(capacity: int, obs_dim: int, action_dim: int) -> Buffer:
    zeros = [
        jnp.zeros((capacity, *shape)) for shape in [(obs_dim,), (action_dim,), (), (obs_dim,), ()]
    ]
    return Buffer(Transition(*zeros), position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: Buffer, transitions: Transition) -> Buffer:
    """Write one step's transitions (leading axis num_envs <= capacity) at once, wrapping around."""
    capacity, count = buffer.data.reward.shape[0], transitions.reward.shape[0]
    slots = (buffer.position + jnp.arange(count)) % capacity
    data = jax.tree.map(
        lambda stored, new: stored.at[slots].set(new, unique_indices=True), buffer.data, transitions
    )
    return Buffer(
        data, (buffer.position + count) % capacity, jnp.minimum(buffer.size + count, capacity)
    )


def buffer_sample(buffer: Buffer, key: PRNGKey, batch_size: int) -> Transition:
    """A uniform batch from the filled slots only. Bits modulo the size: a bias below size / 2^32,
    in one draw where jax.random.randint makes three, each costly code to compile on CPU."""
    slots = jax.random.bits(key, (batch_size,)) % buffer.size.astype(jnp.uint32)
    return jax.tree.map(lambda stored: stored[slots], buffer.data)


# ---- train state and losses ----


@struct.dataclass
class Learner:  # what a gradient update changes
    actor_params: Params
    critic_params: Params  # twin critics: every leaf has a leading axis of 2
    target_critic_params: Params
    log_alpha: Array  # the temperature, log-parameterised so that it stays positive
    actor_opt_state: optax.OptState
    critic_opt_state: optax.OptState
    alpha_opt_state: optax.OptState
    updates: Array  # int32, gradient updates done


@struct.dataclass
class TrainState:  # everything that flows through the training scan (one seed)
    learner: Learner
    buffer: Buffer
    env_state: envs.EpisodeStatsState  # [num_envs]
    obs: Array  # [num_envs, obs_dim]
    key: PRNGKey
    env_steps: Array  # int32, all envs together


@struct.dataclass
class Losses:
    critic_loss: Array
    actor_loss: Array
    alpha: Array
    q_mean: Array
    entropy: Array  # -E[log pi(a|s)] of the env's (scaled) actions


def td_target(
    batch: Transition, next_q: Array, next_log_prob: Array, alpha: Array, gamma: float
) -> Array:
    """r + gamma * (1 - terminated) * (min_i Q_i'(s', a') - alpha * log pi(a'|s')), a' ~ pi(s')."""
    chex.assert_equal_shape([batch.reward, batch.terminated, next_log_prob, next_q[0]])
    return batch.reward + gamma * (1.0 - batch.terminated) * (
        jnp.min(next_q, axis=0) - alpha * next_log_prob
    )


def critic_loss(
    critic_params: Params, batch: Transition, target: Array, q_values: Callable
) -> tuple[Array, Array]:
    """Sum over the twin critics (q_values -> [2, batch]) of the mean squared TD error, as CleanRL."""
    q = q_values(critic_params, batch.obs, batch.action)
    chex.assert_shape(q, (2, *target.shape))
    return jnp.sum(jnp.mean((q - jax.lax.stop_gradient(target)) ** 2, axis=1)), q


def actor_loss(
    actor_params: Params,
    critic_params: Params,
    obs: Array,
    noise: Array,
    alpha: Array,
    policy: Callable,
    q_values: Callable,
) -> tuple[Array, Array]:
    """E[alpha * log pi(a|s) - min_i Q_i(s, a)], a = policy(params, s, noise) reparameterised."""
    action, log_prob = policy(actor_params, obs, noise)
    q = jnp.min(q_values(critic_params, obs, action), axis=0)
    chex.assert_equal_shape([q, log_prob])
    return jnp.mean(alpha * log_prob - q), log_prob


def alpha_loss(log_alpha: Array, log_prob: Array, target_entropy: float) -> Array:
    """E[-alpha * (log pi(a|s) + target_entropy)]: alpha grows while the entropy is below target."""
    return -jnp.exp(log_alpha) * jnp.mean(jax.lax.stop_gradient(log_prob) + target_entropy)


@struct.dataclass
class Metrics:
    """A chunk's row per seed: means over its completed episodes and its updates (NaN if none)."""

    env_steps: Array
    updates: Array
    episode_return: Array
    episode_length: Array
    losses: Losses
    params_finite: Array  # False once any parameter is NaN or inf


# ---- training ----


def make_train(config: Config):
    """Static work once; returns the pure functions init(key) -> state, run_chunk(state, chunk)
    -> (state, metrics) and train(key) -> (state, metrics with a leading chunk axis)."""
    setup, (iterations_per_chunk, num_chunks) = make_setup(config), chunk_counts(config)
    env, env_params, actor, critic = (
        envs.EpisodeStats(setup.env),
        setup.env_params,
        setup.actor,
        setup.critic,
    )
    num_envs, action_dim, num_updates = config.num_envs, setup.action_dim, config.updates_per_step
    # Three Adam states. Clipping, if asked for, is by the global norm, as the flag's name says.
    clip = (
        [optax.clip_by_global_norm(config.max_grad_norm)]
        if config.max_grad_norm is not None
        else []
    )
    actor_optimizer = critic_optimizer = optax.chain(*clip, optax.adam(config.learning_rate))
    alpha_optimizer = optax.adam(config.learning_rate)

    def policy(actor_params: Params, obs: Array, noise: Array) -> tuple[Array, Array]:
        mean, log_std = actor.apply(actor_params, obs)
        return squashed_gaussian_sample(
            mean, log_std, noise, setup.action_scale, setup.action_offset
        )

    def q_values(critic_params: Params, obs: Array, action: Array) -> Array:
        return jax.vmap(critic.apply, in_axes=(0, None, None))(critic_params, obs, action)

    def update(learner: Learner, batch: Transition, noise: Array) -> tuple[Learner, Losses]:
        """One gradient step on the critics, then the actor, then alpha; Polyak-averaged targets."""
        next_noise, actor_noise = noise
        alpha = jnp.exp(learner.log_alpha)
        next_action, next_log_prob = policy(learner.actor_params, batch.next_obs, next_noise)
        next_q = q_values(learner.target_critic_params, batch.next_obs, next_action)
        target = td_target(batch, next_q, next_log_prob, alpha, config.gamma)
        (c_loss, q), grads = jax.value_and_grad(critic_loss, has_aux=True)(
            learner.critic_params, batch, target, q_values
        )
        updates, critic_opt_state = critic_optimizer.update(
            grads, learner.critic_opt_state, learner.critic_params
        )
        critic_params = optax.apply_updates(learner.critic_params, updates)
        (a_loss, log_prob), grads = jax.value_and_grad(actor_loss, has_aux=True)(
            learner.actor_params, critic_params, batch.obs, actor_noise, alpha, policy, q_values
        )
        updates, actor_opt_state = actor_optimizer.update(
            grads, learner.actor_opt_state, learner.actor_params
        )
        grad = jax.grad(alpha_loss)(learner.log_alpha, log_prob, setup.target_entropy)
        alpha_updates, alpha_opt_state = alpha_optimizer.update(
            grad, learner.alpha_opt_state, learner.log_alpha
        )
        learner = Learner(
            optax.apply_updates(learner.actor_params, updates),
            critic_params,
            optax.incremental_update(critic_params, learner.target_critic_params, config.tau),
            optax.apply_updates(learner.log_alpha, alpha_updates),
            actor_opt_state,
            critic_opt_state,
            alpha_opt_state,
            learner.updates + 1,
        )
        return learner, Losses(c_loss, a_loss, alpha, jnp.mean(q), -jnp.mean(log_prob))

    def iteration(state: TrainState, index: Array) -> tuple[TrainState, tuple[Any, ...]]:
        """Step every env, store the transitions, then num_updates updates once past the warm-up. `index`
        (iterations so far) comes from the scan, not the state: equal across seeds, so cond stays a branch."""
        # One split for the iteration: on CPU every random-draw site is a kernel to compile.
        keys = jax.random.split(state.key, 2 + num_envs + 2 * num_updates)
        key, key_action, env_keys, update_keys = (
            keys[0],
            keys[1],
            keys[2 : 2 + num_envs],
            keys[2 + num_envs :],
        )
        learning = index * num_envs >= config.learning_starts
        noise = jax.random.normal(key_action, (num_envs, action_dim))
        policy_action, _ = policy(state.learner.actor_params, state.obs, noise)
        # Warm-up actions are uniform: erf(z / sqrt 2) of a standard normal z is uniform on (-1, 1).
        random_action = setup.action_offset + setup.action_scale * jax.scipy.special.erf(
            noise / jnp.sqrt(2.0)
        )
        action = jnp.where(learning, policy_action, random_action)
        obs, env_state, reward, terminated, _, info = jax.vmap(env.step, in_axes=(0, 0, 0, None))(
            env_keys, state.env_state, action, env_params
        )
        # final_observation is the pre-reset one: a time-limit end still bootstraps from it.
        buffer = buffer_add(
            state.buffer,
            Transition(
                state.obs, action, reward, info["final_observation"], terminated.astype(jnp.float32)
            ),
        )

        def learn(learner: Learner, keys: PRNGKey) -> tuple[Learner, Losses]:
            batch = buffer_sample(buffer, keys[0], config.batch_size)
            return update(
                learner, batch, jax.random.normal(keys[1], (2, config.batch_size, action_dim))
            )

        learner, losses = jax.lax.cond(
            learning,
            lambda learner: jax.lax.scan(learn, learner, update_keys.reshape(num_updates, 2)),
            lambda learner: (learner, Losses(*[jnp.zeros(num_updates)] * 5)),
            state.learner,
        )
        state = TrainState(learner, buffer, env_state, obs, key, state.env_steps + num_envs)
        episodes = (info["returned_episode"], info["episode_return"], info["episode_length"])
        return state, (episodes, learning, jax.tree.map(jnp.mean, losses))

    def init(key: PRNGKey) -> TrainState:
        """Fresh networks, optimisers and envs, and an empty buffer."""
        key, key_actor, key_critic, key_env = jax.random.split(key, 4)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(key_env, num_envs), env_params
        )
        actor_params = init_params(actor, key_actor, obs)
        critic_params = jax.vmap(init_params, in_axes=(None, 0, None, None))(  # twin critics
            critic, jax.random.split(key_critic, 2), obs, jnp.zeros((num_envs, action_dim))
        )
        log_alpha = jnp.zeros(())  # alpha = 1 at the start, as in CleanRL
        learner = Learner(
            actor_params,
            critic_params,
            critic_params,
            log_alpha,
            actor_optimizer.init(actor_params),
            critic_optimizer.init(critic_params),
            alpha_optimizer.init(log_alpha),
            jnp.int32(0),
        )
        buffer = buffer_init(config.buffer_size, setup.obs_dim, action_dim)
        return TrainState(learner, buffer, env_state, obs, key, env_steps=jnp.int32(0))

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """Chunk number `chunk` (from 0): iterations_per_chunk iterations in one scan."""
        indices = chunk * iterations_per_chunk + jnp.arange(iterations_per_chunk)
        state, ((done, episode_return, episode_length), learning, losses) = jax.lax.scan(
            iteration, state, indices
        )
        learner = state.learner
        params, _ = jax.flatten_util.ravel_pytree(
            (learner.actor_params, learner.critic_params, learner.log_alpha)
        )
        masked_mean = lambda x, mask: (
            jnp.sum(jnp.where(mask, x, 0)) / jnp.where(mask.any(), mask.sum(), jnp.nan)
        )  # noqa: E731
        return state, Metrics(
            state.env_steps,
            learner.updates,
            masked_mean(episode_return, done),
            masked_mean(episode_length, done),
            jax.tree.map(lambda x: masked_mean(x, learning), losses),
            jnp.all(jnp.isfinite(params)),
        )

    def train(key: PRNGKey) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(run_chunk, init(key), jnp.arange(num_chunks))

    return init, run_chunk, train


# ---- evaluation, checkpoint, plots, GIF ----

GIF_ENVS = 4  # evaluation episodes shown side by side in policy.gif
GIF_STRIDE = 2  # every second step: 25 frames per second of simulated time
UPRIGHT_RADIANS = math.radians(12)  # "upright": |theta| below the angle at which balance fails


def make_evaluate(config: Config):
    """evaluate(actor_params, key) -> (mean deterministic return over eval_episodes, the fraction of
    episodes upright at every step of their second half, env states [time, GIF_ENVS] for the GIF).
    step_env (no auto-reset); after a termination, rewards are masked and the state is frozen."""
    setup = make_setup(config)
    env, env_params, num_episodes = setup.env, setup.env_params, config.eval_episodes
    num_steps = config.env.max_steps_in_episode

    def evaluate(actor_params: Params, key: PRNGKey) -> tuple[Array, Array, envs.CartPoleState]:
        key_reset, key_steps = jax.random.split(key)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(key_reset, num_episodes), env_params
        )

        def step(carry, inputs):
            obs, env_state, total, running, upright = carry
            keys, second_half = inputs
            action = setup.action_offset + setup.action_scale * jnp.tanh(
                setup.actor.apply(actor_params, obs)[0]
            )
            obs, next_state, reward, terminated, _ = jax.vmap(
                env.step_env, in_axes=(0, 0, 0, None)
            )(keys, env_state, action, env_params)
            stepped = running & ~terminated
            upright &= ~second_half | (
                stepped & (jnp.abs(envs.angle_normalize(next_state.theta)) < UPRIGHT_RADIANS)
            )
            next_state = jax.tree.map(
                lambda new, old: jnp.where(running, new, old), next_state, env_state
            )
            carry = (obs, next_state, total + jnp.where(running, reward, 0.0), stepped, upright)
            return carry, jax.tree.map(lambda x: x[:GIF_ENVS], env_state)

        carry = (
            obs,
            env_state,
            jnp.zeros(num_episodes),
            jnp.ones(num_episodes, bool),
            jnp.ones(num_episodes, bool),
        )
        inputs = (
            jax.random.split(key_steps, (num_steps, num_episodes)),
            jnp.arange(num_steps) >= num_steps // 2,
        )
        (_, _, total, _, upright), states = jax.lax.scan(step, carry, inputs)
        return jnp.mean(total), jnp.mean(upright), states

    return evaluate


def write_atomic(
    path: Path, write: Callable[[Path], Any]
) -> None:  # no reader sees a half-written file
    write(temporary := path.with_name(f".{path.stem}.tmp{path.suffix}"))
    os.replace(temporary, path)


def save_checkpoint(path: Path, config: Config, learner: Learner) -> None:
    """Every seed's actor, critics and temperature (leading seed axis), with the config."""
    params = {
        "actor": learner.actor_params,
        "critic": learner.critic_params,
        "log_alpha": learner.log_alpha,
    }
    payload = {
        "script": SCRIPT,
        "env_id": config.env_id,
        "config": json.dumps(dataclasses.asdict(config)),
        "params": flax.serialization.to_state_dict(jax.device_get(params)),
    }
    write_atomic(
        path, lambda temporary: temporary.write_bytes(flax.serialization.msgpack_serialize(payload))
    )


def load_checkpoint(config: Config) -> tuple[Config, Params]:
    """(the config to evaluate with, every seed's actor parameters): the checkpoint's config (its
    env, network and seeds, so the same evaluation episodes) with this run's output options."""
    try:
        payload = flax.serialization.msgpack_restore(Path(config.load_model).read_bytes())
        script, env_id, saved = payload["script"], payload["env_id"], json.loads(payload["config"])
    except Exception as error:  # whatever is wrong with the file, it is the same user error
        raise UsageError(
            f"--load-model {config.load_model} is not a model.msgpack ({error!r})"
        ) from None
    if (script, env_id) != (SCRIPT, config.env_id):
        raise UsageError(
            f"--load-model {config.load_model} is a {script} checkpoint for {env_id}, not "
            f"{config.env_id} (--env-id)"
        )
    outputs = {
        name: getattr(config, name)
        for name in ["eval_episodes", "output_dir", "capture_gif", "load_model"]
    }
    config = Config(
        **{
            **saved,
            **outputs,
            "hidden_sizes": tuple(saved["hidden_sizes"]),
            "env": EnvConfig(**saved["env"]),
            "eval_only": True,
            "save_model": False,
            "plot": False,
        }
    )
    return config, jax.tree.map(
        jnp.asarray, payload["params"]["actor"]
    )  # flax applies plain dicts of arrays


CSV_COLUMNS = [
    "seed",
    "env_steps",
    "updates",
    "wall_seconds",
    "sps",
    "episode_return",
    "episode_length",
    "critic_loss",
    "actor_loss",
    "alpha",
    "q_mean",
    "entropy",
]


def plot_curves(path: Path, rows: list[dict], num_seeds: int, env_id: str) -> None:
    """Return against env steps (mean and min-max band over seeds), and the losses."""
    from matplotlib.figure import Figure  # here, not at the top: it takes half a second to import

    figure = Figure(figsize=(13, 6.5), layout="constrained")
    for axis, column in zip(
        figure.subplots(2, 3).flat, ["episode_return", *CSV_COLUMNS[-5:]], strict=True
    ):
        steps, values = (
            np.array([row[name] for row in rows], float).reshape(-1, num_seeds)
            for name in ["env_steps", column]
        )
        finite = np.isfinite(values).all(axis=1)  # chunks without episodes or updates are NaN
        axis.plot(steps[finite, 0], values[finite].mean(axis=1))
        axis.fill_between(
            steps[finite, 0], values[finite].min(axis=1), values[finite].max(axis=1), alpha=0.25
        )
        axis.set(title=column, xlabel="env steps")
    figure.suptitle(f"{SCRIPT} on {env_id}, {num_seeds} seed(s)")
    write_atomic(path, lambda temporary: figure.savefig(temporary, dpi=80))


def write_gif(path: Path, config: Config, env_states: envs.CartPoleState) -> None:
    """Episodes side by side (env_states [time, GIF_ENVS]), drawn by the env's renderer."""
    from PIL import Image  # pillow comes with matplotlib

    setup = make_setup(config)
    render = jax.jit(
        jax.vmap(jax.vmap(lambda state: setup.env.render(state, setup.env_params, 120, 180)))
    )
    env_states = jax.tree.map(lambda x: x[::GIF_STRIDE], env_states)
    frames = np.concatenate(
        np.asarray(render(env_states)).transpose(1, 0, 2, 3, 4), axis=2
    )  # [time, h, w * envs, 3]
    images = [Image.fromarray(frame).quantize(colors=16) for frame in frames]
    write_atomic(
        path,
        lambda temporary: images[0].save(
            temporary,
            save_all=True,
            append_images=images[1:],
            duration=round(1000 * config.env.tau * GIF_STRIDE),
            loop=0,
        ),
    )


# ---- main ----


def seed_keys(config: Config) -> PRNGKey:  # seed i of a vmapped run is the run of --seed (seed + i)
    return jax.vmap(jax.random.key)(config.seed + jnp.arange(config.num_seeds))


def train_and_log(
    config: Config, sharding: NamedSharding, out: Path, evaluate: Callable, eval_keys: PRNGKey
):
    """The CLI's loop: the compiled chunk function from Python, a progress line per chunk."""
    (init, run_chunk, _), (iterations_per_chunk, num_chunks) = (
        make_train(config),
        chunk_counts(config),
    )
    keys = jax.device_put(seed_keys(config), sharding)
    state_shape = jax.eval_shape(jax.vmap(init), keys)
    buffer_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state_shape.buffer)) / 2**20
    print(
        f"{SCRIPT}: {config.env_id}, {config.num_seeds} seed(s) x {config.num_envs} envs on {sharding.mesh.size} "
        f"device(s) {sharding.mesh.devices.tolist()}, replay buffer {buffer_mb / config.num_seeds:.1f} MB per seed",
        flush=True,
    )
    # init compiles on a second thread beside the chunk function, the evaluation while the chunks run.
    start, pool = time.perf_counter(), ThreadPoolExecutor(2)
    init = pool.submit(
        jax.jit(jax.vmap(init), in_shardings=sharding, out_shardings=sharding).lower(keys).compile
    )
    # The state is donated: the chunk updates the buffer in place instead of copying it.
    run_chunk = jax.jit(
        jax.vmap(run_chunk, in_axes=(0, None)),
        donate_argnums=0,
        out_shardings=sharding,
        in_shardings=(sharding, NamedSharding(sharding.mesh, PartitionSpec())),
    )
    run_chunk, init = run_chunk.lower(state_shape, jnp.int32(0)).compile(), init.result()
    compile_seconds = time.perf_counter() - start
    print(f"compiled in {compile_seconds:.1f} s", flush=True)
    evaluate = pool.submit(evaluate.lower(state_shape.learner.actor_params, eval_keys).compile)

    stop = threading.Event()  # set by Ctrl-C: the loop ends after the chunk in progress
    previous_handler = signal.signal(signal.SIGINT, lambda signum, frame: stop.set())
    state, rows, done_updates, chunk_steps = (
        init(keys),
        [],
        0,
        iterations_per_chunk * config.num_envs,
    )
    start = last = time.perf_counter()
    for chunk in range(num_chunks):
        state, metrics = run_chunk(state, jnp.int32(chunk))
        metrics = jax.device_get(metrics)  # waits for the chunk; a few numbers per seed
        now = time.perf_counter()
        elapsed, seconds, last = now - start, now - last, now
        steps, updates, losses = (
            int(metrics.env_steps[0]),
            int(metrics.updates[0]),
            metrics.losses.__dict__,
        )
        rows += [
            {
                "seed": config.seed + i,
                "env_steps": steps,
                "updates": updates,
                "wall_seconds": round(elapsed, 3),
                "sps": round(chunk_steps / seconds, 1),
                "episode_return": float(metrics.episode_return[i]),
                "episode_length": float(metrics.episode_length[i]),
                **{name: float(values[i]) for name, values in losses.items()},
            }
            for i in range(config.num_seeds)
        ]
        table = "\n".join(
            [",".join(CSV_COLUMNS)] + [",".join(str(row[c]) for c in CSV_COLUMNS) for row in rows]
        )
        write_atomic(out / "metrics.csv", lambda temporary: temporary.write_text(table + "\n"))  # noqa: B023 (called now)
        returns = metrics.episode_return  # "-" for a chunk in which no episode ended
        shown = (
            "-"
            if np.isnan(returns).any()
            else f"{returns.mean():.1f}" + f" ± {returns.std():.1f}" * (config.num_seeds > 1)
        )
        print(
            f"steps {steps:,}/{num_chunks * chunk_steps:,} ({(chunk + 1) / num_chunks:.0%}) | SPS "
            f"{chunk_steps / seconds:,.0f} | updates/s {(updates - done_updates) / seconds:,.0f} | return {shown} | "
            f"critic {losses['critic_loss'].mean():.3f} actor {losses['actor_loss'].mean():.3f} alpha "
            f"{losses['alpha'].mean():.3f} | {elapsed:.1f} s, ETA {elapsed * (num_chunks / (chunk + 1) - 1):.1f} s",
            flush=True,
        )
        faults = [
            (i, name)
            for name, values in losses.items()
            for i in range(config.num_seeds)
            if updates > done_updates and not np.isfinite(values[i])
        ]
        faults += [
            (i, "parameter") for i in range(config.num_seeds) if not metrics.params_finite[i]
        ]
        if faults:
            print(
                f"{SCRIPT}: non-finite {faults[0][1]} in chunk {chunk + 1}, seed {config.seed + faults[0][0]}; "
                f"stopped (the files in {out} hold the chunks so far)",
                file=sys.stderr,
            )
            sys.exit(1)
        done_updates = updates
        if stop.is_set():
            print("Ctrl-C: stopping after this chunk", flush=True)
            break
    signal.signal(signal.SIGINT, previous_handler)
    seconds, steps = time.perf_counter() - start, int(state.env_steps[0])
    return (
        state,
        rows,
        {
            "train_seconds": seconds,
            "compile_seconds": compile_seconds,
            "env_steps": steps,
            "updates": done_updates,
            "env_steps_per_second": steps / seconds,
            "updates_per_second": done_updates / seconds,
        },
        evaluate.result(),
    )


def main(config: Config) -> None:
    try:
        validate(config)
        config, actor_params = load_checkpoint(config) if config.eval_only else (config, None)
    except UsageError as error:
        print(f"{SCRIPT}.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    devices = jax.devices()
    sharding = NamedSharding(
        Mesh(np.array(devices), ("seeds",)), PartitionSpec("seeds")
    )  # seeds over devices
    out = Path(config.output_dir or f"runs/{SCRIPT}__{config.seed}__{int(time.time())}")
    out.mkdir(parents=True, exist_ok=True)
    write_json = lambda name, values: write_atomic(  # noqa: E731
        out / name, lambda temporary: temporary.write_text(json.dumps(values, indent=2) + "\n")
    )
    write_json("config.json", dataclasses.asdict(config))
    eval_keys = jax.device_put(
        jax.vmap(lambda key: jax.random.fold_in(key, 1))(seed_keys(config)), sharding
    )
    evaluate = jax.jit(
        jax.vmap(make_evaluate(config)), in_shardings=sharding
    )  # keys apart from training's
    if config.eval_only:
        summary = {"eval_only": True, "load_model": config.load_model}
    else:
        state, rows, summary, evaluate = train_and_log(config, sharding, out, evaluate, eval_keys)
        actor_params = state.learner.actor_params
    returns, upright, episodes = jax.device_get(evaluate(actor_params, eval_keys))
    print(
        f"evaluation, {config.eval_episodes} deterministic episodes per seed: mean return "
        + ", ".join(f"{r:.1f}" for r in returns)
        + ", upright through the second half "
        + ", ".join(f"{u:.0%}" for u in upright),
        flush=True,
    )
    write_json(
        "summary.json",
        {
            "final_returns": returns.tolist(),
            "final_return_mean": float(returns.mean()),
            "final_return_std": float(returns.std()),
            "final_upright_fractions": upright.tolist(),
            **summary,
            "num_seeds": config.num_seeds,
            "num_envs": config.num_envs,
            "eval_episodes": config.eval_episodes,
            "device": f"{len(devices)} x {devices[0].device_kind}",
        },
    )
    if config.save_model:
        save_checkpoint(out / "model.msgpack", config, state.learner)
    if config.plot:
        plot_curves(out / "curves.png", rows, config.num_seeds, config.env_id)
    if config.capture_gif:
        write_gif(
            out / "policy.gif", config, jax.tree.map(lambda x: x[0], episodes)
        )  # the first seed's
    print(f"outputs in {out}")


if __name__ == "__main__":
    main(parse_config())
