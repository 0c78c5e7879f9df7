"""SAC on continuous CartPole, balance and swing-up, fully on device. Docs: docs/sac.md

sac_pendulum.py's soft actor-critic (the same networks, buffer, losses and compiled chunk loop) on
envs.CartPoleContinuous (balance) or envs.CartPoleSwingup (swing the pole up from hanging down).
Terminations (the pole past 12 degrees, the cart off the track) stop bootstrapping; the time
limit does not. Each task has its own defaults (`default_config`).

    python sac_cartpole.py                           # balance; writes runs/sac_cartpole__1__<time>/
    python sac_cartpole.py --env-id CartPoleSwingup  # swing-up, with its own defaults (see --help)
    python sac_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

import argparse
import csv
import dataclasses
import importlib.util
import io
import itertools
import json
import math
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Literal, NamedTuple, get_type_hints

import chex
import flax.linen as nn
import flax.serialization
import jax
import jax.numpy as jnp
import numpy as np
import optax
import tyro
from chex import Array, PRNGKey
from flax import struct
from jax.experimental import multihost_utils
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
    """balance (CartPoleContinuous) or swing-up (CartPoleSwingup); each has its own defaults"""
    seed: int = 1
    """seed of the first run; seed i of --num-seeds uses seed + i"""
    num_seeds: int = 1
    """independent runs trained at once in one vmapped program"""
    sweep: tuple[str, ...] = ()
    """NAME=V1,V2,... per swept field (learning-rate=1e-3,3e-3 tau=0.01,0.05): every
    combination of the values x --num-seeds runs in one vmapped program (docs/sweeps.md)"""
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
    batch_size: int = 256
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
    target_entropy: float | None = 0.0
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
    """write policy.gif (the first seed's deterministic policy in a few envs side by side)"""
    plot: bool = True
    """write curves.png (return and losses against env steps)"""
    load_model: str | None = None
    """a model.msgpack to evaluate with --eval-only"""
    eval_only: bool = False
    """evaluate (and render) the --load-model checkpoint instead of training"""
    plot_every: float = 15.0
    """seconds between redraws of curves.png while training (0: drawn at the end only)"""
    live: bool = False
    """show the first run's current policy after every chunk (live.gif, and a window beside the
    return curves where a display exists)"""
    track: bool = False
    """write TensorBoard event files per run into the run's tensorboard/ (needs tensorboardX):
    tensorboard --logdir runs"""
    distributed: bool = False
    """run over every device of several processes or hosts with JAX's distributed runtime
    (docs/distributed.md): the cluster (SLURM, Open MPI, ...) is detected, or given by the three
    flags below"""
    coordinator_address: str | None = None
    """HOST:PORT of process 0 of a --distributed run, which every process reaches"""
    num_processes: int | None = None
    """processes of a --distributed run"""
    process_id: int | None = None
    """this process's index in a --distributed run, in [0, --num-processes)"""
    coordinator_timeout: float = 120.0
    """seconds a --distributed process waits for all the others to join before it gives up"""
    compile_cache: bool = True
    """keep compiled programs in JAX's persistent cache ($JAX_COMPILATION_CACHE_DIR, else
    ~/.cache/jax-rl-scripts, at most 1 GiB)"""
    env: EnvConfig = EnvConfig()
    """CartPole physics"""


def default_config(env_id: str = "CartPoleContinuous") -> Config:
    """A task's defaults, which the command line's flags override. Swing-up keeps the batch that
    it was tuned with, remembers longer (1,000 iterations of all envs) and trains twice as long
    (docs/sac.md)."""
    if env_id != "CartPoleSwingup":
        return Config()
    return Config(
        env_id="CartPoleSwingup",
        tau=0.1,
        batch_size=128,
        buffer_size=1_000_000,
        total_timesteps=8_192_000,
        log_every=1_024_000,
    )


def make_env(config: Config) -> tuple[envs.Environment, envs.CartPoleParams]:
    """The one place the env is made: any env with gymnax's API and a Box action space fits."""
    if config.env_id == "CartPoleSwingup":
        env = envs.CartPoleSwingup()
    else:
        env = envs.CartPoleContinuous()
    return env, envs.CartPoleParams(**dataclasses.asdict(config.env))


def env_name(config: Config) -> str:
    return config.env_id


def chunk_sizes(config: Config) -> tuple[int, int]:
    """(iterations per chunk, number of chunks); an iteration steps every env once."""
    iterations_per_chunk = max(config.log_every // config.num_envs, 1)
    num_chunks = config.total_timesteps // (iterations_per_chunk * config.num_envs)
    return iterations_per_chunk, num_chunks


# ---- networks ----

# PyTorch's default Linear weight, U(+-1/sqrt(fan_in)), as CleanRL's networks start; zero biases.
TORCH_LINEAR_INIT = nn.initializers.variance_scaling(1 / 3, "fan_in", "uniform")
LOG_STD_MIN = -5.0  # log-std bounds of CleanRL's sac_continuous_action (from SpinningUp)
LOG_STD_MAX = 2.0


class Actor(nn.Module):
    """obs -> (mean, log_std) of the Gaussian that tanh then squashes into the action bounds."""

    hidden_sizes: Sequence[int]
    action_dim: int

    @nn.compact
    def __call__(self, obs: Array) -> tuple[Array, Array]:
        x = obs
        for size in self.hidden_sizes:
            x = nn.relu(nn.Dense(size, kernel_init=TORCH_LINEAR_INIT)(x))
        mean = nn.Dense(self.action_dim, kernel_init=TORCH_LINEAR_INIT, name="mean")(x)
        log_std = nn.Dense(self.action_dim, kernel_init=TORCH_LINEAR_INIT, name="log_std")(x)
        # A smooth clamp of the log-std into [LOG_STD_MIN, LOG_STD_MAX], as CleanRL does.
        log_std = LOG_STD_MIN + 0.5 * (LOG_STD_MAX - LOG_STD_MIN) * (jnp.tanh(log_std) + 1)
        return mean, log_std


class Critic(nn.Module):
    """(obs, action) -> Q. The twin critics are two parameter sets of this one module."""

    hidden_sizes: Sequence[int]

    @nn.compact
    def __call__(self, obs: Array, action: Array) -> Array:
        x = jnp.concatenate([obs, action], axis=-1)
        for size in self.hidden_sizes:
            x = nn.relu(nn.Dense(size, kernel_init=TORCH_LINEAR_INIT)(x))
        return nn.Dense(1, kernel_init=TORCH_LINEAR_INIT, name="q")(x).squeeze(-1)


def action_bounds(env: envs.Environment, env_params: Any) -> tuple[Array, Array]:
    """(scale, offset) that map tanh's (-1, 1) onto the env's action box."""
    space = env.action_space(env_params)
    return (space.high - space.low) / 2, (space.high + space.low) / 2


def squashed_gaussian_log_prob(
    pre_tanh: Array, mean: Array, log_std: Array, action_scale: Array
) -> Array:
    """log density of offset + scale * tanh(u), u ~ N(mean, exp(log_std)^2) (change of
    variables), with log(1 - tanh(u)^2) = 2 (log 2 - u - softplus(-2u)): finite where the naive
    form is log 0."""
    gaussian = -0.5 * ((pre_tanh - mean) / jnp.exp(log_std)) ** 2 - log_std
    gaussian = gaussian - 0.5 * jnp.log(2 * jnp.pi)
    log_det = 2 * (jnp.log(2.0) - pre_tanh - jax.nn.softplus(-2 * pre_tanh)) + jnp.log(action_scale)
    return jnp.sum(gaussian - log_det, axis=-1)


def squashed_gaussian_sample(
    mean: Array, log_std: Array, noise: Array, action_scale: Array, action_offset: Array
) -> tuple[Array, Array]:
    """The reparameterised sample for standard-normal `noise`, and its log-prob."""
    chex.assert_equal_shape([mean, log_std, noise])
    pre_tanh = mean + jnp.exp(log_std) * noise
    action = action_offset + action_scale * jnp.tanh(pre_tanh)
    return action, squashed_gaussian_log_prob(pre_tanh, mean, log_std, action_scale)


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
    data = Transition(
        obs=jnp.zeros((capacity, obs_dim)),
        action=jnp.zeros((capacity, action_dim)),
        reward=jnp.zeros(capacity),
        next_obs=jnp.zeros((capacity, obs_dim)),
        terminated=jnp.zeros(capacity),
    )
    return Buffer(data=data, position=jnp.int32(0), size=jnp.int32(0))


def buffer_add(buffer: Buffer, transitions: Transition) -> Buffer:
    """Write one step's transitions (leading axis num_envs <= capacity) at once, wrapping around."""
    capacity = buffer.data.reward.shape[0]
    count = transitions.reward.shape[0]
    slots = (buffer.position + jnp.arange(count)) % capacity
    data = jax.tree.map(
        lambda stored, new: stored.at[slots].set(new, unique_indices=True), buffer.data, transitions
    )
    return Buffer(
        data=data,
        position=(buffer.position + count) % capacity,
        size=jnp.minimum(buffer.size + count, capacity),
    )


def buffer_sample(buffer: Buffer, key: PRNGKey, batch_size: int) -> Transition:
    """A uniform batch from the filled slots only."""
    slots = jax.random.randint(key, (batch_size,), 0, buffer.size)
    return jax.tree.map(lambda stored: stored[slots], buffer.data)


# ---- train state and losses ----


@struct.dataclass
class Learner:
    """What a gradient update changes."""

    actor_params: Params
    critic_params: Params  # twin critics: every leaf has a leading axis of 2
    target_critic_params: Params
    log_alpha: Array  # the temperature, log-parameterised so that it stays positive
    actor_opt_state: optax.OptState
    critic_opt_state: optax.OptState
    alpha_opt_state: optax.OptState
    updates: Array  # int32, gradient updates done


@struct.dataclass
class TrainState:
    """Everything that flows through the training scan (one seed)."""

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


@struct.dataclass
class Metrics:
    """A chunk's numbers for one seed: means over its completed episodes and over its updates
    (NaN where there were none)."""

    env_steps: Array
    updates: Array
    episode_return: Array
    episode_length: Array
    critic_loss: Array
    actor_loss: Array
    alpha: Array
    q_mean: Array
    entropy: Array
    params_finite: Array  # False once any parameter is NaN or inf


def trained_params(state: TrainState) -> Params:
    """What a checkpoint keeps and the evaluation reads."""
    learner = state.learner
    return {
        "actor": learner.actor_params,
        "critic": learner.critic_params,
        "log_alpha": learner.log_alpha,
    }


def td_target(
    batch: Transition, next_q: Array, next_log_prob: Array, alpha: Array, gamma: float
) -> Array:
    """r + gamma * (1 - terminated) * (min_i Q_i'(s', a') - alpha * log pi(a'|s')), a' ~ pi(s')."""
    chex.assert_equal_shape([batch.reward, batch.terminated, next_log_prob, next_q[0]])
    soft_value = jnp.min(next_q, axis=0) - alpha * next_log_prob
    return batch.reward + gamma * (1.0 - batch.terminated) * soft_value


def critic_loss(
    critic_params: Params, batch: Transition, target: Array, q_values: Callable
) -> tuple[Array, Array]:
    """Sum over the twin critics (q_values -> [2, batch]) of the mean squared TD error (CleanRL)."""
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


def masked_mean(values: Array, mask: Array) -> Array:
    """The mean of `values` where `mask` holds; NaN where it holds nowhere."""
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.where(mask.any(), mask.sum(), jnp.nan)


# ---- training ----


def make_train(config: Config):
    """Static work once; returns the pure functions init(key) -> state, run_chunk(state, chunk)
    -> (state, metrics) and train(key) -> (state, metrics with a leading chunk axis)."""
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    obs_dim = env.observation_space(env_params).shape[0]
    action_dim = env.action_space(env_params).shape[0]
    action_scale, action_offset = action_bounds(env, env_params)
    actor = Actor(config.hidden_sizes, action_dim)
    critic = Critic(config.hidden_sizes)
    target_entropy = -action_dim if config.target_entropy is None else config.target_entropy
    num_envs = config.num_envs
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    # Clipping, if asked for, is by the global norm, as the flag's name says.
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    network_optimizer = optax.chain(*clip, optax.adam(config.learning_rate))
    alpha_optimizer = optax.adam(config.learning_rate)

    def policy(actor_params: Params, obs: Array, noise: Array) -> tuple[Array, Array]:
        mean, log_std = actor.apply(actor_params, obs)
        return squashed_gaussian_sample(mean, log_std, noise, action_scale, action_offset)

    def q_values(critic_params: Params, obs: Array, action: Array) -> Array:
        return jax.vmap(critic.apply, in_axes=(0, None, None))(critic_params, obs, action)

    def init(key: PRNGKey) -> TrainState:
        """Fresh networks, optimisers and envs, and an empty buffer."""
        key_actor, key_critic, key_envs, key_loop = jax.random.split(key, 4)
        reset_envs = jax.vmap(env.reset, in_axes=(0, None))
        obs, env_state = reset_envs(jax.random.split(key_envs, num_envs), env_params)
        actor_params = actor.init(key_actor, obs)
        critic_keys = jax.random.split(key_critic, 2)  # twin critics
        critic_init = jax.vmap(critic.init, in_axes=(0, None, None))
        critic_params = critic_init(critic_keys, obs, jnp.zeros((num_envs, action_dim)))
        log_alpha = jnp.zeros(())  # alpha = 1 at the start, as in CleanRL
        learner = Learner(
            actor_params=actor_params,
            critic_params=critic_params,
            target_critic_params=critic_params,
            log_alpha=log_alpha,
            actor_opt_state=network_optimizer.init(actor_params),
            critic_opt_state=network_optimizer.init(critic_params),
            alpha_opt_state=alpha_optimizer.init(log_alpha),
            updates=jnp.int32(0),
        )
        return TrainState(
            learner=learner,
            buffer=buffer_init(config.buffer_size, obs_dim, action_dim),
            env_state=env_state,
            obs=obs,
            key=key_loop,
            env_steps=jnp.int32(0),
        )

    # UPDATE NETWORKS: the critics, then the actor, then the temperature (rejax's order of steps)

    def update_critic(learner: Learner, batch: Transition, key: PRNGKey):
        """A gradient step on the twin critics towards the soft TD target; Polyak targets."""
        alpha = jnp.exp(learner.log_alpha)
        next_noise = jax.random.normal(key, batch.action.shape)
        next_action, next_log_prob = policy(learner.actor_params, batch.next_obs, next_noise)
        next_q = q_values(learner.target_critic_params, batch.next_obs, next_action)
        target = td_target(batch, next_q, next_log_prob, alpha, config.gamma)
        loss_grad = jax.value_and_grad(critic_loss, has_aux=True)
        (loss, q), grads = loss_grad(learner.critic_params, batch, target, q_values)
        updates, opt_state = network_optimizer.update(
            grads, learner.critic_opt_state, learner.critic_params
        )
        critic_params = optax.apply_updates(learner.critic_params, updates)
        learner = learner.replace(
            critic_params=critic_params,
            target_critic_params=optax.incremental_update(
                critic_params, learner.target_critic_params, config.tau
            ),
            critic_opt_state=opt_state,
        )
        return learner, loss, q

    def update_actor(learner: Learner, obs: Array, key: PRNGKey):
        """A gradient step on the actor against the updated critics."""
        alpha = jnp.exp(learner.log_alpha)
        noise = jax.random.normal(key, (obs.shape[0], action_dim))
        loss_grad = jax.value_and_grad(actor_loss, has_aux=True)
        (loss, log_prob), grads = loss_grad(
            learner.actor_params, learner.critic_params, obs, noise, alpha, policy, q_values
        )
        updates, opt_state = network_optimizer.update(
            grads, learner.actor_opt_state, learner.actor_params
        )
        actor_params = optax.apply_updates(learner.actor_params, updates)
        return learner.replace(actor_params=actor_params, actor_opt_state=opt_state), loss, log_prob

    def update_temperature(learner: Learner, log_prob: Array) -> Learner:
        """A gradient step on log(alpha) towards the target entropy."""
        grad = jax.grad(alpha_loss)(learner.log_alpha, log_prob, target_entropy)
        updates, opt_state = alpha_optimizer.update(
            grad, learner.alpha_opt_state, learner.log_alpha
        )
        log_alpha = optax.apply_updates(learner.log_alpha, updates)
        return learner.replace(log_alpha=log_alpha, alpha_opt_state=opt_state)

    def update(learner: Learner, buffer: Buffer, key: PRNGKey) -> tuple[Learner, Losses]:
        """One SAC update on a batch sampled from the buffer."""
        key_batch, key_critic, key_actor = jax.random.split(key, 3)
        alpha = jnp.exp(learner.log_alpha)  # logged before this update changes it
        batch = buffer_sample(buffer, key_batch, config.batch_size)
        learner, critic_loss_value, q = update_critic(learner, batch, key_critic)
        learner, actor_loss_value, log_prob = update_actor(learner, batch.obs, key_actor)
        learner = update_temperature(learner, log_prob)
        learner = learner.replace(updates=learner.updates + 1)
        losses = Losses(
            critic_loss=critic_loss_value,
            actor_loss=actor_loss_value,
            alpha=alpha,
            q_mean=jnp.mean(q),
            entropy=-jnp.mean(log_prob),
        )
        return learner, losses

    def learn(learner: Learner, buffer: Buffer, key: PRNGKey) -> tuple[Learner, Losses]:
        """updates_per_step updates in a row; their losses averaged."""

        def one_update(learner: Learner, key: PRNGKey) -> tuple[Learner, Losses]:
            return update(learner, buffer, key)

        update_keys = jax.random.split(key, config.updates_per_step)
        learner, losses = jax.lax.scan(one_update, learner, update_keys)
        return learner, jax.tree.map(jnp.mean, losses)

    def wait(learner: Learner, buffer: Buffer, key: PRNGKey) -> tuple[Learner, Losses]:
        """No update during the warm-up (zero losses, masked out of the metrics)."""
        zero = jnp.float32(0.0)
        losses = Losses(critic_loss=zero, actor_loss=zero, alpha=zero, q_mean=zero, entropy=zero)
        return learner, losses

    def iteration(state: TrainState, index: Array):
        """Step every env, store the transitions, then update once past the warm-up. `index`
        (iterations so far) comes from the scan, not the state: equal across vmapped seeds, so
        the warm-up's lax.cond stays a branch instead of computing both sides."""
        key, key_action, key_envs, key_update = jax.random.split(state.key, 4)
        learning = index * num_envs >= config.learning_starts

        # COLLECT: the policy's actions, or uniformly random ones during the warm-up
        noise = jax.random.normal(key_action, (num_envs, action_dim))
        policy_action, _ = policy(state.learner.actor_params, state.obs, noise)
        # erf(z / sqrt 2) of a standard normal z is uniform on (-1, 1): one draw serves both.
        uniform = jax.scipy.special.erf(noise / jnp.sqrt(2.0))
        action = jnp.where(learning, policy_action, action_offset + action_scale * uniform)
        env_keys = jax.random.split(key_envs, num_envs)
        obs, env_state, reward, terminated, _, info = step_envs(
            env_keys, state.env_state, action, env_params
        )

        # STORE: final_observation is the pre-reset one, so a time-limit end still bootstraps
        transitions = Transition(
            obs=state.obs,
            action=action,
            reward=reward,
            next_obs=info["final_observation"],
            terminated=terminated.astype(jnp.float32),
        )
        buffer = buffer_add(state.buffer, transitions)

        # UPDATE NETWORKS
        learner, losses = jax.lax.cond(learning, learn, wait, state.learner, buffer, key_update)

        state = TrainState(
            learner=learner,
            buffer=buffer,
            env_state=env_state,
            obs=obs,
            key=key,
            env_steps=state.env_steps + num_envs,
        )
        episodes = (info["returned_episode"], info["episode_return"], info["episode_length"])
        return state, (episodes, learning, losses)

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """Chunk number `chunk` (from 0): iterations_per_chunk iterations in one scan."""
        indices = chunk * iterations_per_chunk + jnp.arange(iterations_per_chunk)
        state, (episodes, learning, losses) = jax.lax.scan(iteration, state, indices)
        episode_ended, episode_return, episode_length = episodes
        params = jax.tree.leaves(trained_params(state))
        metrics = Metrics(
            env_steps=state.env_steps,
            updates=state.learner.updates,
            episode_return=masked_mean(episode_return, episode_ended),
            episode_length=masked_mean(episode_length, episode_ended),
            critic_loss=masked_mean(losses.critic_loss, learning),
            actor_loss=masked_mean(losses.actor_loss, learning),
            alpha=masked_mean(losses.alpha, learning),
            q_mean=masked_mean(losses.q_mean, learning),
            entropy=masked_mean(losses.entropy, learning),
            params_finite=jnp.all(jnp.array([jnp.isfinite(x).all() for x in params])),
        )
        return state, metrics

    def train(key: PRNGKey) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(run_chunk, init(key), jnp.arange(num_chunks))

    return init, run_chunk, train


# ---- evaluation ----

GIF_ENVS = 4  # envs side by side in policy.gif
GIF_STRIDE = 2  # every second step: 25 frames per second of simulated time at the default tau
UPRIGHT_RADIANS = math.radians(12)  # "upright": |theta| below the angle at which balance fails


def make_deterministic_policy(config: Config):
    """(env, env_params, act(params, obs) -> the actor's mean action, squashed into the bounds)."""
    env, env_params = make_env(config)
    action_scale, action_offset = action_bounds(env, env_params)
    actor = Actor(config.hidden_sizes, env.action_space(env_params).shape[0])

    def act(params: Params, obs: Array) -> Array:
        mean, _ = actor.apply(params["actor"], obs)
        return action_offset + action_scale * jnp.tanh(mean)

    return env, env_params, act


def make_evaluate(config: Config):
    """evaluate(params, key) -> {"episode_return", "upright"}, each [eval_episodes], of the
    deterministic policy: whole episodes without auto-reset, rewards after a termination masked.
    "upright" is 1.0 where the pole stayed within UPRIGHT_RADIANS of vertical (the angle taken
    in [-pi, pi)), with the episode still running, at every step of the episode's second half."""
    env, env_params, act = make_deterministic_policy(config)
    num_episodes = config.eval_episodes
    num_steps = config.env.max_steps_in_episode
    step_envs = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))

    def evaluate(params: Params, key: PRNGKey) -> dict[str, Array]:
        key_reset, key_steps = jax.random.split(key)
        reset_keys = jax.random.split(key_reset, num_episodes)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

        def step(carry, inputs):
            obs, env_state, total, running, upright = carry
            keys, second_half = inputs
            obs, env_state, reward, terminated, _ = step_envs(
                keys, env_state, act(params, obs), env_params
            )
            total = total + jnp.where(running, reward, 0.0)
            running = running & ~terminated
            pole_up = jnp.abs(envs.angle_normalize(env_state.theta)) < UPRIGHT_RADIANS
            upright = upright & (~second_half | (running & pole_up))
            return (obs, env_state, total, running, upright), None

        running = jnp.ones(num_episodes, bool)
        carry = (obs, env_state, jnp.zeros(num_episodes), running, running)
        step_keys = jax.random.split(key_steps, (num_steps, num_episodes))
        second_half = jnp.arange(num_steps) >= num_steps // 2
        (_, _, total, _, upright), _ = jax.lax.scan(step, carry, (step_keys, second_half))
        return {"episode_return": total, "upright": upright.astype(jnp.float32)}

    return evaluate


def make_render(config: Config):
    """(render(params, key) -> uint8 frames [time, height, width, 3]: one episode of the
    deterministic policy in GIF_ENVS envs side by side, every GIF_STRIDE-th step, drawn by the
    env's renderer, an ended episode held where it ended; seconds of simulated time per frame)."""
    env, env_params, act = make_deterministic_policy(config)
    step_envs = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))
    draw = jax.vmap(jax.vmap(lambda env_state: env.render(env_state, env_params, 120, 180)))

    def render(params: Params, key: PRNGKey) -> Array:
        key_reset, key_steps = jax.random.split(key)
        reset_keys = jax.random.split(key_reset, GIF_ENVS)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

        def step(carry, keys):
            obs, env_state, running = carry
            obs, next_state, _, terminated, _ = step_envs(
                keys, env_state, act(params, obs), env_params
            )
            next_state = jax.tree.map(
                lambda new, old: jnp.where(running, new, old), next_state, env_state
            )
            return (obs, next_state, running & ~terminated), env_state

        carry = (obs, env_state, jnp.ones(GIF_ENVS, bool))
        step_keys = jax.random.split(key_steps, (config.env.max_steps_in_episode, GIF_ENVS))
        _, states = jax.lax.scan(step, carry, step_keys)
        images = draw(jax.tree.map(lambda x: x[::GIF_STRIDE], states))  # [time, env, h, w, 3]
        return jnp.concatenate(list(images.swapaxes(0, 1)), axis=2)  # the envs left to right

    return render, config.env.tau * GIF_STRIDE


# ---- command line: nothing below changes what is learned ----

SOLVED_RETURN = 475.0  # CartPole-v1's bar (gymnasium); swing-up is judged by "upright"
LOSS_COLUMNS = ("critic_loss", "actor_loss", "alpha", "q_mean", "entropy")  # checked for NaN
METRIC_COLUMNS = ("episode_return", "episode_length", *LOSS_COLUMNS)  # fields of Metrics
CSV_COLUMNS = ("seed", "env_steps", "updates", "wall_seconds", "sps", *METRIC_COLUMNS)
PROGRESS_COLUMNS = ("critic_loss", "actor_loss", "alpha")  # on each progress line after the return
# With --eval-only the checkpoint's config sets every field but these.
EVAL_ONLY_FIELDS = (
    "eval_episodes",
    "output_dir",
    "capture_gif",
    "plot",
    "load_model",
    "eval_only",
    "save_model",
    "compile_cache",
    "plot_every",
    "live",
    "track",
    "distributed",
    "coordinator_address",
    "num_processes",
    "process_id",
    "coordinator_timeout",
)


class UsageError(Exception):
    """A user error: reported as one line, exit status 2, no traceback."""


def require(holds: bool, name: str, allowed: str, value: Any) -> None:
    if not holds:
        raise UsageError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def validate(config: Config) -> None:
    """Raise UsageError naming the first bad flag and its allowed range; compiles nothing."""
    for name in ("num_seeds", "num_envs", "total_timesteps", "batch_size", "buffer_size"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("updates_per_step", "eval_episodes", "log_every"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name, value in dataclasses.asdict(config.env).items():
        require(value > 0, f"env.{name}", "> 0", value)
    require(
        0 <= config.seed < 2**31 - config.num_seeds,
        "seed",
        "in [0, 2**31 - num-seeds)",
        config.seed,
    )
    require(config.learning_rate > 0, "learning_rate", "> 0", config.learning_rate)
    require(
        config.plot_every >= 0,
        "plot_every",
        ">= 0 (seconds; 0: at the end only)",
        config.plot_every,
    )
    cluster = (config.coordinator_address, config.num_processes, config.process_id)
    if not config.distributed and cluster != (None, None, None):
        raise UsageError(
            "--coordinator-address, --num-processes and --process-id go with --distributed"
        )
    if config.coordinator_address is not None:
        host, _, port = config.coordinator_address.rpartition(":")
        address_ok = bool(host) and port.isdigit() and 0 < int(port) < 2**16
        where = "HOST:PORT (process 0's address and a free port on it)"
        require(address_ok, "coordinator_address", where, config.coordinator_address)
    if config.num_processes is not None:
        require(config.num_processes >= 1, "num_processes", ">= 1", config.num_processes)
    if config.process_id is not None:
        count = config.num_processes
        allowed = f"in [0, {count}) (--num-processes {count})" if count else ">= 0"
        require(0 <= config.process_id < (count or 2**31), "process_id", allowed, config.process_id)
    require(
        config.coordinator_timeout > 0, "coordinator_timeout", "> 0", config.coordinator_timeout
    )
    require(0 < config.gamma <= 1, "gamma", "in (0, 1]", config.gamma)
    require(0 < config.tau <= 1, "tau", "in (0, 1]", config.tau)
    require(
        config.buffer_size >= config.num_envs, "buffer_size", ">= --num-envs", config.buffer_size
    )
    require(
        config.batch_size <= config.buffer_size, "batch_size", "<= --buffer-size", config.batch_size
    )
    max_grad_norm_ok = config.max_grad_norm is None or config.max_grad_norm > 0
    require(max_grad_norm_ok, "max_grad_norm", "> 0 or None", config.max_grad_norm)
    widths_ok = len(config.hidden_sizes) > 0 and min(config.hidden_sizes) >= 1
    require(widths_ok, "hidden_sizes", "one or more widths >= 1", config.hidden_sizes)
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    chunk_steps = iterations_per_chunk * config.num_envs
    trained_steps = num_chunks * chunk_steps
    if not config.eval_only:
        one_chunk = f">= one chunk ({chunk_steps} env steps, see --log-every)"
        require(num_chunks >= 1, "total_timesteps", one_chunk, config.total_timesteps)
        starts_ok = 0 <= config.learning_starts < trained_steps
        trained = f"in [0, {trained_steps}) (the env steps trained)"
        require(starts_ok, "learning_starts", trained, config.learning_starts)
    if config.eval_only != (config.load_model is not None):
        raise UsageError("--eval-only and --load-model PATH go together (evaluate a checkpoint)")
    exists = config.load_model is None or Path(config.load_model).is_file()
    require(exists, "load_model", "an existing file", config.load_model)


def float_fields(config_type: type, prefix: str = "") -> tuple[str, ...]:
    hints = get_type_hints(config_type)
    return tuple(prefix + name for name, hint in hints.items() if hint in (float, float | None))


# Fields --sweep may vary: the floats (rates, coefficients, env physics) set no shape and no
# Python branch, so they can be traced values inside the one vmapped program.
SWEEPABLE = tuple(
    name
    for name in float_fields(Config) + float_fields(EnvConfig, "env.")
    if name not in EVAL_ONLY_FIELDS  # --plot-every changes no run
)
Point = dict[str, float]  # one grid point: a value per swept field


def with_values(config: Config, point: dict[str, Any]) -> Config:
    """`config` with the swept fields set (floats, or traced values inside the program)."""
    top = {name: value for name, value in point.items() if not name.startswith("env.")}
    env = {name[4:]: value for name, value in point.items() if name.startswith("env.")}
    return dataclasses.replace(config, **top, env=dataclasses.replace(config.env, **env))


def describe(point: Point) -> str:
    return " ".join(f"{name.replace('_', '-')}={value:g}" for name, value in point.items())


def sweep_grid(config: Config) -> list[Point]:
    """Every combination of the --sweep values, in order (one empty point without --sweep).
    UsageError for a name that cannot be swept, a value that is not a number or that validate
    rejects, and a run count (points x seeds) that does not divide over the devices."""
    values: dict[str, list[float]] = {}
    for entry in config.sweep:
        flag, _, listed = entry.partition("=")
        name = flag.removeprefix("--").replace("-", "_")
        if name not in SWEEPABLE:
            sweepable = ", ".join(name.replace("_", "-") for name in SWEEPABLE)
            raise UsageError(f"--sweep {entry}: {flag} cannot be swept; these can: {sweepable}")
        if name in values:
            raise UsageError(f"--sweep {entry}: {flag} is swept twice")
        try:
            values[name] = [float(value) for value in listed.split(",")]
        except ValueError:
            raise UsageError(f"--sweep {entry}: expected {flag}=V1,V2,... (numbers)") from None
        if len(set(values[name])) < len(values[name]):
            raise UsageError(f"--sweep {entry}: a value of {flag} is listed twice")
    combinations = itertools.product(*values.values())
    grid = [dict(zip(values, combination, strict=True)) for combination in combinations]
    for number, point in enumerate(grid, start=1):
        try:
            validate(with_values(config, point))
        except UsageError as error:
            where = f"grid point {number} of {len(grid)} ({describe(point)})"
            raise UsageError(f"--sweep {where}: {error}") from None
    runs = len(grid) * config.num_seeds
    devices = jax.device_count()  # of every process
    processes = f" of {jax.process_count()} processes" if jax.process_count() > 1 else ""
    if runs % devices and config.sweep:
        message = f"{len(grid)} grid points x {config.num_seeds} seed(s) = {runs} runs"
        raise UsageError(f"--sweep: {message}, not a multiple of the {devices} devices{processes}")
    multiple = f"a multiple of the {devices} devices{processes}"
    require(runs % devices == 0, "num_seeds", multiple, runs)
    return grid


def run_values(grid: list[Point], num_seeds: int) -> dict[str, np.ndarray]:
    """Per swept field, its value in every run (grid point major, then seed)."""
    return {
        name: np.repeat(np.array([point[name] for point in grid], np.float32), num_seeds)
        for name in grid[0]
    }


def enable_compile_cache(config: Config) -> str:
    """Turn on JAX's persistent compilation cache (a rerun loads its programs instead of compiling
    them); returns where it is, or why it is off."""
    if not config.compile_cache:  # (JAX itself still reads $JAX_COMPILATION_CACHE_DIR if set)
        return "off (--no-compile-cache)"
    default = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "jax-rl-scripts"
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR") or str(default)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small CPU programs too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    jax.config.update("jax_compilation_cache_max_size", 2**30)  # the least recently used go first
    return path


def start_distributed(config: Config) -> None:
    """Join JAX's distributed runtime, before anything touches a device: jax.devices() then
    lists every device of every process. UsageError without a cluster to detect and without
    --coordinator-address; ends the process with one line when the processes have not all
    joined within --coordinator-timeout (jax itself would abort with a C++ stack trace)."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPUs across processes

    def give_up() -> None:
        at = f" at {config.coordinator_address}" if config.coordinator_address else ""
        print(
            f"{SCRIPT}.py: error: --distributed: the processes did not all reach the coordinator"
            f"{at} within {config.coordinator_timeout:g} s (--coordinator-timeout); is every "
            "process started, with the same --coordinator-address and --num-processes?",
            file=sys.stderr,
            flush=True,
        )
        os._exit(2)  # the main thread waits inside jax's C++ client: no exception reaches it

    timer = threading.Timer(config.coordinator_timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        jax.distributed.initialize(
            config.coordinator_address,
            config.num_processes,
            config.process_id,
            initialization_timeout=int(config.coordinator_timeout) + 60,  # the timer ends first
        )
    except ValueError as error:  # no cluster detected and not enough flags to go without one
        flags = "--coordinator-address HOST:PORT --num-processes N --process-id I"
        message = f"no cluster detected (SLURM, Open MPI, ...) and not all of {flags}"
        raise UsageError(f"--distributed: {message} (jax: {error})") from None
    finally:
        timer.cancel()


def is_lead() -> bool:
    """Process 0 prints and writes for every process (the only process without --distributed)."""
    return jax.process_index() == 0


def fetch(tree: Any) -> Any:
    """Every run's values as numpy arrays, on every process: without --distributed a copy from
    the devices, with it a collective that every process calls at the same point."""
    return multihost_utils.process_allgather(tree, tiled=True)


def first_run(tree: Any) -> Any:
    """Run 0 of every array, from the first device of process 0 (the lead process takes it
    without the others)."""
    return jax.tree.map(lambda x: x.addressable_data(0)[0], tree)


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """write(temporary path), then a rename: a reader never sees a half-written file."""
    temporary = path.with_name(f".{path.name}.tmp")
    write(temporary)
    os.replace(temporary, path)


def write_csv(path: Path, rows: list[dict], columns: Sequence[str]) -> None:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=columns)
    writer.writeheader()
    writer.writerows(rows)
    write_atomic(path, lambda temporary: temporary.write_text(text.getvalue()))


def write_json(path: Path, values: dict) -> None:
    write_atomic(path, lambda temporary: temporary.write_text(json.dumps(values, indent=2) + "\n"))


def plot_curves(path: Path, config: Config, rows: list[dict]) -> None:
    """Every metric against env steps: per grid point (one without --sweep), the mean over its
    seeds and the min-max band."""
    from matplotlib.figure import Figure  # imported here: it is slow to import

    columns = METRIC_COLUMNS
    swept = [name for name in SWEEPABLE if name in rows[0]]
    runs: dict[str, dict[int, list[dict]]] = {}  # grid point -> seed -> the run's rows
    for row in rows:
        point = describe({name: row[name] for name in swept})
        runs.setdefault(point, {}).setdefault(row["seed"], []).append(row)
    figure = Figure(figsize=(13, 3.2 * -(-len(columns) // 3)), layout="constrained")
    axes = figure.subplots(-(-len(columns) // 3), 3, squeeze=False).flat
    for axis, name in zip(axes, columns, strict=False):
        for point, seeds in runs.items():
            steps = np.array([row["env_steps"] for row in next(iter(seeds.values()))])
            values = np.array([[row[name] for row in run] for run in seeds.values()])
            shown = np.isfinite(values).any(axis=0)  # chunks without episodes or updates are NaN
            axis.plot(steps[shown], np.nanmean(values[:, shown], axis=0), label=point)
            low, high = np.nanmin(values[:, shown], axis=0), np.nanmax(values[:, shown], axis=0)
            axis.fill_between(steps[shown], low, high, alpha=0.25)
        axis.set(title=name, xlabel="env steps")
    axes[0].axhline(SOLVED_RETURN, color="gray", linestyle="--", linewidth=1)
    if swept and len(runs) <= 12:
        axes[0].legend(fontsize="small")
    for axis in axes[len(columns) :]:
        axis.set_visible(False)
    grid = f"{len(runs)} grid points x " if swept else ""
    figure.suptitle(f"{SCRIPT} on {env_name(config)}, {grid}{config.num_seeds} seed(s)")
    write_atomic(path, lambda temporary: figure.savefig(temporary, format="png", dpi=80))


def sweep_report(grid: list[Point], returns: np.ndarray) -> list[dict]:
    """Per grid point: its values and its seeds' final returns, their mean and spread, and the
    fraction of seeds at the solved bar."""
    per_point = returns.reshape(len(grid), -1)
    return [
        {
            "values": point,
            "final_returns": point_returns.tolist(),
            "mean": float(point_returns.mean()),
            "std": float(point_returns.std()),
            "solved_fraction": float((point_returns >= SOLVED_RETURN).mean()),
        }
        for point, point_returns in zip(grid, per_point, strict=True)
    ]


def return_curves(rows: list[dict], swept: Sequence[str]) -> dict[str, tuple[list, list]]:
    """Per grid point: the env steps of the chunks that ended episodes, and there the training
    return averaged over the point's seeds."""
    by_point: dict[str, dict[int, list[float]]] = {}
    for row in rows:
        if np.isfinite(row["episode_return"]):
            point = describe({name: row[name] for name in swept})
            by_point.setdefault(point, {}).setdefault(row["env_steps"], []).append(
                row["episode_return"]
            )
    return {
        point: (list(returns), [float(np.mean(values)) for values in returns.values()])
        for point, returns in by_point.items()
    }


def write_sweep(out: Path, config: Config, report: list[dict], rows: list[dict]) -> None:
    """sweep.csv (a row per grid point) and, unless --no-plot, sweep.png: with one swept field
    the final return against its value and the return curves per value, with two a heatmap of
    the mean, with more the grid points ranked (no curves without training `rows`)."""
    from matplotlib.figure import Figure

    names = list(report[0]["values"])
    table = [
        {
            **entry["values"],
            "mean": round(entry["mean"], 3),  # summary.json keeps every digit
            "std": round(entry["std"], 3),
            "solved_fraction": entry["solved_fraction"],
            "final_returns": " ".join(f"{value:g}" for value in entry["final_returns"]),
        }
        for entry in report
    ]
    write_csv(out / "sweep.csv", table, list(table[0]))
    if not config.plot:
        return
    means = np.array([entry["mean"] for entry in report])
    title = f"{SCRIPT} on {env_name(config)}: final return, {config.num_seeds} seed(s) per point"
    if len(names) == 1:  # with the training curves beside, when there are rows (not --eval-only)
        figure = Figure(figsize=(12 if rows else 6, 4), layout="constrained")
        left, right = figure.subplots(1, 2) if rows else (figure.subplots(), None)
        values = np.array([entry["values"][names[0]] for entry in report])
        for value, entry in zip(values, report, strict=True):
            seeds = entry["final_returns"]
            left.scatter([value] * len(seeds), seeds, color="gray", s=12, zorder=2)
        left.plot(values, means, marker="o", zorder=3, label="mean over seeds")
        if values.min() > 0 and values.max() >= 10 * values.min():
            left.set_xscale("log")
        left.axhline(SOLVED_RETURN, color="gray", linestyle="--", linewidth=1)
        left.set(xlabel=names[0].replace("_", "-"), ylabel="final return")
        left.legend(fontsize="small")
        for point, (steps, returns) in return_curves(rows, names).items():
            right.plot(steps, returns, label=point)
            right.legend(fontsize="small")
        if right is not None:
            right.set(xlabel="env steps", ylabel="training return (mean over seeds)")
    elif len(names) == 2:
        rows_of, columns_of = ([entry["values"][name] for entry in report] for name in names)
        row_values, column_values = sorted(set(rows_of)), sorted(set(columns_of))
        heat = np.full((len(row_values), len(column_values)), np.nan)
        for row_value, column_value, mean in zip(rows_of, columns_of, means, strict=True):
            heat[row_values.index(row_value), column_values.index(column_value)] = mean
        figure = Figure(
            figsize=(1.2 * len(column_values) + 3, 0.8 * len(row_values) + 2), layout="constrained"
        )
        axis = figure.subplots()
        image = axis.imshow(heat, cmap="viridis", aspect="auto")
        middle = np.nanmean(heat)
        for (i, j), mean in np.ndenumerate(heat):
            color = "black" if mean > middle else "white"  # readable on viridis' light and dark
            axis.text(j, i, f"{mean:.0f}", ha="center", va="center", color=color)
        axis.set_xticks(range(len(column_values)), [f"{value:g}" for value in column_values])
        axis.set_yticks(range(len(row_values)), [f"{value:g}" for value in row_values])
        axis.set(xlabel=names[1].replace("_", "-"), ylabel=names[0].replace("_", "-"))
        figure.colorbar(image, label="mean final return")
    else:
        order = np.argsort(means)
        figure = Figure(figsize=(10, 0.3 * len(report) + 1.5), layout="constrained")
        axis = figure.subplots()
        stds = np.array([report[i]["std"] for i in order])
        base = min((means - stds).min(), SOLVED_RETURN)  # bars grow from below the worst point
        base -= 0.05 * (means.max() - base + 1)
        axis.barh(range(len(order)), means[order] - base, left=base, xerr=stds, color="tab:blue")
        axis.set_yticks(range(len(order)), [describe(report[i]["values"]) for i in order])
        axis.axvline(SOLVED_RETURN, color="gray", linestyle="--", linewidth=1)
        axis.set(xlabel="final return (mean ± std over seeds)")
    figure.suptitle(title)
    write_atomic(
        out / "sweep.png", lambda temporary: figure.savefig(temporary, format="png", dpi=80)
    )


def write_gif(path: Path, frames: np.ndarray, seconds_per_frame: float) -> None:
    """Frames [time, height, width, 3] as an animated GIF playing in real time."""
    from PIL import Image  # matplotlib's dependency

    images = [Image.fromarray(frame) for frame in frames]
    # One palette for every frame, from frames across the whole GIF (a snake's body gradient,
    # say, may not be on the first one).
    sample = np.concatenate(frames[:: max(len(frames) // 8, 1)], axis=0)
    palette = Image.fromarray(sample).quantize(colors=32)
    images = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    duration = round(1000 * seconds_per_frame)
    write_atomic(
        path,
        lambda temporary: images[0].save(
            temporary,
            format="GIF",
            save_all=True,
            append_images=images[1:],
            duration=duration,
            loop=0,
        ),
    )


def save_checkpoint(path: Path, config: Config, grid: list[Point], params: Params) -> None:
    """Every run's parameters (numpy arrays, leading run axis), with the config and each run's
    seed and grid point."""
    runs = [
        {"seed": config.seed + seed, **point} for point in grid for seed in range(config.num_seeds)
    ]
    payload = {
        "script": SCRIPT,
        "env": env_name(config),
        "config": json.dumps(dataclasses.asdict(config)),
        "runs": runs,
        "params": flax.serialization.to_state_dict(params),
    }
    payload_bytes = flax.serialization.msgpack_serialize(payload)
    write_atomic(path, lambda temporary: temporary.write_bytes(payload_bytes))


def flag_values(config: Config) -> dict[str, Any]:
    """Every field under its command-line name (the env's as env.<name>)."""
    values = {name: value for name, value in vars(config).items() if name != "env"}
    return values | {f"env.{name}": value for name, value in vars(config.env).items()}


def load_checkpoint(config: Config) -> tuple[Config, Params]:
    """(the checkpoint's config with this command's evaluation and output flags, every seed's
    parameters). UsageError for a file that is not this script's checkpoint, or for a flag
    that the checkpoint's config would silently override."""
    try:
        payload = flax.serialization.msgpack_restore(Path(config.load_model).read_bytes())
        script = payload["script"]
        env = payload["env"]
        if script == SCRIPT:
            saved = json.loads(payload["config"])
            saved = {
                key: tuple(value) if isinstance(value, list) else value
                for key, value in saved.items()
            }
            saved = Config(**{**saved, "env": EnvConfig(**saved["env"])})
    except Exception as error:  # whatever is wrong with the file, it is the same user error
        message = f"--load-model {config.load_model} is not a model.msgpack"
        raise UsageError(f"{message} ({type(error).__name__})") from None
    if script != SCRIPT:
        message = f"--load-model {config.load_model} is a {script} checkpoint for {env}"
        raise UsageError(f"{message}, not {SCRIPT}'s")
    given = flag_values(config)
    # The defaults this command parsed over: the task's own (see parse_config).
    defaults = dataclasses.replace(default_config(config.env_id), env_id=Config().env_id)
    defaults = flag_values(defaults)
    checkpoint = flag_values(saved)
    for name, value in given.items():
        if name not in EVAL_ONLY_FIELDS and value not in (defaults[name], checkpoint[name]):
            flag = "--" + name.replace("_", "-")
            raise UsageError(f"{flag} is set by the checkpoint with --eval-only; leave it out")
    evaluation = {name: getattr(config, name) for name in EVAL_ONLY_FIELDS}
    config = dataclasses.replace(saved, **evaluation)
    validate(config)  # the checkpoint's values meet this script's ranges too
    return config, payload["params"]  # numpy arrays: main puts each process's runs on its devices


class SeedKeys(NamedTuple):
    """Per run (leading axis: grid points x seeds), three independent keys split once from the
    run's seed."""

    train: PRNGKey
    evaluate: PRNGKey
    render: PRNGKey


def seed_keys(config: Config, num_points: int = 1) -> SeedKeys:
    """Run r (grid point r // num_seeds) is the run of --seed (seed + r % num_seeds) alone."""
    seeds = config.seed + jnp.arange(num_points * config.num_seeds) % config.num_seeds
    keys = jax.vmap(lambda seed: jax.random.split(jax.random.key(seed), 3))(seeds)
    return SeedKeys(train=keys[:, 0], evaluate=keys[:, 1], render=keys[:, 2])


def stop_on_ctrl_c() -> threading.Event:
    """The first Ctrl-C asks the training loop to stop after the chunk in progress; a second one
    aborts at once."""
    stop = threading.Event()

    def request_stop(signum: int, frame: Any) -> None:
        if stop.is_set():
            raise KeyboardInterrupt
        stop.set()
        terminal = sys.stdout if is_lead() else sys.stderr  # a worker's stdout goes nowhere
        print(
            "\nCtrl-C: stopping after this chunk (press again to abort)", file=terminal, flush=True
        )

    signal.signal(signal.SIGINT, request_stop)
    return stop


def start_drawing_process() -> None:
    """The drawing process runs at the lowest CPU priority (it takes what training leaves) and
    ignores Ctrl-C: a terminal sends it to every process of the run, and the training process
    decides when to stop (after the chunk, with every output written)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "nice"):
        os.nice(19)


class Watch:
    """What a run shows while it trains, off the chunk loop's critical path: curves.png at most
    every --plot-every seconds; with --live the first run's current policy after every chunk
    (live.gif, and a window where a display exists); with --track TensorBoard scalars per run
    (one event directory per seed and grid point). Only the lead process shows anything. A
    thread waits on the drawings, which a second process at low priority makes: drawn on a
    thread of this one, matplotlib's Python held the GIL that the chunk loop needs and cost a
    third of the training speed (docs/benchmarks.md)."""

    def __init__(self, config: Config, grid: list[Point], out: Path, keys: SeedKeys) -> None:
        self.config = config
        self.out = out
        self.shows = is_lead()
        self.painter = ThreadPoolExecutor(1)
        spawn = multiprocessing.get_context("spawn")  # forking a process that runs JAX can hang
        self.drawer = ProcessPoolExecutor(1, mp_context=spawn, initializer=start_drawing_process)
        self.drawing: Future | None = None
        self.last_plot = time.perf_counter()
        self.writers = open_tensorboard(config, grid, out) if config.track and self.shows else []
        self.window: LiveWindow | None = None
        if config.live and self.shows:
            render, self.seconds_per_frame = make_render(with_values(config, grid[0]))
            self.render = jax.jit(render)  # compiled once, on the painter thread
            self.render_key = first_run(keys.render)
            self.window = LiveWindow.open(f"{SCRIPT} on {env_name(config)}")

    def after_chunk(self, rows: list[dict], new_rows: list[dict], state: TrainState) -> None:
        """Write metrics.csv, log the chunk's rows to TensorBoard and, unless the last drawing
        is still busy, draw what is due; returns at once."""
        if not self.shows:
            return
        write_csv(self.out / "metrics.csv", rows, list(rows[0]))  # valid if the run stops
        if self.writers:
            self.log(new_rows)
        if self.drawing is not None and not self.drawing.done():
            return
        now = time.perf_counter()
        plot_due = self.config.plot and 0 < self.config.plot_every <= now - self.last_plot
        if plot_due:
            self.last_plot = now
        params = None
        if self.config.live:  # the first run's parameters, copied before the state is donated
            params = first_run(trained_params(state))
        if plot_due or params is not None:
            self.drawing = self.painter.submit(self.draw, list(rows), plot_due, params)

    def log(self, new_rows: list[dict]) -> None:
        """Every metrics.csv column of the chunk as a TensorBoard scalar, a row per run."""
        for writer, row in zip(self.writers, new_rows, strict=True):
            for name in ("updates", "wall_seconds", "sps", *METRIC_COLUMNS):
                if np.isfinite(row[name]):
                    group = "losses" if name in LOSS_COLUMNS else "charts"
                    writer.add_scalar(f"{group}/{name}", row[name], row["env_steps"])

    def draw(self, rows: list[dict], plot_due: bool, params: Params | None) -> None:
        if plot_due:
            self.drawer.submit(plot_curves, self.out / "curves.png", self.config, rows).result()
        if params is not None:
            frames = np.asarray(self.render(params, self.render_key))
            gif = (self.out / "live.gif", frames, self.seconds_per_frame)
            self.drawer.submit(write_gif, *gif).result()
            if self.window is not None:
                self.window.show(rows, frames)

    def wait(self, future: Future) -> Any:
        """The future's result; with the window open, its events run while the chunk does."""
        while self.window is not None and not future.done():
            if not self.window.tick(0.05):
                print(f"{SCRIPT}: live window closed; training goes on", flush=True)
                self.window = None
        return future.result()

    def settle(self) -> None:
        """Wait for the drawing in progress (the final curves.png is drawn after it)."""
        if self.drawing is not None:
            self.drawing.result()
        self.drawer.shutdown()

    def close(self, steps: int, per_run: dict[str, np.ndarray]) -> None:
        """Log the evaluation (per run, at the last env step) to TensorBoard and close it."""
        for run, writer in enumerate(self.writers):
            for name, values in per_run.items():
                writer.add_scalar(f"eval/{name}", values[run], steps)
            writer.close()


def open_tensorboard(config: Config, grid: list[Point], out: Path) -> list:
    """A tensorboardX writer per run in out/tensorboard/<seed and grid point>, each with the
    config as text: `tensorboard --logdir runs` compares every run of every script."""
    from tensorboardX import SummaryWriter  # optional: main checked that it is installed

    text = "```\n" + json.dumps(dataclasses.asdict(config), indent=2) + "\n```"
    writers = []
    for point in grid:
        for seed in range(config.seed, config.seed + config.num_seeds):
            name = "_".join([f"seed{seed}", *describe(point).split()])
            writer = SummaryWriter(str(out / "tensorboard" / name))
            writer.add_text("config", text)
            writers.append(writer)
    return writers


class LiveWindow:
    """A matplotlib window: the return curve per grid point beside the first run's policy,
    animated while training runs. Every call comes from the main thread (GUI toolkits need it)
    except show(), which only hands over data."""

    @staticmethod
    def open(title: str) -> "LiveWindow | None":
        import matplotlib.pyplot as plt

        if plt.get_backend().lower() in ("agg", "pdf", "ps", "svg", "cairo", "template"):
            print(f"{SCRIPT}: --live: no display here; live.gif shows the policy", flush=True)
            return None
        return LiveWindow(plt, title)

    def __init__(self, plt: Any, title: str) -> None:
        self.plt = plt
        self.figure, (self.curves, self.policy) = plt.subplots(1, 2, figsize=(12, 4.5))
        self.figure.suptitle(title)
        self.image = None
        self.latest: tuple[list[dict], np.ndarray] | None = None
        self.shown_rows = 0
        self.frame = 0
        plt.show(block=False)

    def show(self, rows: list[dict], frames: np.ndarray) -> None:
        self.latest = (rows, frames)

    def tick(self, seconds: float) -> bool:
        """Redraw what changed and the next policy frame; False once the window is closed."""
        if not self.plt.fignum_exists(self.figure.number):
            return False
        if self.latest is not None:
            rows, frames = self.latest
            if len(rows) != self.shown_rows:
                self.shown_rows = len(rows)
                self.curves.clear()
                swept = [name for name in SWEEPABLE if name in rows[0]]
                for point, (steps, returns) in return_curves(rows, swept).items():
                    self.curves.plot(steps, returns, label=point or None)
                self.curves.set(xlabel="env steps", ylabel="training return (mean over seeds)")
            self.frame = (self.frame + 1) % len(frames)
            if self.image is None:
                self.image = self.policy.imshow(frames[0])
                self.policy.set_axis_off()
            self.image.set_data(frames[self.frame])
        self.plt.pause(seconds)
        return True


def train_and_log(
    config: Config,
    grid: list[Point],
    sharding: NamedSharding,
    out: Path,
    keys: PRNGKey,
    values: dict[str, Array],
    watch: Watch,
):
    """The CLI's training: every run (grid point x seed) in one program, the jitted, vmapped
    run_chunk once per chunk with the train state donated (updated in place, never copied), a
    progress line and the metrics rows in between, with every run's metrics on every process
    (--distributed). Returns (final state, rows, summary); exits on a non-finite value."""

    def init(key: PRNGKey, values: dict[str, Array]) -> TrainState:
        return make_train(with_values(config, values))[0](key)

    def run_chunk(state: TrainState, chunk: Array, values: dict[str, Array]):
        return make_train(with_values(config, values))[1](state, chunk)

    def gather(metrics: Metrics, stop: threading.Event) -> tuple[Metrics, bool]:
        """Every run's metrics of the chunk, and whether any process was asked to stop."""
        jax.block_until_ready(metrics)  # Ctrl-C during the chunk counts for this chunk
        metrics, stops = fetch((metrics, np.array([stop.is_set()])))
        return metrics, bool(stops.any())

    iterations_per_chunk, num_chunks = chunk_sizes(config)
    num_runs = len(grid) * config.num_seeds
    state_shape = jax.eval_shape(jax.vmap(init), keys, values)
    state_mb = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state_shape)) / 2**20
    devices = sharding.mesh.devices.flat
    points = f"{len(grid)} grid points x " if config.sweep else ""
    processes = f" of {jax.process_count()} processes" if jax.process_count() > 1 else ""
    print(
        f"{SCRIPT}: {env_name(config)}, {points}{config.num_seeds} seed(s) x {config.num_envs} "
        f"envs on {sharding.mesh.size} device(s){processes} ({devices[0].device_kind}), "
        f"{num_chunks} chunks of {iterations_per_chunk} iterations; train state "
        f"{state_mb / num_runs:.1f} MB per run",
        flush=True,
    )
    start = time.perf_counter()
    # init compiles on a second thread beside the chunk function (XLA compiles on one core).
    init_fn = jax.jit(jax.vmap(init), in_shardings=sharding, out_shardings=sharding)
    init_compiling = ThreadPoolExecutor(1).submit(init_fn.lower(keys, values).compile)
    replicated = NamedSharding(sharding.mesh, PartitionSpec())
    chunk_fn = jax.jit(
        jax.vmap(run_chunk, in_axes=(0, None, 0)),
        in_shardings=(sharding, replicated, sharding),
        out_shardings=sharding,
        donate_argnums=0,
    )
    chunk_fn = chunk_fn.lower(state_shape, jnp.int32(0), values).compile()
    state = init_compiling.result()(keys, values)
    compile_seconds = time.perf_counter() - start
    print(f"compiled in {compile_seconds:.1f} s", flush=True)

    stop = stop_on_ctrl_c()
    waiter = ThreadPoolExecutor(1)
    rows: list[dict] = []
    steps = 0
    updates = 0
    start = time.perf_counter()
    last = start
    for chunk in range(num_chunks):
        state, metrics = chunk_fn(state, jnp.int32(chunk), values)
        # Waits for the chunk (a few numbers per run come back) in a thread: Ctrl-C is heard now.
        metrics, stopped = watch.wait(waiter.submit(gather, metrics, stop))
        now = time.perf_counter()
        elapsed = now - start
        sps = (int(metrics.env_steps[0]) - steps) / (now - last)
        updates_per_second = (int(metrics.updates[0]) - updates) / (now - last)
        did_update = int(metrics.updates[0]) > updates
        steps = int(metrics.env_steps[0])
        updates = int(metrics.updates[0])
        last = now
        for run in range(num_runs):
            row = {name: float(getattr(metrics, name)[run]) for name in METRIC_COLUMNS}
            rows.append(
                {  # the metrics.csv columns, in order: the swept values after the seed
                    "seed": config.seed + run % config.num_seeds,
                    **grid[run // config.num_seeds],
                    "env_steps": steps,
                    "updates": updates,
                    "wall_seconds": round(elapsed, 3),
                    "sps": round(sps, 1),
                    **row,
                }
            )
        watch.after_chunk(rows, rows[-num_runs:], state)
        returns = metrics.episode_return
        shown = "-" if np.isnan(returns).all() else f"{np.nanmean(returns):.1f}"
        if num_runs > 1 and not np.isnan(returns).all():
            shown += f" ± {np.nanstd(returns):.1f} (min {np.nanmin(returns):.1f})"
        if config.sweep and np.isfinite(returns).all():
            point_means = returns.reshape(len(grid), config.num_seeds).mean(axis=1)
            best, worst = grid[np.argmax(point_means)], grid[np.argmin(point_means)]
            shown += f" | best {describe(best)} {point_means.max():.1f}"
            shown += f", worst {describe(worst)} {point_means.min():.1f}"
        others = " ".join(
            f"{name} {np.mean(getattr(metrics, name)):.3g}" for name in PROGRESS_COLUMNS
        )
        eta = elapsed / (chunk + 1) * (num_chunks - chunk - 1)
        total_steps = steps // (chunk + 1) * num_chunks  # every chunk has as many steps
        print(
            f"steps {steps:,}/{total_steps:,} ({steps / total_steps:.0%}) | SPS {sps:,.0f} | "
            f"updates/s {updates_per_second:,.0f} | return {shown} | {others} | "
            f"{elapsed:.1f} s, ETA {eta:.1f} s",
            flush=True,
        )
        finite = {"parameter": metrics.params_finite}
        if did_update:
            finite |= {name: np.isfinite(getattr(metrics, name)) for name in LOSS_COLUMNS}
        for name, ok in finite.items():
            if not ok.all():
                run = int(np.argmin(ok))
                seed = config.seed + run % config.num_seeds
                point = f" ({describe(grid[run // config.num_seeds])})" if config.sweep else ""
                if is_lead():  # every process stops here: they all have every run's metrics
                    print(
                        f"{SCRIPT}: non-finite {name} in chunk {chunk + 1}, seed {seed}{point}; "
                        f"stopped (the files in {out} hold the chunks so far)",
                        file=sys.stderr,
                    )
                sys.exit(1)
        if stopped:
            if not stop.is_set():  # (each process hears its own Ctrl-C)
                print(f"{SCRIPT}: Ctrl-C on another process: stopped after this chunk", flush=True)
            break
    train_seconds = time.perf_counter() - start
    watch.settle()
    signal.signal(signal.SIGINT, signal.default_int_handler)
    summary = {
        "train_seconds": train_seconds,
        "compile_seconds": compile_seconds,
        "env_steps": steps,
        "updates": updates,
        "env_steps_per_second": steps / train_seconds,
        "updates_per_second": updates / train_seconds,
        "stopped_early": stopped,
    }
    return state, rows, summary


def main(config: Config) -> None:
    compile_cache = enable_compile_cache(config)  # before anything starts JAX's backend
    try:
        validate(config)
        params = None
        if config.eval_only:
            config, params = load_checkpoint(config)
        if config.distributed:
            start_distributed(config)
        grid = sweep_grid(config)
        if config.track and importlib.util.find_spec("tensorboardX") is None:
            raise UsageError("--track needs tensorboardX: pip install tensorboardX")
    except UsageError as error:
        print(f"{SCRIPT}.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    if not is_lead():
        print(
            f"{SCRIPT}: process {jax.process_index()} of {jax.process_count()}, a worker with "
            f"{jax.local_device_count()} device(s); process 0 prints progress and writes the "
            "outputs",
            flush=True,
        )
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # process 0 speaks
    print(f"compile cache: {compile_cache}", flush=True)
    devices = jax.devices()  # of every process: the runs are sharded over all of them
    sharding = NamedSharding(Mesh(np.array(devices), ("runs",)), PartitionSpec("runs"))
    out = Path(config.output_dir or f"runs/{SCRIPT}__{config.seed}__{int(time.time())}")
    if is_lead():
        out.mkdir(parents=True, exist_ok=True)
        write_json(out / "config.json", dataclasses.asdict(config))
    num_runs = len(grid) * config.num_seeds
    # Each process computes and holds only the keys and values of its own runs.
    keys = jax.jit(seed_keys, static_argnums=(0, 1), out_shardings=sharding)(config, len(grid))
    values = jax.device_put(run_values(grid, config.num_seeds), sharding)
    watch = Watch(config, grid, out, keys)

    def evaluate_run(params: Params, key: PRNGKey, values: dict[str, Array]) -> dict[str, Array]:
        return make_evaluate(with_values(config, values))(params, key)

    evaluate = jax.jit(jax.vmap(evaluate_run), in_shardings=sharding, out_shardings=sharding)
    summary: dict[str, Any] = {"eval_only": config.eval_only, "stopped_early": False}
    if config.eval_only:
        print(f"{SCRIPT}: evaluating {num_runs} run(s) of {config.load_model}", flush=True)
        params = jax.device_put(params, sharding)
    else:
        # The evaluation compiles on a second thread while the chunks run.
        init = make_train(config)[0]
        params_shape = jax.eval_shape(jax.vmap(lambda key: trained_params(init(key))), keys.train)
        evaluate = evaluate.lower(params_shape, keys.evaluate, values)
        evaluate = ThreadPoolExecutor(1).submit(evaluate.compile)
        state, rows, train_summary = train_and_log(
            config, grid, sharding, out, keys.train, values, watch
        )
        evaluate = evaluate.result()
        params = trained_params(state)
        summary |= train_summary
    evaluation = fetch(evaluate(params, keys.evaluate, values))
    saved_params = fetch(params) if config.save_model and not config.eval_only else None
    if not is_lead():
        sys.exit(130 if summary["stopped_early"] else 0)  # process 0 writes the outputs
    if saved_params is not None:
        save_checkpoint(out / "model.msgpack", config, grid, saved_params)
    if config.plot and not config.eval_only:
        plot_curves(out / "curves.png", config, rows)
    per_run = {name: np.asarray(values).mean(axis=1) for name, values in evaluation.items()}
    watch.close(summary.get("env_steps", 0), per_run)
    returns = per_run["episode_return"]
    solved = int((returns >= SOLVED_RETURN).sum())
    extras = {name: values for name, values in per_run.items() if name != "episode_return"}
    others = "".join(f", {name} {values.mean():.3g}" for name, values in extras.items())
    run, runs = ("run", "runs") if config.sweep else ("seed", "seed(s)")
    print(
        f"evaluation, {config.eval_episodes} deterministic episodes per {run}: return "
        f"{returns.mean():.1f} ± {returns.std():.1f} (min {returns.min():.1f}); {solved}/"
        f"{num_runs} {runs} >= {SOLVED_RETURN:g}{others}",
        flush=True,
    )
    summary = {
        "final_returns": returns.tolist(),
        "final_return_mean": float(returns.mean()),
        "final_return_std": float(returns.std()),
        "solved_fraction": solved / num_runs,
        **{f"final_{name}": values.tolist() for name, values in extras.items()},
        **{f"final_{name}_mean": float(values.mean()) for name, values in extras.items()},
        **summary,
        "num_seeds": config.num_seeds,
        "num_envs": config.num_envs,
        "eval_episodes": config.eval_episodes,
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "processes": jax.process_count(),
    }
    if config.sweep:
        summary["sweep"] = sweep_report(grid, returns)
        for entry in sorted(summary["sweep"], key=lambda entry: -entry["mean"]):
            print(
                f"  {describe(entry['values'])}: {entry['mean']:.1f} ± {entry['std']:.1f}, "
                f"{entry['solved_fraction']:.0%} of seeds >= {SOLVED_RETURN:g}",
                flush=True,
            )
        write_sweep(out, config, summary["sweep"], [] if config.eval_only else rows)
    write_json(out / "summary.json", summary)
    if config.capture_gif:
        render, seconds_per_frame = make_render(with_values(config, grid[0]))
        frames = jax.jit(render)(first_run(params), first_run(keys.render))
        write_gif(out / "policy.gif", np.asarray(frames), seconds_per_frame)
    print(f"wrote {', '.join(sorted(path.name for path in out.iterdir()))} in {out}", flush=True)
    if summary["stopped_early"]:
        sys.exit(130)  # interrupted, as a shell expects after Ctrl-C


def parse_config(args: Sequence[str] | None = None) -> Config:
    """tyro over the defaults of the task that --env-id names (so --help lists those)."""
    args = sys.argv[1:] if args is None else list(args)
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --env-id alone
    peek.add_argument("--env-id", "--env_id", default="CartPoleContinuous", nargs="?")
    env_id = peek.parse_known_args(args)[0].env_id
    default = default_config(env_id)
    return tyro.cli(Config, args=args, default=default, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    try:
        config = parse_config()
    except BrokenPipeError:  # `--help | head` closed the pipe: end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    main(config)
