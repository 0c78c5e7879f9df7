"""PPO on CartPole-v1, fully on device. Docs: docs/ppo.md

Proximal policy optimisation (Schulman et al. 2017) with generalised advantage estimation
(Schulman et al. 2016) and the implementation details of Huang et al. 2022, shaped like CleanRL's
ppo.py but pure JAX: the envs, the rollout, the advantages and every gradient step stay on the
device, and one compiled `lax.scan` runs a chunk of PPO iterations.

    python ppo_cartpole.py                   # train, evaluate, write runs/ppo_cartpole__1__<time>/
    python ppo_cartpole.py --num-seeds 16    # 16 seeds in one vmapped program
    python ppo_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

import csv
import dataclasses
import importlib.util
import io
import itertools
import json
import multiprocessing
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, get_type_hints

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
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

import envs

SCRIPT = "ppo_cartpole"
Params = Any  # a flax parameter tree

# ---- config ----


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """CartPole-v1's constants (envs.CartPoleParams); the defaults are gymnasium's."""

    gravity: float = 9.8
    """gravitational acceleration (m/s^2)"""
    masspole: float = 0.1
    """mass of the pole (kg)"""
    length: float = 0.5
    """half the pole's length (m)"""
    max_steps_in_episode: int = 500
    """time limit in steps (a truncation: GAE still bootstraps there)"""


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 1
    """seed of the first run; seed i of --num-seeds uses seed + i"""
    num_seeds: int = 1
    """independent runs trained at once in one vmapped program"""
    sweep: tuple[str, ...] = ()
    """NAME=V1,V2,... per swept field (learning-rate=1e-3,3e-3 ent-coef=0,0.01): every
    combination of the values x --num-seeds runs in one vmapped program (docs/sweeps.md)"""
    num_envs: int = 32
    """parallel envs per seed"""
    total_timesteps: int = 98_304
    """env steps per seed, all envs together (rounded down to whole chunks): 48 iterations"""
    learning_rate: float = 1e-2
    """Adam step size"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over training"""
    num_steps: int = 64
    """steps per env per rollout: one PPO iteration uses num_envs * num_steps env steps"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """lambda of generalised advantage estimation"""
    num_minibatches: int = 4
    """minibatches per epoch; must divide num_envs * num_steps"""
    update_epochs: int = 4
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
    hidden_size: int = 64
    """width of the two tanh hidden layers of the actor and of the critic"""
    eval_episodes: int = 10
    """greedy-policy episodes per seed in the final evaluation"""
    log_every: int = 12_288
    """env steps per chunk (whole iterations): one progress line and one metrics row per seed"""
    output_dir: str | None = None
    """where the outputs go; None: runs/ppo_cartpole__<seed>__<unix time>"""
    save_model: bool = True
    """write model.msgpack (every seed's parameters and this config)"""
    capture_gif: bool = True
    """write policy.gif (the first seed's greedy policy in four carts side by side)"""
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
    """CartPole-v1's constants"""


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


def trained_params(state: TrainState) -> Params:
    """What a checkpoint keeps and the evaluation reads."""
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
        flat_params, _ = jax.flatten_util.ravel_pytree(trained_params(state))
        metrics = Metrics(
            env_steps=iterations_done * batch_size,
            updates=iterations_done * updates_per_iteration,
            episode_return=masked_mean(log.episode_return, log.episode_ended),
            episode_length=masked_mean(log.episode_length, log.episode_ended),
            value_loss=losses.value_loss,
            policy_loss=losses.policy_loss,
            entropy=losses.entropy,
            approx_kl=losses.approx_kl,
            clip_frac=losses.clip_frac,
            params_finite=jnp.isfinite(flat_params).all(),
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


def make_evaluate(config: Config):
    """evaluate(params, key) -> {"episode_return": [eval_episodes]} of the greedy policy."""
    _, _, play = make_greedy_episodes(config)

    def evaluate(params: Params, key: PRNGKey) -> dict[str, Array]:
        returns, _ = play(params, key, config.eval_episodes)
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

SOLVED_RETURN = 475.0  # CartPole-v1's reward_threshold in gymnasium's registry
LOSS_COLUMNS = ("value_loss", "policy_loss", "entropy", "approx_kl", "clip_frac")  # checked for NaN
METRIC_COLUMNS = ("episode_return", "episode_length", *LOSS_COLUMNS)  # fields of Metrics
CSV_COLUMNS = ("seed", "env_steps", "updates", "wall_seconds", "sps", *METRIC_COLUMNS)
PROGRESS_COLUMNS = ("value_loss", "entropy", "approx_kl")  # on each progress line after the return
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
    for name in ("num_seeds", "num_envs", "num_steps", "total_timesteps", "num_minibatches"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("update_epochs", "hidden_size", "eval_episodes", "log_every"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name, value in dataclasses.asdict(config.env).items():
        require(value > 0, f"env.{name}", "> 0", value)
    require(
        0 <= config.seed < 2**31 - config.num_seeds,
        "seed",
        "in [0, 2**31 - num-seeds)",
        config.seed,
    )
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        require(getattr(config, name) > 0, name, "> 0", getattr(config, name))
    for name in ("ent_coef", "vf_coef"):
        require(getattr(config, name) >= 0, name, ">= 0", getattr(config, name))
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
    require(0 <= config.gae_lambda <= 1, "gae_lambda", "in [0, 1]", config.gae_lambda)
    batch_size = config.num_envs * config.num_steps
    divides = f"a divisor of --num-envs * --num-steps ({batch_size})"
    divides_ok = batch_size % config.num_minibatches == 0
    require(divides_ok, "num_minibatches", divides, config.num_minibatches)
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    chunk_steps = iterations_per_chunk * batch_size
    if not config.eval_only:
        one_chunk = f">= one chunk ({chunk_steps} env steps, see --log-every)"
        require(num_chunks >= 1, "total_timesteps", one_chunk, config.total_timesteps)
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
    defaults = flag_values(Config())
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
    return tyro.cli(Config, args=args, description=__doc__.splitlines()[0])


if __name__ == "__main__":
    try:
        config = parse_config()
    except BrokenPipeError:  # `--help | head` closed the pipe: end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    main(config)
