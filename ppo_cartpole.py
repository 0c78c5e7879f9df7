"""PPO on CartPole-v1, fully on device. Docs: docs/ppo.md

Proximal policy optimisation (Schulman et al. 2017) with generalised advantage estimation
(Schulman et al. 2016) and the implementation details of Huang et al. 2022, shaped like CleanRL's
ppo.py but pure JAX: the envs, the rollout, the advantages and every gradient step stay on the
device, and one compiled `lax.scan` runs a chunk of PPO iterations.

    python ppo_cartpole.py                   # train, evaluate, write runs/ppo_cartpole__1__<time>/
    python ppo_cartpole.py --num-seeds 16    # 16 seeds in one vmapped program
    python ppo_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import chex
import flax.linen as nn
import jax
import jax.flatten_util
import jax.numpy as jnp
import numpy as np
import optax
from chex import Array, PRNGKey
from flax import struct

import envs

SCRIPT = "ppo_cartpole"
Params = Any  # a flax parameter tree

# ---- config ----


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """CartPole-v1's constants (envs.CartPoleParams); the defaults are gymnasium's."""

    gravity: float = 9.8  # gravitational acceleration (m/s^2)
    masscart: float = 1.0  # mass of the cart (kg)
    masspole: float = 0.1  # mass of the pole (kg)
    length: float = 0.5  # half the pole's length (m)
    force_mag: float = 10.0  # the force that either action pushes the cart with (N)
    max_steps_in_episode: int = 500  # time limit in steps (a truncation: GAE still bootstraps)


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 1  # seed of the first run; seed i of --num-seeds uses seed + i
    num_seeds: int = 1  # independent runs trained at once in one vmapped program
    sweep: tuple[str, ...] | None = None
    """NAME=V1,V2,... entries of any field, e.g. ent-coef=0,0.01 num-minibatches=4,8: every
    combination x --num-seeds runs, in one process (docs/sweeps.md)"""
    num_envs: int = 32  # parallel envs per seed
    total_timesteps: int = 98_304
    """env steps per seed, all envs together (rounded down to whole chunks): 48 iterations"""
    learning_rate: float = 1e-2  # Adam step size
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over training
    num_steps: int = 64
    """steps per env per rollout: one PPO iteration uses num_envs * num_steps env steps"""
    gamma: float = 0.99  # discount factor
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    num_minibatches: int = 4  # minibatches per epoch; must divide num_envs * num_steps
    update_epochs: int = 4  # passes over each rollout
    norm_adv: bool = True  # normalise the advantages within each minibatch
    clip_coef: float = 0.2
    """clip range of the probability ratio (and of the value change with --clip-vloss)"""
    clip_vloss: bool = False  # clip the value loss around the rollout's value estimates
    ent_coef: float = 0.01  # weight of the entropy bonus
    vf_coef: float = 0.5  # weight of the value loss
    max_grad_norm: float = 0.5  # clip the gradient to this global norm (optax.clip_by_global_norm)
    hidden_size: int = 64  # width of the two tanh hidden layers of the actor and of the critic
    log_every: int = 12_288
    """env steps per chunk (whole iterations): one progress line and one metrics row per seed"""
    env: EnvConfig = EnvConfig()  # CartPole-v1's constants


def make_env(config: Config) -> tuple[envs.Environment, envs.CartPoleParams]:
    """The one place the env is made: any env with gymnax's API and a Discrete action space fits."""
    return envs.CartPole(), envs.CartPoleParams(**dataclasses.asdict(config.env))


def env_name(config: Config) -> str:
    return "CartPole-v1"


def chunk_sizes(config: Config) -> tuple[int, int]:
    """(iterations per chunk, number of chunks); an iteration is one rollout and its update."""
    batch_size = config.num_envs * config.num_steps
    iterations_per_chunk = max(config.log_every // batch_size, 1)
    num_chunks = config.total_timesteps // (iterations_per_chunk * batch_size)
    return iterations_per_chunk, num_chunks


# ---- networks ----


def orthogonal(gain: float) -> Callable:
    """nn.initializers.orthogonal's distribution (gain x a Haar-random orthogonal matrix), by
    Newton-Schulz steps instead of a QR: batched LAPACK QR, as vmap(init) over seeds makes it,
    deadlocks on the CPU jaxlib (reproduction in docs/ppo.md)."""

    def init(key: PRNGKey, shape: Sequence[int], dtype: Any = jnp.float32) -> Array:
        gaussian = jax.random.normal(key, shape, dtype)
        x = gaussian / jnp.linalg.norm(gaussian)  # singular values in (0, 1]
        # The polar factor G (G^T G)^-1/2: each step maps a singular value s to s (3 - s^2) / 2.
        return gain * jax.lax.fori_loop(0, 60, lambda _, x: 1.5 * x - 0.5 * x @ (x.T @ x), x)

    return init


# The gains of Huang et al. 2022 (detail 2); flax's biases start at zero.
HIDDEN_INIT = orthogonal(np.sqrt(2))
POLICY_INIT = orthogonal(0.01)  # a near-uniform first policy
VALUE_INIT = orthogonal(1.0)


class Actor(nn.Module):
    """obs -> logits of the categorical policy: two tanh layers and a linear head."""

    hidden_size: int
    num_actions: int

    @nn.compact
    def __call__(self, obs: Array) -> Array:
        x = obs
        for _ in range(2):
            x = nn.tanh(nn.Dense(self.hidden_size, kernel_init=HIDDEN_INIT)(x))
        return nn.Dense(self.num_actions, kernel_init=POLICY_INIT, name="logits")(x)


class Critic(nn.Module):
    """obs -> V(obs). A network of its own, no trunk shared with the actor (Huang et al. 2022,
    detail 13): on CartPole one would only couple two losses of different scales."""

    hidden_size: int

    @nn.compact
    def __call__(self, obs: Array) -> Array:
        x = obs
        for _ in range(2):
            x = nn.tanh(nn.Dense(self.hidden_size, kernel_init=HIDDEN_INIT)(x))
        return nn.Dense(1, kernel_init=VALUE_INIT, name="value")(x).squeeze(-1)


def categorical_log_prob(logits: Array, action: Array) -> Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)[..., 0]


def categorical_entropy(logits: Array) -> Array:
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)


# ---- train state and losses ----


@struct.dataclass
class Learner:
    """What a gradient update changes."""

    params: Params  # {"actor": ..., "critic": ...}
    opt_state: optax.OptState


@struct.dataclass
class TrainState:
    """Everything that flows through the training scan (one seed)."""

    learner: Learner
    env_state: envs.EpisodeStatsState  # [num_envs]
    obs: Array  # [num_envs, obs_dim], what each env shows now
    key: PRNGKey


@struct.dataclass
class Transition:
    """One rollout step of every env; [num_steps, num_envs, ...] after the rollout's scan."""

    obs: Array
    action: Array
    log_prob: Array  # of the action, under the policy that drew it
    reward: Array
    terminated: Array
    truncated: Array
    final_obs: Array  # the observation the step reached, before any auto-reset
    episode_ended: Array
    episode_return: Array  # of the episode that ended at this step, 0 elsewhere
    episode_length: Array


@struct.dataclass
class Batch:
    """What the PPO update needs of each sample; leading axis: samples."""

    obs: Array
    action: Array
    log_prob: Array
    value: Array  # the critic's estimate when the rollout was made
    advantage: Array
    target: Array  # the lambda-return: advantage + value


@struct.dataclass
class Losses:
    value_loss: Array
    policy_loss: Array
    entropy: Array
    approx_kl: Array  # the (ratio - 1) - log ratio estimator
    clip_frac: Array  # the fraction of samples whose ratio was clipped


@struct.dataclass
class IterationLog:
    """What one PPO iteration reports to its chunk's metrics."""

    episode_ended: Array  # [num_steps, num_envs]
    episode_return: Array
    episode_length: Array
    losses: Losses  # means over the iteration's gradient steps


@struct.dataclass
class Metrics:
    """A chunk's numbers for one seed: means over its completed episodes (NaN where none
    ended) and over its gradient steps."""

    env_steps: Array
    updates: Array
    episode_return: Array
    episode_length: Array
    value_loss: Array
    policy_loss: Array
    entropy: Array
    approx_kl: Array
    clip_frac: Array
    params_finite: Array  # False once any parameter is NaN or inf


def trained_params(config: Config, state: TrainState) -> Params:
    """What model.msgpack keeps and the evaluation reads: a run's parameters."""
    return state.learner.params


def compute_gae(
    rewards: Array,
    values: Array,
    next_values: Array,
    terminated: Array,
    truncated: Array,
    gamma: float,
    gae_lambda: float,
) -> tuple[Array, Array]:
    """GAE(lambda) over [num_steps, num_envs] arrays by a reverse scan (Schulman et al. 2016).
    next_values[t] is the value of the state step t reached: the next observation's, or at an
    episode end the final observation's (before the auto-reset). A termination bootstraps
    nothing; a time-limit truncation bootstraps next_values[t], as the state is not terminal.
    Either end stops the advantage sum at the boundary. Returns (advantages, lambda-returns
    = advantages + values)."""
    chex.assert_equal_shape([rewards, values, next_values, terminated, truncated])
    deltas = rewards + gamma * next_values * (1.0 - terminated) - values
    continues = 1.0 - jnp.logical_or(terminated, truncated)

    def backward(next_advantage: Array, delta_and_continues: tuple[Array, Array]):
        delta, continuing = delta_and_continues
        advantage = delta + gamma * gae_lambda * continuing * next_advantage
        return advantage, advantage

    _, advantages = jax.lax.scan(
        backward, jnp.zeros_like(values[0]), (deltas, continues), reverse=True
    )
    return advantages, advantages + values


def policy_loss(
    log_prob: Array, old_log_prob: Array, advantages: Array, clip_coef: float
) -> tuple[Array, Array, Array]:
    """PPO's clipped surrogate objective (Schulman et al. 2017, eq. 7), negated for descent.
    Returns (loss, approx_kl, clip_frac); approx_kl is the (ratio - 1) - log ratio estimator."""
    chex.assert_equal_shape([log_prob, old_log_prob, advantages])
    log_ratio = log_prob - old_log_prob
    ratio = jnp.exp(log_ratio)
    clipped_ratio = jnp.clip(ratio, 1.0 - clip_coef, 1.0 + clip_coef)
    loss = jnp.maximum(-advantages * ratio, -advantages * clipped_ratio).mean()
    approx_kl = ((ratio - 1.0) - log_ratio).mean()
    clip_frac = (jnp.abs(ratio - 1.0) > clip_coef).mean()
    return loss, approx_kl, clip_frac


def value_loss(
    values: Array, old_values: Array, targets: Array, clip_coef: float, clip_vloss: bool
) -> Array:
    """Half the mean squared error to the lambda-returns; with clip_vloss, the larger of the plain
    and the clipped error, as PPO's reference code (Huang et al. 2022, detail 9)."""
    chex.assert_equal_shape([values, old_values, targets])
    squared_error = (values - targets) ** 2
    if clip_vloss:
        clipped_values = old_values + jnp.clip(values - old_values, -clip_coef, clip_coef)
        squared_error = jnp.maximum(squared_error, (clipped_values - targets) ** 2)
    return 0.5 * squared_error.mean()


def minibatch_indices(
    key: PRNGKey, num_epochs: int, batch_size: int, num_minibatches: int
) -> Array:
    """A fresh permutation of the batch per epoch, cut into minibatches: int[num_epochs,
    num_minibatches, batch_size // num_minibatches]."""
    samples = jnp.broadcast_to(jnp.arange(batch_size), (num_epochs, batch_size))
    permutations = jax.random.permutation(key, samples, axis=1, independent=True)
    return permutations.reshape(num_epochs, num_minibatches, batch_size // num_minibatches)


def masked_mean(values: Array, mask: Array) -> Array:
    """The mean of `values` where `mask` holds; NaN where it holds nowhere."""
    return jnp.sum(jnp.where(mask, values, 0.0)) / jnp.where(mask.any(), mask.sum(), jnp.nan)


# ---- training ----


def make_train(config: Config):
    """Static work once; returns the pure functions init(key) -> state, run_chunk(state, chunk)
    -> (state, metrics) and train(key) -> (state, metrics with a leading chunk axis)."""
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    num_iterations = iterations_per_chunk * num_chunks
    num_envs = config.num_envs
    num_steps = config.num_steps
    batch_size = num_envs * num_steps
    updates_per_iteration = config.update_epochs * config.num_minibatches
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    num_actions = env.num_actions
    actor = Actor(config.hidden_size, num_actions)
    critic = Critic(config.hidden_size)
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def learning_rate(count: Array) -> Array:
        """Linear to 0 over training, constant within an iteration (CleanRL's annealing)."""
        fraction_left = 1.0 - (count // updates_per_iteration) / num_iterations
        return config.learning_rate * (fraction_left if config.anneal_lr else 1.0)

    # optax.flatten: the same maths on one flat vector of all parameters, in a few fused
    # kernels rather than a few per parameter array (less code for XLA to compile).
    optimizer = optax.flatten(
        optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adam(learning_rate, eps=1e-5),  # PPO's reference eps (Huang et al., detail 3)
        )
    )

    def init(key: PRNGKey) -> TrainState:
        """Fresh networks, optimiser and envs."""
        key_actor, key_critic, key_envs, key_loop = jax.random.split(key, 4)
        reset_envs = jax.vmap(env.reset, in_axes=(0, None))
        obs, env_state = reset_envs(jax.random.split(key_envs, num_envs), env_params)
        params = {"actor": actor.init(key_actor, obs), "critic": critic.init(key_critic, obs)}
        learner = Learner(params=params, opt_state=optimizer.init(params))
        return TrainState(learner=learner, env_state=env_state, obs=obs, key=key_loop)

    # COLLECT TRAJECTORIES

    def rollout(
        state: TrainState, key_actions: PRNGKey, key_envs: PRNGKey
    ) -> tuple[TrainState, Transition]:
        """num_steps steps of every env with the current policy."""
        # argmax(logits + Gumbel noise) is a draw from softmax(logits), as jax.random.categorical
        # does it; the whole rollout's noise in one draw before the scan.
        gumbel = jax.random.gumbel(key_actions, (num_steps, num_envs, num_actions))
        env_keys = jax.random.split(key_envs, (num_steps, num_envs))

        def step(state: TrainState, noise_and_keys: tuple[Array, PRNGKey]):
            noise, keys = noise_and_keys
            logits = actor.apply(state.learner.params["actor"], state.obs)
            action = jnp.argmax(logits + noise, axis=-1)
            obs, env_state, reward, terminated, truncated, info = step_envs(
                keys, state.env_state, action, env_params
            )
            transition = Transition(
                obs=state.obs,
                action=action,
                log_prob=categorical_log_prob(logits, action),
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                final_obs=info["final_observation"],
                episode_ended=info["returned_episode"],
                episode_return=info["episode_return"],
                episode_length=info["episode_length"],
            )
            return state.replace(env_state=env_state, obs=obs), transition

        return jax.lax.scan(step, state, (gumbel, env_keys))

    # CALCULATE ADVANTAGE

    def make_batch(critic_params: Params, transitions: Transition) -> Batch:
        """The critic over every visited and every reached state, GAE, then flat samples."""
        chex.assert_shape(transitions.reward, (num_steps, num_envs))
        values = critic.apply(critic_params, transitions.obs)
        next_values = critic.apply(critic_params, transitions.final_obs)
        advantages, targets = compute_gae(
            transitions.reward,
            values,
            next_values,
            transitions.terminated,
            transitions.truncated,
            config.gamma,
            config.gae_lambda,
        )
        batch = Batch(
            obs=transitions.obs,
            action=transitions.action,
            log_prob=transitions.log_prob,
            value=values,
            advantage=advantages,
            target=targets,
        )
        return jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)

    # UPDATE NETWORKS: update_epochs epochs of num_minibatches gradient steps

    def loss(params: Params, minibatch: Batch) -> tuple[Array, Losses]:
        """The clipped surrogate, minus the entropy bonus, plus the weighted value loss."""
        logits = actor.apply(params["actor"], minibatch.obs)
        advantages = minibatch.advantage
        if config.norm_adv:
            advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
        log_prob = categorical_log_prob(logits, minibatch.action)
        pg_loss, approx_kl, clip_frac = policy_loss(
            log_prob, minibatch.log_prob, advantages, config.clip_coef
        )
        values = critic.apply(params["critic"], minibatch.obs)
        v_loss = value_loss(
            values, minibatch.value, minibatch.target, config.clip_coef, config.clip_vloss
        )
        entropy = categorical_entropy(logits).mean()
        total = pg_loss - config.ent_coef * entropy + config.vf_coef * v_loss
        losses = Losses(
            value_loss=v_loss,
            policy_loss=pg_loss,
            entropy=entropy,
            approx_kl=approx_kl,
            clip_frac=clip_frac,
        )
        return total, losses

    def update_minibatch(learner: Learner, minibatch: Batch) -> tuple[Learner, Losses]:
        """One gradient step."""
        grads, losses = jax.grad(loss, has_aux=True)(learner.params, minibatch)
        updates, opt_state = optimizer.update(grads, learner.opt_state, learner.params)
        params = optax.apply_updates(learner.params, updates)
        return Learner(params=params, opt_state=opt_state), losses

    def update(learner: Learner, batch: Batch, key: PRNGKey) -> tuple[Learner, Losses]:
        """update_epochs passes over the batch, each in minibatches of a fresh permutation;
        the losses averaged over every step."""
        indices = minibatch_indices(key, config.update_epochs, batch_size, config.num_minibatches)

        def update_epoch(learner: Learner, epoch_indices: Array) -> tuple[Learner, Losses]:
            minibatches = jax.tree.map(lambda x: x[epoch_indices], batch)
            return jax.lax.scan(update_minibatch, learner, minibatches)

        learner, losses = jax.lax.scan(update_epoch, learner, indices)
        return learner, jax.tree.map(jnp.mean, losses)

    def iteration(state: TrainState, _: None) -> tuple[TrainState, IterationLog]:
        """One PPO iteration: a rollout, its advantages, then the update."""
        key, key_actions, key_envs, key_update = jax.random.split(state.key, 4)
        state, transitions = rollout(state, key_actions, key_envs)
        batch = make_batch(state.learner.params["critic"], transitions)
        learner, losses = update(state.learner, batch, key_update)
        log = IterationLog(
            episode_ended=transitions.episode_ended,
            episode_return=transitions.episode_return,
            episode_length=transitions.episode_length,
            losses=losses,
        )
        return state.replace(learner=learner, key=key), log

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """Chunk number `chunk` (from 0): iterations_per_chunk iterations in one scan; `chunk`
        gives the counts of env steps and updates done."""
        state, log = jax.lax.scan(iteration, state, None, length=iterations_per_chunk)
        iterations_done = (chunk + 1) * iterations_per_chunk
        losses = jax.tree.map(jnp.mean, log.losses)
        flat_params, _ = jax.flatten_util.ravel_pytree(trained_params(config, state))
        metrics = Metrics(
            env_steps=iterations_done * batch_size,
            updates=iterations_done * updates_per_iteration,
            episode_return=masked_mean(log.episode_return, log.episode_ended),
            episode_length=masked_mean(log.episode_length, log.episode_ended),
            params_finite=jnp.isfinite(flat_params).all(),
            **dataclasses.asdict(losses),  # value_loss ... clip_frac, chunk means
        )
        return state, metrics

    def train(key: PRNGKey) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(run_chunk, init(key), jnp.arange(num_chunks))

    return init, run_chunk, train


# ---- evaluation ----

GIF_ENVS = 4  # carts side by side in policy.gif
STEPS_PER_FRAME = 2  # policy.gif shows every second step (in real time)


def make_greedy_episodes(config: Config):
    """play(params, key, num_episodes) -> (returns [num_episodes], env states [time,
    num_episodes]) of the greedy policy: the time limit's steps without auto-reset, rewards
    after a termination masked, and each env's state kept from its episode's end on."""
    env, env_params = make_env(config)
    actor = Actor(config.hidden_size, env.num_actions)
    step_envs = jax.vmap(env.step_env, in_axes=(0, 0, 0, None))
    max_steps = config.env.max_steps_in_episode

    def play(params: Params, key: PRNGKey, num_episodes: int) -> tuple[Array, Any]:
        key_reset, key_steps = jax.random.split(key)
        reset_keys = jax.random.split(key_reset, num_episodes)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

        def step(carry, keys: PRNGKey):
            obs, env_state, total, running = carry
            action = jnp.argmax(actor.apply(params["actor"], obs), axis=-1)
            obs, next_state, reward, terminated, _ = step_envs(keys, env_state, action, env_params)
            next_state = jax.tree.map(
                lambda new, old: jnp.where(running, new, old), next_state, env_state
            )
            total = total + jnp.where(running, reward, 0.0)
            return (obs, next_state, total, running & ~terminated), env_state

        carry = (obs, env_state, jnp.zeros(num_episodes), jnp.ones(num_episodes, bool))
        step_keys = jax.random.split(key_steps, (max_steps, num_episodes))
        (_, _, total, _), states = jax.lax.scan(step, carry, step_keys)
        return total, states

    return env, env_params, play


def make_evaluate(config: Config, num_episodes: int):
    """evaluate(params, key) -> {"episode_return": [num_episodes]} of the greedy policy."""
    _, _, play = make_greedy_episodes(config)

    def evaluate(params: Params, key: PRNGKey) -> dict[str, Array]:
        returns, _ = play(params, key, num_episodes)
        return {"episode_return": returns}

    return evaluate


def make_render(config: Config):
    """(render(params, key) -> uint8 frames [time, height, width, 3]: one episode of the greedy
    policy in GIF_ENVS carts side by side, every STEPS_PER_FRAME-th step, drawn by the env's
    renderer; seconds of simulated time per frame)."""
    env, env_params, play = make_greedy_episodes(config)
    draw = jax.vmap(lambda env_state: env.render(env_state, env_params, height=120, width=180))

    def render(params: Params, key: PRNGKey) -> Array:
        _, states = play(params, key, GIF_ENVS)
        shown = jax.tree.map(lambda x: x[::STEPS_PER_FRAME], states)
        images = jax.lax.map(draw, shown)  # [time, GIF_ENVS, height, width, 3]
        return jnp.concatenate(jnp.unstack(images, axis=1), axis=2)  # the carts left to right

    return render, STEPS_PER_FRAME * env_params.tau


# ---- command line: nothing below changes what is learned ----

import csv
import importlib.util
import io
import itertools
import json
import os
import signal
import sys
import time
from importlib.metadata import version
from pathlib import Path
from typing import Annotated, get_type_hints

import flax.serialization
import numpy as np
import tyro
from flax.traverse_util import flatten_dict
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from PIL import Image, ImageDraw  # matplotlib's dependency

LOSS_COLUMNS = tuple(field.name for field in dataclasses.fields(Losses))  # checked for NaN
METRIC_COLUMNS = ("episode_return", "episode_length", *LOSS_COLUMNS)  # fields of Metrics
PROGRESS_COLUMNS = ("value_loss", "entropy", "approx_kl")  # on each progress line after the return
EVAL_EPISODES = 10  # greedy-policy episodes per run in the final evaluation, by default
CPU_CHUNK = {"xla_backend_optimization_level": 2}  # the chunk's XLA options on a CPU (usage.md)


def solved_return(config: Config) -> float:
    return 475.0  # CartPole-v1's reward_threshold in gymnasium's registry


# ---- options and validation ----


@dataclasses.dataclass(frozen=True)
class Options:
    """What a run writes, shows and runs on: nothing here changes what is learned."""

    output_dir: str | None = None  # None: a new runs/<script>[_eval]__<seed>__<time>_<random>
    overwrite: bool = False  # write into an --output-dir that holds files (replacing ours only)
    eval_episodes: int = EVAL_EPISODES  # evaluation episodes per run (the deterministic policy)
    save_model: bool = True  # write model.msgpack (every run's parameters and the config)
    capture_gif: bool = True  # write policy.gif (the first run's policy in a few envs)
    plot: bool = True  # write curves.png (the metrics against env steps)
    plot_every: float = 15.0  # seconds between redraws of curves.png while training (0: at the end)
    checkpoint_every: int = 10_000_000  # env steps between checkpoints (whole chunks; 0: on a stop)
    keep_checkpoint: bool = False  # keep the last checkpoint: --resume with more steps trains on
    resume: str | None = None  # a stopped run's folder: train on from its checkpoint, in it
    eval_only: bool = False  # evaluate and render the --load-model model; no training
    load_model: str | None = None  # a model.msgpack, or a run folder, for --eval-only
    live: bool = False  # a window with the curves and the first run's policy, after every chunk
    track: bool = False  # TensorBoard event files per run in tensorboard/ (needs tensorboardX)
    wandb_project_name: str | None = None  # with --track: a W&B run per run too (needs wandb)
    wandb_entity: str | None = None  # the W&B team or user of --wandb-project-name's runs
    compile_cache: bool = True  # JAX's persistent cache: $JAX_COMPILATION_CACHE_DIR or ours
    distributed: bool = False  # one program over several processes or hosts (docs/distributed.md)
    coordinator_address: str | None = None  # HOST:PORT of process 0 (unless a cluster is detected)
    num_processes: int | None = None  # processes of a --distributed run
    process_id: int | None = None  # this process's index in [0, --num-processes)
    typed: tyro.conf.Suppress[frozenset[str]] = frozenset()  # parse_args: the flags' field names


class UsageError(Exception):
    """A user error: reported as one line, exit status 2, no traceback."""


def require(holds: bool, name: str, allowed: str, value: Any) -> None:
    if not holds:
        raise UsageError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def validate(config: Config) -> None:
    """Raise UsageError naming the first bad flag and its allowed range; compiles nothing."""
    for name in ("num_seeds", "num_envs", "num_steps", "total_timesteps", "num_minibatches"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("update_epochs", "hidden_size", "log_every"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        require(getattr(config, name) > 0, name, "> 0", getattr(config, name))
    for name in ("ent_coef", "vf_coef"):
        require(getattr(config, name) >= 0, name, ">= 0", getattr(config, name))
    for name, value in vars(config.env).items():  # physics whose default is positive stay so
        require(value > 0 or getattr(EnvConfig(), name) <= 0, f"env.{name}", "> 0", value)
    last_seed = 2**31 - config.num_seeds  # every run's seed fits in int32
    require(0 <= config.seed <= last_seed, "seed", f"in [0, {last_seed}]", config.seed)
    require(0 < config.gamma <= 1, "gamma", "in (0, 1]", config.gamma)
    require(0 <= config.gae_lambda <= 1, "gae_lambda", "in [0, 1]", config.gae_lambda)
    batch_size = config.num_envs * config.num_steps
    divides = f"a divisor of --num-envs * --num-steps ({batch_size})"
    divides_ok = batch_size % config.num_minibatches == 0
    require(divides_ok, "num_minibatches", divides, config.num_minibatches)
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    chunk = f"one chunk ({iterations_per_chunk * batch_size} env steps, --log-every)"
    require(num_chunks >= 1, "total_timesteps", f">= {chunk}", config.total_timesteps)


def check_options(options: Options) -> None:
    require(options.eval_episodes >= 1, "eval_episodes", ">= 1", options.eval_episodes)
    require(options.plot_every >= 0, "plot_every", ">= 0 seconds", options.plot_every)
    require(options.checkpoint_every >= 0, "checkpoint_every", ">= 0", options.checkpoint_every)
    resume_ok = options.resume is None or bool(options.resume) and not options.output_dir
    require(resume_ok, "resume", "a run folder (without --output-dir)", repr(options.resume))
    if options.eval_only != (options.load_model is not None):
        raise UsageError("--eval-only and --load-model PATH go together")
    alone = options.resume is None or not options.eval_only
    require(alone, "resume", "without --eval-only (it trains on)", options.resume)
    cluster = (options.coordinator_address, options.num_processes, options.process_id)
    if not options.distributed and cluster != (None, None, None):
        raise UsageError("--coordinator-address, --num-processes, --process-id need --distributed")
    host, _, port = (options.coordinator_address or "host:1").rpartition(":")
    address_ok = bool(host) and port.isdigit() and 0 < int(port) < 2**16
    require(address_ok, "coordinator_address", "HOST:PORT", options.coordinator_address)
    tracked = options.track and options.wandb_project_name
    if (options.wandb_project_name or options.wandb_entity) and not tracked:
        raise UsageError("--wandb-project-name NAME (and --wandb-entity) go with --track")
    for flag, package in (("track", "tensorboardX"), ("wandb_project_name", "wandb")):  # optional
        if getattr(options, flag) and importlib.util.find_spec(package) is None:
            raise UsageError(f"--{flag.replace('_', '-')} needs {package}: pip install {package}")


# LLVM -O1 for what runs once (seed keys, init, the evaluation): less compile than the default,
# the same bits (-O0 rounded init otherwise); the chunk's are CPU_CHUNK
RUN_ONCE = {"compiler_options": {"xla_backend_optimization_level": 1}}  # jax.jit's


def enable_compile_cache(options: Options) -> str:
    """JAX's persistent compilation cache (a rerun loads its programs); returns where it is."""
    if not options.compile_cache:  # (JAX itself still reads $JAX_COMPILATION_CACHE_DIR if set)
        return "off (--no-compile-cache)"
    path = os.environ.get("JAX_COMPILATION_CACHE_DIR")
    if path is None:  # our own folder, at most 1 GiB: JAX drops the least recently used entries
        path = str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"), "jax-rl-scripts"))
        jax.config.update("jax_compilation_cache_max_size", 2**30)
    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)  # small CPU programs too
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
    return path


# ---- sweep grid: the runs are grid points x seeds ----

# --sweep may vary any field but the seed's: floats (rates, coefficients, env physics) are traced
# values, vmapped with the seeds; ints, bools and tuples of ints set a shape or a branch: each
# distinct structure is its own vmapped part of the one program (docs/sweeps.md).
SWEEPABLE = {
    prefix + name: hint
    for prefix, fields in (("", Config), ("env.", EnvConfig))
    for name, hint in get_type_hints(fields).items()
    if hint in (float, float | None, int, bool, tuple[int, ...])
    and name not in ("seed", "num_seeds")
}
TRACED = {name for name, hint in SWEEPABLE.items() if hint in (float, float | None)}
PARSE = {  # a --sweep value as its field's type, where not a float (a tuple of ints: 64x64)
    bool: {"true": True, "false": False}.__getitem__,
    int: int,
    tuple[int, ...]: lambda text: tuple(int(size) for size in text.split("x")),
}
Point = dict[str, Any]  # one grid point: a value per swept field


def with_values(config: Config, point: Point) -> Config:
    """`config` with the fields of `point` set (floats, or traced values inside the program)."""
    top = {name: value for name, value in point.items() if not name.startswith("env.")}
    env = {name[4:]: value for name, value in point.items() if name.startswith("env.")}
    return dataclasses.replace(config, **top, env=dataclasses.replace(config.env, **env))


def describe(point: Point) -> str:
    """The point as --sweep takes it: q-lr=0.0003 autotune=false hidden-sizes=64x64."""
    words = []
    for name, value in point.items():
        value = "x".join(map(str, value)) if isinstance(value, tuple) else json.dumps(value)
        words.append(f"{name.replace('_', '-')}={value}")
    return " ".join(words)


def sweep_grid(config: Config) -> tuple[list[Point], list[Point]]:
    """Every combination of the --sweep values, validated, in two parts whose product is the grid:
    the structures (combinations of the values that are not floats) and the float points."""
    require(config.sweep != (), "sweep", "followed by NAME=V1,V2,... entries", "none")
    values: dict[str, list] = {}
    for entry in config.sweep or ():
        name, _, listed = entry.partition("=")
        name = name.removeprefix("--").replace("-", "_")
        fields = ", ".join(name.replace("_", "-") for name in SWEEPABLE)
        require(name in SWEEPABLE, "sweep", f"NAME=V1,V2,... naming one of {fields}", entry)
        require(name not in values, "sweep", "one entry per field", entry)
        try:
            values[name] = [PARSE.get(SWEEPABLE[name], float)(value) for value in listed.split(",")]
        except (ValueError, KeyError):  # (a bool: true or false)
            raise UsageError(f"--sweep must be NAME=V1,V2,... (of its type), got {entry}") from None
        require(len(set(values[name])) == len(values[name]), "sweep", "distinct values", entry)

    def combinations(traced: bool) -> list[Point]:
        kind = {name: listed for name, listed in values.items() if (name in TRACED) == traced}
        return [dict(zip(kind, point, strict=True)) for point in itertools.product(*kind.values())]

    shapes, floats = combinations(traced=False), combinations(traced=True)
    grid = [shape | point for shape in shapes for point in floats]
    for number, point in enumerate(grid, start=1):
        try:
            validate(with_values(config, point))
        except UsageError as error:
            where = f"grid point {number} of {len(grid)} ({describe(point)})"
            raise UsageError(f"--sweep {where}: {error}") from None
    chunks = {chunk_sizes(with_values(config, point))[1] for point in grid}
    require(len(chunks) == 1, "sweep", "points of as many chunks (see --log-every)", sorted(chunks))
    return shapes, floats


def runs_text(config: Config, grid: list[Point]) -> str:
    seeds = f"{config.num_seeds} seed{'s' if config.num_seeds > 1 else ''}"
    return f"{len(grid)} grid points x {seeds}" if config.sweep else seeds


@functools.partial(jax.jit, static_argnums=(0, 1), **RUN_ONCE)
def seed_keys(config: Config, num_points: int = 1) -> dict[str, PRNGKey]:
    """Each run's three keys (raw uint32): run r is the run of --seed seed + r % num_seeds alone."""
    seeds = config.seed + jnp.arange(num_points * config.num_seeds) % config.num_seeds
    keys = jax.vmap(lambda seed: jax.random.split(jax.random.PRNGKey(seed), 3))(seeds)
    return {"train": keys[:, 0], "evaluate": keys[:, 1], "render": keys[:, 2]}


def over_structures(function: Callable, configs: list[Config]) -> Callable:
    """function(config, *inputs) over every structure's runs (their float values the first input),
    as one program once jitted: lists in and out, a structure's each."""

    def run(config: Config, values: Point, *inputs: Any) -> Any:
        return function(with_values(config, values), *inputs)

    def every_structure(*args: list) -> list:
        return [
            jax.vmap(functools.partial(run, config))(*inputs)
            for config, *inputs in zip(configs, *args, strict=True)
        ]

    return every_structure


def initial(config: Config, key: PRNGKey) -> TrainState:
    return make_train(config)[0](key)  # a run's train state, as init makes it


# ---- outputs: files, curves, the GIF, model.msgpack and checkpoint.msgpack ----

say_once = functools.cache(print)  # a line that a loop may ask for again is printed once


def write_atomic(path: Path, data: str | bytes) -> None:
    """A temporary file, then a rename: a reader (or a kill) never meets a half-written file."""
    temporary = path.with_name(f".{path.name}.tmp")
    temporary.write_bytes(data.encode() if isinstance(data, str) else data)
    os.replace(temporary, path)


def csv_text(rows: list[dict]) -> str:
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    return text.getvalue()


@functools.cache
def jitted_render(config: Config) -> tuple[Callable, float]:
    render, seconds_per_frame = make_render(config)
    return jax.jit(render), seconds_per_frame


def render_policy(config: Config, params: Params, key: PRNGKey) -> np.ndarray | None:
    """One episode of the policy as frames; None (said once) where the env has no renderer."""
    try:
        return np.asarray(jitted_render(config)[0](params, key))
    except Exception as error:  # whatever it is, the run's model and summary are written first
        say_once(f"{SCRIPT}: no policy.gif or panel: {env_name(config)} is not drawn ({error})")
        return None


def gif(frames: np.ndarray, seconds_per_frame: float, caption: str) -> bytes:
    """Frames [time, height, width, 3] as a looping GIF in real time, the caption above them."""
    frames = np.pad(frames, ((0, 0), (16, 0), (0, 0), (0, 0)), constant_values=255)
    # One palette for every frame, from frames across the GIF (a snake's colours may not be on the
    # first): PIL would otherwise find a palette per frame, 0.8 s more for a 500-frame episode.
    palette = Image.fromarray(np.concatenate(frames[:: max(len(frames) // 8, 1)])).quantize(32)
    images = [Image.fromarray(frame) for frame in frames]
    for image in images:
        ImageDraw.Draw(image).text((4, 2), caption, fill=(0, 0, 0))
    images = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    data = io.BytesIO()
    duration = round(1000 * seconds_per_frame)
    images[0].save(data, "GIF", save_all=True, append_images=images[1:], duration=duration, loop=0)
    return data.getvalue()


def interval(runs: np.ndarray, statistic: Callable, resamples: int = 50_000) -> list | None:
    """The 95% percentile-bootstrap interval of `statistic` over the runs (the first axis), as
    rliable estimates it (one task: its stratified bootstrap resamples the runs), from a fixed
    seed so that a report is reproducible; None, no interval, with fewer than 3 runs."""
    if len(runs) < 3:
        return None
    from scipy import stats  # here: it is slow to import

    found = stats.bootstrap(
        (runs,), statistic, n_resamples=resamples, method="percentile", rng=np.random.default_rng(0)
    )
    return list(found.confidence_interval)  # [low, high]


def estimates(returns: np.ndarray) -> dict:
    """Mean, population std and IQM over runs, and the 95% intervals of the mean and of the IQM
    (rliable's IQM: scipy's trim_mean of a quarter each side; of < 4 runs it trims none)."""
    report = {"mean": returns.mean(), "std": returns.std(), "iqm": returns.mean()}
    if len(returns) < 3:  # no interval, so no scipy: 0.5 s to import, on every one-seed run
        return report | {"mean_ci": None, "iqm_ci": None}
    from scipy import stats

    iqm = functools.partial(stats.trim_mean, proportiontocut=0.25)
    report["iqm"] = iqm(returns)
    return report | {"mean_ci": interval(returns, np.mean), "iqm_ci": interval(returns, iqm)}


def report_cells(report: dict) -> list[str]:
    """Mean ± std, the mean's 95% interval, the IQM and its 95% interval, as printed."""
    mean = f"{report['mean']:.1f} ± {report['std']:.1f}"
    bounds = [report["mean_ci"], report["iqm_ci"]]
    bounds = [f"[{ci[0]:.1f}, {ci[1]:.1f}]" if ci else "none (< 3 runs)" for ci in bounds]
    return [mean, bounds[0], f"{report['iqm']:.1f}", bounds[1]]


def new_figure(live: bool) -> Any:
    """The curves' figure, with a policy row if --live: a window where there is a display."""
    import matplotlib.pyplot as plt  # here: it is slow to import

    window = live and plt.get_backend().lower() not in ("agg", "pdf", "svg")
    size = (13, 3 * ((len(METRIC_COLUMNS) + 2) // 3 + live))
    figure = (plt.figure if window else plt.Figure)(figsize=size, layout="constrained")
    if window:
        plt.show(block=False)
    elif live:  # matplotlib found no display (a server, ssh without X forwarding)
        print(f"{SCRIPT}: --live: no display ({plt.get_backend()} backend): see curves.png")
    return figure


def draw_curves(figure: Any, config: Config, grid: list[Point], rows: list[dict], frames) -> None:
    """Every metric against env steps (rows grid point major, then seed): per grid point the mean
    over its seeds, their min-max band and the 95% interval of the mean (2,000 draws a chunk);
    below, where given, the middle frame of the policy."""
    from matplotlib.ticker import EngFormatter

    figure.clear()
    figure.suptitle(f"{SCRIPT} on {env_name(config)}: {runs_text(config, grid)}")
    panels = figure.add_gridspec((len(METRIC_COLUMNS) + 2) // 3 + (frames is not None), 3)
    steps = np.reshape([row["env_steps"] for row in rows], (-1, len(grid), config.num_seeds))
    for index, name in enumerate(METRIC_COLUMNS):
        axis = figure.add_subplot(panels[index // 3, index % 3], title=name, xlabel="env steps")
        values = np.ma.masked_invalid([row[name] for row in rows])  # NaN: no episode ended
        by_point = values.reshape(len(steps), len(grid), -1).swapaxes(0, 1)
        for point, runs, at in zip(grid, by_point, steps[:, :, 0].T, strict=True):
            seeds = f"mean of {runs.shape[1]} seeds" if runs.shape[1] > 1 else f"seed {config.seed}"
            line = axis.plot(at, runs.mean(axis=1), label=describe(point) or seeds)[0]
            named = point is grid[0] and runs.shape[1] > 1  # the bands' one legend entry each
            band = "min-max over seeds" if named else None
            low, high = runs.min(axis=1), runs.max(axis=1)
            axis.fill_between(at, low, high, color=line.get_color(), alpha=0.12, label=band)
            whole = ~np.ma.getmaskarray(runs).any(axis=1)  # the chunks where every seed has one
            if whole.any() and (bounds := interval(runs[whole].data.T, np.mean, 2_000)):
                band = "95% interval of the mean over seeds (bootstrap)" if named else None
                axis.fill_between(at[whole], *bounds, color=line.get_color(), alpha=0.3, label=band)
        axis.xaxis.set_major_formatter(EngFormatter(sep=""))  # 1.2M: long numbers collide
    bar = solved_return(config)
    figure.axes[0].axhline(bar, ls="--", c="gray", label=f"solved ({bar:g})")
    legend = figure.axes[0].get_legend_handles_labels()  # below the panels, as wide as they are
    figure.legend(*legend, loc="outside lower center", ncols=1 + 90 // max(map(len, legend[1])))
    if frames is not None:
        policy = figure.add_subplot(panels[-1, :], xticks=[], yticks=[])
        policy.imshow(frames[len(frames) // 2])
        policy.set_title(f"the first run's policy after {rows[-1]['env_steps']:,} env steps")
    figure.canvas.draw_idle()  # a --live window shows it at its next events


def checkpoint(config: Config, grid: list[Point], params: Params, resume: dict) -> bytes:
    """Every run's parameters (leading run axis) with the config and each run's seed and point;
    a checkpoint to resume adds the train state (keys as words), the chunks done and their rows."""
    runs = [{"seed": config.seed + i, **point} for point in grid for i in range(config.num_seeds)]
    payload = {
        "script": SCRIPT,
        "env": env_name(config),
        "config": json.dumps(dataclasses.asdict(config)),
        "runs": json.loads(json.dumps(runs)),  # (a tuple as a list)
        "params": flax.serialization.to_state_dict(params),
    }
    return flax.serialization.msgpack_serialize(payload | flax.serialization.to_state_dict(resume))


def restored(payload: dict, layout: dict, where: str) -> dict:
    """The file's train states (to resume) or parameter trees as init makes them (`layout`), or one
    line naming the first entry that differs (the file of an older version, or of another copy)."""
    if missing := [name for name in layout if name not in payload]:
        raise UsageError(f"{where} does not fit this {SCRIPT}: {missing[0]} is absent in the file")
    saved = flatten_dict({name: payload[name] for name in layout}, sep=".")
    ours = flatten_dict(flax.serialization.to_state_dict(layout), sep=".")
    saved = {name: np.shape(x) for name, x in saved.items() if x is not None}
    ours = {name: x.shape for name, x in ours.items() if x is not None}
    for name in sorted(saved.keys() | ours.keys()):
        if saved.get(name) != ours.get(name):
            shapes = [shapes.get(name, "absent") for shapes in (saved, ours)]
            found = f"{name} is {shapes[0]} in the file, {shapes[1]} here"
            raise UsageError(f"{where} does not fit this {SCRIPT}: {found}")
    return payload | flax.serialization.from_state_dict(layout, {n: payload[n] for n in layout})


def load_checkpoint(path: Path, config: Config, options: Options) -> tuple[Config, dict]:
    """(the checkpoint's config, its contents). Config flags typed here are refused, except with
    --load-model the env's (a robustness check, if they keep the networks' shapes)."""
    flag = "--resume" if options.resume else "--load-model"
    try:
        payload = flax.serialization.msgpack_restore(path.read_bytes())
        fields = flatten_dict(json.loads(payload["config"]), sep=".")  # names as flags: env.<name>
    except Exception as error:  # whatever is wrong with the file, it is the same user error
        reason = getattr(error, "strerror", None) or "not a model or checkpoint file"
        raise UsageError(f"{flag} {path} is not a checkpoint of {SCRIPT} ({reason})") from None
    if payload["script"] != SCRIPT:
        found = f"a {payload['script']} checkpoint for {payload['env']}"
        raise UsageError(f"{flag} {path} is {found}, not {SCRIPT}'s")
    ours = flatten_dict(dataclasses.asdict(config), sep=".")
    if unknown := ", ".join(sorted(fields.keys() - ours.keys())):
        raise UsageError(f"{flag} {path}: its config has {unknown}, which this {SCRIPT} has not")
    fields = {name: tuple(v) if isinstance(v, list) else v for name, v in fields.items()}  # JSON's
    saved = with_values(Config(), fields)  # a field it lacks: this script's default
    theirs = flatten_dict(dataclasses.asdict(saved), sep=".")
    changed = {n: v for n, v in ours.items() if n in options.typed and v != theirs[n]}
    for name, value in changed.items():  # --load-model: other physics; --resume: more env steps
        if name == "total_timesteps" and options.resume:
            require(value > theirs[name], name, f">= {theirs[name]} (the saved run's)", value)
        elif name[:4] != "env." or options.resume:
            held = f"is {theirs[name]} in" if name in fields else "is not a field of"
            raise UsageError(f"--{name.replace('_', '-')} {held} the saved run; leave it out")
    saved = with_values(saved, changed)  # (restored checks that they keep the networks' shapes)
    validate(saved)  # the checkpoint's values meet this script's ranges too
    return saved, payload


# ---- several processes (--distributed) ----


def start_distributed(options: Options) -> None:
    """Join JAX's distributed runtime: jax.devices() then lists every process's devices."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPUs across processes
    try:
        jax.distributed.initialize(
            options.coordinator_address, options.num_processes, options.process_id
        )
    except (ValueError, TypeError) as error:
        flags = "--coordinator-address HOST:PORT --num-processes N --process-id I"
        raise UsageError(f"--distributed: {error}; without a cluster, give {flags}") from None


def is_lead() -> bool:
    return jax.process_index() == 0  # process 0 prints and writes for every process


def fetch(tree: Any) -> Any:
    """Every run's values as numpy arrays, on every process (with --distributed, a collective)."""
    return multihost_utils.process_allgather(tree, tiled=True)


def first_run(tree: Any) -> Any:
    """Run 0 of every array, from the first device of process 0, without the other processes."""
    return jax.tree.map(lambda x: np.asarray(x.addressable_data(0))[0], tree)


# ---- the training loop (a Ctrl-C or SIGTERM stops it after a chunk) and what watches it ----


def start_tracking(config: Config, options: Options, grid: list[Point], out: Path, ids: list):
    """--track, on process 0: a TensorBoard writer per run (training only) and, with
    --wandb-project-name, a W&B run per run (quiet: one line for all): its config as run (its
    seed, its grid point's values), grouped by grid point of this command; --resume goes on."""
    runs = [(point, config.seed + i) for point in grid for i in range(config.num_seeds)]
    names = ["_".join([f"seed{seed}", *describe(point).split()]) for point, seed in runs]
    writers = []
    if options.track and is_lead() and not options.eval_only:
        from tensorboardX import SummaryWriter  # optional: check_options found it installed

        writers = [SummaryWriter(str(out / "tensorboard" / name)) for name in names]
    if not (options.wandb_project_name and is_lead()):  # (check_options: only with --track)
        return writers, []
    import wandb  # optional, as tensorboardX is

    wandb_runs = [
        wandb.init(
            project=options.wandb_project_name,
            entity=options.wandb_entity,
            dir=out,
            id=run_id,  # None: a new run
            resume="must" if ids else None,  # --resume: the stopped run's W&B runs
            name=f"{out.name}/{name}",
            group=f"{out.name} {describe(point)}".strip(),  # W&B draws a group's mean
            job_type="eval" if options.eval_only else "train",
            config=dataclasses.asdict(with_values(config, point)) | {"seed": seed},
            settings=wandb.Settings(reinit="create_new", silent=True, console="off"),  # all at once
        )
        for (point, seed), name, run_id in zip(runs, names, ids or [None] * len(runs), strict=True)
    ]
    where = out / "wandb" if wandb_runs[0].offline else wandb_runs[0].project_url
    print(f"{SCRIPT}: W&B: {len(wandb_runs)} runs in {where}", flush=True)
    return writers, wandb_runs


def abort(signum: int, frame: Any) -> None:
    """End the run at once, no traceback: a KeyboardInterrupt can be lost in JAX's garbage-
    collection callback, and a normal exit while JAX's threads compile can crash."""
    sys.stdout.flush()
    os._exit(128 + signum)


def stop_on_signals(stop: list[int]) -> None:
    """A first Ctrl-C or SIGTERM stops after the chunk (exit 130 or 143), a second Ctrl-C aborts."""

    def request_stop(signum: int, frame: Any) -> None:
        if stop[0] and signum == signal.SIGINT:
            abort(signum, frame)
        stop[0] = stop[0] or 128 + signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name}: stopping after this chunk (Ctrl-C again aborts)", file=sys.stderr)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)


def chunk_rows(config: Config, grid: list[Point], metrics: Metrics, previous: list, now: float):
    """The chunk's metrics rows, one per run (`previous`: each run's last row, or zeros)."""
    seconds = now - previous[0]["wall_seconds"]  # unrounded: a chunk may take < 1 ms
    return [
        {
            "seed": config.seed + run % config.num_seeds,
            **json.loads(json.dumps(grid[run // config.num_seeds])),  # (a tuple as a list)
            "env_steps": int(metrics.env_steps[run]),
            "updates": int(metrics.updates[run]),
            "wall_seconds": now,
            "sps": (int(metrics.env_steps[run]) - before["env_steps"]) / seconds,
            **{name: float(getattr(metrics, name)[run]) for name in METRIC_COLUMNS},
        }
        for run, before in enumerate(previous)
    ]


def progress(metrics: Metrics, new_rows: list[dict], previous: list, done: float) -> str:
    """Env steps, rates of all runs together, train return over runs, losses, time and ETA."""
    now = new_rows[0]  # the first run's steps; `done`: the share of the chunks done
    updates = sum(row["updates"] for row in new_rows) - sum(row["updates"] for row in previous)
    updates /= now["wall_seconds"] - previous[0]["wall_seconds"]
    rates = f"SPS {sum(row['sps'] for row in new_rows):,.0f}, updates/s {updates:,.0f}"
    rates += f" (all {len(new_rows)} runs together)" if len(new_rows) > 1 else ""
    returns = metrics.episode_return[np.isfinite(metrics.episode_return)]  # runs with episodes
    shown = f"{returns.mean():.1f}" if returns.size else "-"
    shown += f" ± {returns.std():.1f} (min {returns.min():.1f})" if returns.size > 1 else ""
    losses = " ".join(f"{name} {np.mean(getattr(metrics, name)):.3g}" for name in PROGRESS_COLUMNS)
    steps = f"steps {now['env_steps']:,}/{round(now['env_steps'] / done):,} ({done:.0%})"
    times = f"{now['wall_seconds']:.1f} s, ETA {now['wall_seconds'] * (1 / done - 1):.1f} s"
    return f"{steps} | {rates} | train return {shown} | {losses} | {times}"


def non_finite(grid: list[Point], metrics: Metrics, new_rows: list[dict], chunk: int) -> str | None:
    """A line naming the chunk and the first run with a non-finite loss or parameter, or None."""
    losses = np.stack([getattr(metrics, name) for name in LOSS_COLUMNS], axis=1)
    updated = new_rows[0]["updates"] > 0  # before the first update the losses are NaN
    finite = metrics.params_finite & (np.isfinite(losses).all(axis=1) | (not updated))
    if finite.all():
        return None
    run = int(np.argmin(finite))
    point = describe(grid[run * len(grid) // len(new_rows)])
    where = f"chunk {chunk}, seed {new_rows[run]['seed']} {point}".strip()
    return f"{SCRIPT}: non-finite loss or parameter in {where}; stopped"


def train_and_log(
    config: Config, options: Options, runs: tuple, out: Path, saved: dict | None, stop: list[int]
) -> tuple[list[TrainState], dict]:
    """All runs' chunk as one program, states donated; the next dispatched before this is logged."""
    grid, configs, keys, values, tracking = runs  # by structure: configs, keys and floats
    start = time.perf_counter()
    sharding = keys["train"][0].sharding
    num_chunks = chunk_sizes(configs[0])[1]  # (sweep_grid: every structure's the same)
    if saved:  # the saved states, each run's part on its device (no fresh state made first)
        states = jax.device_put(saved["state"], sharding)
        print(f"{SCRIPT}: resumed at chunk {saved['chunk']} of {num_chunks} in {out}", flush=True)
    else:
        init = jax.jit(over_structures(initial, configs), out_shardings=sharding, **RUN_ONCE)
        states = init(values, keys["train"])

    def run_chunks(values: list[Point], states: list[TrainState], chunk: Array) -> tuple:
        """Every structure's chunk: (the states, every run's metrics, in grid order)."""

        def run_chunk(config: Config, state: TrainState) -> tuple:  # the chunk's index: one for all
            return make_train(config)[1](state, chunk)

        done = over_structures(run_chunk, configs)(values, states)
        metrics = jax.tree.map(lambda *parts: jnp.concatenate(parts), *[m for _, m in done])
        return [state for state, _ in done], metrics

    parameter_trees = jax.jit(over_structures(trained_params, configs), **RUN_ONCE)
    run_chunks = jax.jit(run_chunks, out_shardings=sharding, donate_argnums=1)
    level = CPU_CHUNK if jax.default_backend() == "cpu" else None
    run_chunks = run_chunks.lower(values, states, np.int32(0)).compile(compiler_options=level)
    compile_seconds = time.perf_counter() - start
    print(f"compiled in {compile_seconds:.1f} s", flush=True)
    rows = json.loads(saved["rows"]) if saved else []
    first_chunk = saved["chunk"] if saved else 0
    num_runs = len(grid) * config.num_seeds
    writers, wandb_runs = tracking  # --track: each run's, on process 0
    columns = ("updates", "wall_seconds", "sps", *METRIC_COLUMNS)  # logged at their env steps
    figure = None  # made when first drawn: matplotlib is slow to import
    first, render_key = with_values(configs[0], grid[0]), first_run(keys["render"][0])  # --live
    drawn = time.perf_counter()
    stop_on_signals(stop)  # (until here, a Ctrl-C aborts: compiling cannot be stopped)
    start = time.perf_counter() - (rows[-1]["wall_seconds"] if rows else 0.0)
    states, pending = run_chunks(values, states, np.int32(first_chunk))
    for chunk in range(first_chunk, num_chunks):
        while not all(leaf.is_ready() for leaf in jax.tree.leaves(pending)):
            time.sleep(0.01)  # waking often: a Ctrl-C is heard at once, a window stays live
            if figure is not None:
                figure.canvas.flush_events()
        metrics, stops = fetch((pending, np.array([stop[0]])))
        finished = chunk + 1 == num_chunks
        stopped = bool(stops.any()) and not finished  # a stop anywhere stops every process
        if stopped and not stop[0]:
            print(f"{SCRIPT}: Ctrl-C on another process: stopping after this chunk", flush=True)
        steps_per_chunk = int(metrics.env_steps[0]) // (chunk + 1)
        every = max(options.checkpoint_every // steps_per_chunk, 1)  # in whole chunks
        due = options.checkpoint_every > 0 and (chunk + 1) % every == 0 and not finished
        due = due or finished and options.keep_checkpoint  # the last state, to train on later
        kept = fetch((states, parameter_trees(values, states))) if due or stopped else None
        policy = first_run(parameter_trees(values, states)[0]) if options.live else None  # run 0's
        if not (finished or stopped):  # runs while this chunk is logged and drawn
            states, pending = run_chunks(values, states, np.int32(chunk + 1))
        previous = rows[-num_runs:] or [dict(env_steps=0, updates=0, wall_seconds=0.0)] * num_runs
        new_rows = chunk_rows(config, grid, metrics, previous, time.perf_counter() - start)
        rows += new_rows
        print(progress(metrics, new_rows, previous, (chunk + 1) / num_chunks), flush=True)
        for writer, row in zip(writers, new_rows, strict=False):
            for name in columns:
                writer.add_scalar(name, row[name], row["env_steps"])
        for wandb_run, row in zip(wandb_runs, new_rows, strict=False):
            wandb_run.log({name: row[name] for name in columns}, step=row["env_steps"])
        if is_lead():  # process 0 writes and draws
            write_atomic(out / "metrics.csv", csv_text(rows))
        if problem := non_finite(grid, metrics, new_rows, chunk + 1):  # every process stops here
            if is_lead():
                print(f"{problem} (the files in {out} hold the chunks so far)", file=sys.stderr)
            sys.exit(1)
        if is_lead() and kept is not None:  # after the chunk's rows: a resume goes on from here
            ids = json.dumps([wandb_run.id for wandb_run in wandb_runs])  # W&B's, to go on with
            resume = {"chunk": chunk + 1, "rows": json.dumps(rows), "state": kept[0], "wandb": ids}
            write_atomic(out / "checkpoint.msgpack", checkpoint(config, grid, kept[1], resume))
        due = finished or stopped or 0 < options.plot_every <= time.perf_counter() - drawn
        if is_lead() and (options.live or options.plot and due):
            frames = render_policy(first, policy, render_key) if options.live else None
            figure = figure or new_figure(options.live)
            draw_curves(figure, config, grid, rows, frames)
        if is_lead() and options.plot and due:
            png = io.BytesIO()
            figure.savefig(png, format="png", dpi=80)
            write_atomic(out / "curves.png", png.getvalue())
            drawn = time.perf_counter()
        if stopped:
            break
    for writer in writers:
        writer.close()
    train_seconds = rows[-1]["wall_seconds"]  # at the last chunk's end, before the last drawing
    return states, {
        "train_seconds": train_seconds,
        "compile_seconds": compile_seconds,
        "env_steps": rows[-1]["env_steps"],
        "updates": rows[-1]["updates"],
        "env_steps_per_second": rows[-1]["env_steps"] / train_seconds,
        "updates_per_second": rows[-1]["updates"] / train_seconds,
        "stopped_early": stopped,
        "exit_status": max(int(stops.max()), stop[0]),  # 130 after Ctrl-C, 143 after SIGTERM
    }


# ---- main ----


def main(config: Config, options: Options) -> None:
    """What `python <script>.py` does; the Ctrl-C and SIGTERM handlers are left as it found them."""
    handlers = {signum: signal.getsignal(signum) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        train_evaluate_and_write(config, options)
    except UsageError as error:  # found before anything compiles
        print(f"{SCRIPT}.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    finally:
        say_once.cache_clear()  # the next run says its lines again
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


def train_evaluate_and_write(config: Config, options: Options) -> None:
    started = time.time()  # the files written from here on are this run's
    compile_cache = enable_compile_cache(options)  # before anything starts JAX's backend
    check_options(options)
    if not (options.resume or options.eval_only):  # (else load_checkpoint checks the saved one)
        validate(config)
    if options.distributed:  # before anything starts JAX's backend (load_checkpoint does)
        start_distributed(options)
    path = Path(options.resume or options.load_model or "")  # a run folder, or its file
    if path.is_dir():  # --load-model: its model.msgpack if any; --resume: its checkpoint
        model = path / "model.msgpack"
        path = model if options.eval_only and model.is_file() else path / "checkpoint.msgpack"
    finished = options.resume and not path.exists() and (path.parent / "summary.json").exists()
    saved = None
    kept = not (finished and "total_timesteps" in options.typed)  # no last state to train on
    require(kept, "resume", "a run kept with --keep-checkpoint to train longer", str(path.parent))
    if (options.resume or options.eval_only) and not finished:
        config, saved = load_checkpoint(path, config, options)
    if finished or options.resume and saved.get("chunk") == chunk_sizes(config)[1]:
        print(f"{SCRIPT}: {path.parent} has finished: nothing to resume (see --keep-checkpoint)")
        sys.exit(0)
    shapes, floats = sweep_grid(config)
    grid = [shape | point for shape in shapes for point in floats]  # each structure's points
    configs = [with_values(config, shape) for shape in shapes]  # one program's runs each
    devices = jax.devices()  # of every process: the runs are sharded over all of them
    size = len(floats) * config.num_seeds  # a structure's runs: the float points x seeds
    divides = f"such that the {size} runs divide over the {len(devices)} devices"
    require(size % len(devices) == 0, "num_seeds", divides, config.num_seeds)
    sharding = NamedSharding(Mesh(np.array(devices), ("runs",)), PartitionSpec("runs"))
    keys = jax.tree.map(lambda key: [np.asarray(key)] * len(shapes), seed_keys(config, len(floats)))
    values = {name: np.float32([point[name] for point in floats]) for name in floats[0]}
    values = [jax.tree.map(lambda floats: floats.repeat(config.num_seeds), values)] * len(shapes)
    if saved:  # the file's trees, as init makes them
        layout = jax.eval_shape(over_structures(initial, configs), values, keys["train"])
        if options.eval_only:  # --load-model: the parameter trees alone
            layout = jax.eval_shape(over_structures(trained_params, configs), values, layout)
        physics = [f"--{n.replace('_', '-')}" for n in sorted(options.typed) if n[:4] == "env."]
        flag = "--resume" if options.resume else "--load-model"
        where = " with ".join([f"{flag} {path}", *physics])
        saved = restored(saved, {"params" if options.eval_only else "state": layout}, where)
    out = path.parent if options.resume else Path(options.output_dir or "runs")
    if is_lead():  # process 0 writes every output
        if not (options.output_dir or options.resume):  # a new folder, even in the same second
            prefix = f"{SCRIPT}{'_eval' if options.eval_only else ''}__{config.seed}__"
            out = out / f"{prefix}{int(time.time())}_{os.urandom(3).hex()}"
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise UsageError(f"--output-dir {out}: cannot make it ({error.strerror})") from None
        if any(out.iterdir()) and not (options.overwrite or options.resume):
            raise UsageError(f"--output-dir {out} holds files: --overwrite writes there")
        written = dataclasses.asdict(config)  # --eval-only: the fields the model has
        if options.eval_only:
            written = {name: written[name] for name in json.loads(saved["config"])}
        write_atomic(out / "config.json", json.dumps(written, indent=2))
    else:
        print(f"{SCRIPT}: process {jax.process_index()}, a worker; process 0 writes", flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # process 0 speaks
    keys, values = jax.device_put((keys, values), sharding)  # each process its runs'
    stop = [0]  # a Ctrl-C or SIGTERM once training runs: it ends with the run's outputs
    shown = f"{runs_text(config, grid)} x {config.num_envs} envs on {len(devices)} device(s)"
    where = f"({devices[0].device_kind}), {jax.process_count()} process(es)"
    print(f"{SCRIPT}: {env_name(config)}, {shown} {where}; compile cache: {compile_cache}")
    ids = json.loads(saved.get("wandb", "[]")) if options.resume else []  # W&B's runs go on
    tracking = start_tracking(config, options, grid, out, ids)
    if options.eval_only:
        held = jax.device_put(saved["params"], sharding)  # the model's parameter trees
        summary = {"model": str(path), "stopped_early": False, "exit_status": 0}
    else:
        runs = (grid, configs, keys, values, tracking)
        held, summary = train_and_log(config, options, runs, out, saved, stop)  # train states

    def evaluated(config: Config, held: Any, key: PRNGKey) -> tuple:  # the trees too: no compile
        params = held if options.eval_only else trained_params(config, held)  # of their own
        return params, make_evaluate(config, options.eval_episodes)(params, key)

    evaluate = jax.jit(over_structures(evaluated, configs), **RUN_ONCE)
    params, evaluation = zip(*fetch(evaluate(values, held, keys["evaluate"])), strict=True)
    evaluation = jax.tree.map(lambda *parts: np.concatenate(parts).mean(axis=1), *evaluation)
    if not is_lead():
        sys.exit(summary["exit_status"])  # process 0 writes the outputs
    if options.save_model and not options.eval_only:
        write_atomic(out / "model.msgpack", checkpoint(config, grid, list(params), {}))
    returns = evaluation["episode_return"].astype(float)  # (JSON's floats)
    extras = [name for name in evaluation if name != "episode_return"]  # swing-up's upright, say
    bar = solved_return(config)
    sweep = [  # per grid point: its values, its seeds' returns, their statistics, the solved share
        {**point, "final_returns": seeds.tolist(), **estimates(seeds)}
        | {"solved_fraction": (seeds >= bar).mean()}
        for point, seeds in zip(grid, returns.reshape(len(grid), -1), strict=True)
    ]
    overall = estimates(returns)  # over every run
    summary = {
        "env": env_name(config),  # the task (compare.py compares runs of one)
        "final_returns": returns.tolist(),
        **{f"final_return_{name}": value for name, value in overall.items()},
        "solved_runs": int((returns >= bar).sum()),
        "solved_return": bar,
        **{f"final_{name}": evaluation[name].tolist() for name in extras},
        **summary,
        "sweep": sweep if config.sweep else None,
        "num_seeds": config.num_seeds,
        "num_envs": config.num_envs,
        "device": f"{len(devices)} x {devices[0].device_kind}",
        "versions": {name: version(name) for name in ("jax", "jaxlib", "flax", "optax", "numpy")},
    }
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    if options.capture_gif:  # after the model and the summary: an env may have no renderer
        first = with_values(configs[0], grid[0])
        policy = jax.tree.map(lambda x: x[0], params[0])  # the first run's (fetched above)
        frames = render_policy(first, policy, first_run(keys["render"][0]))
        caption = f"{SCRIPT}, seed {config.seed} {describe(grid[0])}: return {returns[0]:.1f}"
        if frames is not None:
            write_atomic(out / "policy.gif", gif(frames, jitted_render(first)[1], caption))
    for run, wandb_run in enumerate(tracking[1]):  # W&B: each run's evaluation, run 0's GIF
        wandb_run.summary.update({f"final_{n}": float(v[run]) for n, v in evaluation.items()})
        if run == 0 and options.capture_gif and frames is not None:  # (start_tracking's import)
            wandb_run.log({"policy": sys.modules["wandb"].Video(str(out / "policy.gif"))})
        wandb_run.finish()
    if not (summary["stopped_early"] or options.keep_checkpoint):  # nothing to resume
        (out / "checkpoint.msgpack").unlink(missing_ok=True)
    num_runs = len(returns)
    mean, mean_ci, iqm, iqm_ci = report_cells(overall)
    spread = f"{mean} (population std of {num_runs} runs), 95% CI {mean_ci}; IQM {iqm}"
    spread = f"{spread}, 95% CI {iqm_ci}" if num_runs > 1 else f"{returns.mean():.1f}"
    episodes = f"{options.eval_episodes} deterministic episodes per run"
    solved = f"{summary['solved_runs']}/{num_runs} >= {bar:g}"
    shown = "".join(f", {name} {evaluation[name].mean():.3g}" for name in extras)
    print(f"evaluation, {episodes}: return {spread}; {solved}{shown}")
    if config.sweep:  # the report: a column per statistic; the best IQM and its overlaps marked
        best = max(sweep, key=lambda report: report["iqm"])  # (each point: as many seeds)
        columns = "grid point | returns per seed | mean ± std | 95% CI | IQM | 95% CI | solved"
        print(f"  {columns} (* the best IQM, ~ an IQM interval overlapping the best's)")
        for point, report in zip(grid, sweep, strict=True):
            finals = " ".join(f"{value:.1f}" for value in report["final_returns"])
            solved = f"{report['solved_fraction']:.0%}"
            overlaps = report["iqm_ci"] and report["iqm_ci"][1] >= best["iqm_ci"][0]
            mark = "*" if report is best else "~" if overlaps else " "
            print(mark, " | ".join([describe(point), finals, *report_cells(report), solved]))
    wrote = sorted(path.name for path in out.iterdir() if path.stat().st_mtime >= started)
    print(f"wrote {', '.join(wrote)} in {out}", flush=True)
    if summary["stopped_early"]:  # (a stop after the last chunk leaves nothing to go on from)
        print(f"to go on: python {SCRIPT}.py --resume {out}", flush=True)
    if max(summary["exit_status"], stop[0]):  # 130 after Ctrl-C, 143 after SIGTERM
        sys.exit(max(summary["exit_status"], stop[0]))


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The command line: the config's flags, then the options (tyro reads both, flat)."""

    config: Annotated[Config, tyro.conf.arg(name="")] = Config()
    run: Annotated[Options, tyro.conf.OmitArgPrefixes] = Options()


def parse_args(args: Sequence[str] | None = None) -> tuple[Config, Options]:
    args = sys.argv[1:] if args is None else list(args)
    parsed = tyro.cli(Arguments, args=args, description=__doc__.splitlines()[0])
    named = [word[2:].split("=")[0].replace("-", "_") for word in args if word.startswith("--")]
    typed = frozenset(name.replace(".no_", ".").removeprefix("no_") for name in named)  # --no-X: X
    return parsed.config, dataclasses.replace(parsed.run, typed=typed)


if __name__ == "__main__":
    signal.signal(signal.SIGINT, abort)  # a Ctrl-C before training (during compile, say)
    try:
        main(*parse_args())
    except BrokenPipeError:  # `--help | head` closed the pipe: end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
