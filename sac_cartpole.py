"""SAC on continuous CartPole, balance and swing-up, fully on device. Docs: docs/sac.md

sac_pendulum.py's soft actor-critic (the same networks, buffer, losses and compiled chunk loop) on
envs.CartPoleContinuous (balance) or envs.CartPoleSwingup (swing the pole up from hanging down).
Terminations (the pole past 12 degrees, the cart off the track) stop bootstrapping; the time
limit does not. Each task has its own defaults (`default_config`).

    python sac_cartpole.py                           # balance; writes runs/sac_cartpole__1__<time>/
    python sac_cartpole.py --env-id CartPoleSwingup  # swing-up, with its own defaults (see --help)
    python sac_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Literal

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from chex import Array, PRNGKey
from flax import struct

import envs

SCRIPT = "sac_cartpole"
Params = Any  # a flax parameter tree

# ---- config ----


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """CartPole physics (envs.CartPoleParams); the defaults are gymnasium's CartPole-v1."""

    gravity: float = 9.8  # gravity (m/s^2)
    masscart: float = 1.0  # mass of the cart (kg)
    masspole: float = 0.1  # mass of the pole (kg)
    length: float = 0.5  # half the pole's length (m)
    force_mag: float = 10.0  # force of a full action (N); the policy's actions in [-1, 1] scale it
    tau: float = 0.02  # seconds per step (Euler integration)
    theta_threshold_radians: float = 12 * 2 * math.pi / 360
    """balance ends when |theta| exceeds this (swing-up ignores it)"""
    x_threshold: float = 2.4  # the episode ends when |x| exceeds this (the track's half length, m)
    max_steps_in_episode: int = 500  # time limit in steps (a truncation: the TD target bootstraps)


@dataclasses.dataclass(frozen=True)
class Config:
    env_id: Literal["CartPoleContinuous", "CartPoleSwingup"] = "CartPoleContinuous"
    """balance (CartPoleContinuous) or swing-up (CartPoleSwingup); each has its own defaults"""
    seed: int = 1  # seed of the first run; seed i of --num-seeds uses seed + i
    num_seeds: int = 1  # independent runs trained at once in one vmapped program
    sweep: tuple[str, ...] = ()
    """NAME=V1,V2,... per swept field (q-lr=1e-3,3e-3 tau=0.1,0.2): every combination of the
    values x --num-seeds runs in one vmapped program (docs/sweeps.md)"""
    num_envs: int = 1024  # parallel envs per seed
    total_timesteps: int = 4_096_000  # env steps per seed (all envs together), warm-up included
    policy_lr: float = 3e-3  # Adam step size of the actor
    q_lr: float = 3e-3  # Adam step size of the critics and of the temperature (CleanRL's q_lr)
    gamma: float = 0.99  # discount factor
    tau: float = 0.2
    """Polyak step of the target critics: target <- tau * critic + (1 - tau) * target"""
    batch_size: int = 256  # transitions per gradient update
    buffer_size: int = 100_000  # replay buffer capacity in transitions (per seed)
    learning_starts: int = 1_000  # env steps of uniformly random actions before the first update
    updates_per_step: int = 1  # gradient updates per vectorised env step (of num_envs transitions)
    hidden_sizes: tuple[int, ...] = (128, 128)  # hidden layer widths of the actor and each critic
    max_grad_norm: float | None = None
    """clip the actor's and critics' gradients to this global norm (optax.clip_by_global_norm)"""
    autotune: bool = True
    """tune the temperature alpha towards --target-entropy (from alpha = 1); off: fixed --alpha"""
    alpha: float = 0.2  # the fixed temperature with --no-autotune (CleanRL's default)
    target_entropy: float | None = 0.0
    """entropy that the temperature is tuned towards; None: -|A| (the SAC paper's choice)"""
    log_every: int = 204_800  # env steps (all envs) per chunk: a progress line and a metrics row
    env: EnvConfig = EnvConfig()  # CartPole physics


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
class IterationLog:
    """What one iteration reports to its chunk's metrics."""

    episode_ended: Array  # [num_envs]
    episode_return: Array  # [num_envs], of the episodes that ended
    episode_length: Array  # [num_envs]
    learning: Array  # whether this iteration updated the networks
    losses: Losses


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


@dataclasses.dataclass(frozen=True)
class Agent:
    """What make_train builds once and the update steps read: the networks, their optimisers and
    the action bounds. Static; the train state holds everything that changes."""

    config: Config
    actor: Actor
    critic: Critic
    actor_optimizer: optax.GradientTransformation
    critic_optimizer: optax.GradientTransformation
    alpha_optimizer: optax.GradientTransformation
    action_scale: Array
    action_offset: Array
    target_entropy: float

    def policy(self, actor_params: Params, obs: Array, noise: Array) -> tuple[Array, Array]:
        mean, log_std = self.actor.apply(actor_params, obs)
        return squashed_gaussian_sample(mean, log_std, noise, self.action_scale, self.action_offset)

    def q_values(self, critic_params: Params, obs: Array, action: Array) -> Array:
        return jax.vmap(self.critic.apply, in_axes=(0, None, None))(critic_params, obs, action)


def update_critic(agent: Agent, learner: Learner, batch: Transition, key: PRNGKey):
    """A gradient step on the twin critics towards the soft TD target; Polyak targets."""
    alpha = jnp.exp(learner.log_alpha)
    next_noise = jax.random.normal(key, batch.action.shape)
    next_action, next_log_prob = agent.policy(learner.actor_params, batch.next_obs, next_noise)
    next_q = agent.q_values(learner.target_critic_params, batch.next_obs, next_action)
    target = td_target(batch, next_q, next_log_prob, alpha, agent.config.gamma)
    loss_grad = jax.value_and_grad(critic_loss, has_aux=True)
    (loss, q), grads = loss_grad(learner.critic_params, batch, target, agent.q_values)
    updates, opt_state = agent.critic_optimizer.update(
        grads, learner.critic_opt_state, learner.critic_params
    )
    critic_params = optax.apply_updates(learner.critic_params, updates)
    learner = learner.replace(
        critic_params=critic_params,
        target_critic_params=optax.incremental_update(
            critic_params, learner.target_critic_params, agent.config.tau
        ),
        critic_opt_state=opt_state,
    )
    return learner, loss, q


def update_actor(agent: Agent, learner: Learner, obs: Array, key: PRNGKey):
    """A gradient step on the actor against the updated critics."""
    alpha = jnp.exp(learner.log_alpha)
    noise = jax.random.normal(key, (obs.shape[0], agent.action_scale.shape[-1]))
    loss_grad = jax.value_and_grad(actor_loss, has_aux=True)
    (loss, log_prob), grads = loss_grad(
        learner.actor_params, learner.critic_params, obs, noise, alpha, agent.policy, agent.q_values
    )
    updates, opt_state = agent.actor_optimizer.update(
        grads, learner.actor_opt_state, learner.actor_params
    )
    actor_params = optax.apply_updates(learner.actor_params, updates)
    return learner.replace(actor_params=actor_params, actor_opt_state=opt_state), loss, log_prob


def update_temperature(agent: Agent, learner: Learner, log_prob: Array) -> Learner:
    """A gradient step on log(alpha) towards the target entropy (with --autotune)."""
    grad = jax.grad(alpha_loss)(learner.log_alpha, log_prob, agent.target_entropy)
    updates, opt_state = agent.alpha_optimizer.update(
        grad, learner.alpha_opt_state, learner.log_alpha
    )
    log_alpha = optax.apply_updates(learner.log_alpha, updates)
    return learner.replace(log_alpha=log_alpha, alpha_opt_state=opt_state)


def update(agent: Agent, buffer: Buffer, learner: Learner, key: PRNGKey) -> tuple[Learner, Losses]:
    """One SAC update on a batch from the buffer: the critics, then the actor, then the
    temperature (rejax's order of steps)."""
    key_batch, key_critic, key_actor = jax.random.split(key, 3)
    alpha = jnp.exp(learner.log_alpha)  # logged before this update changes it
    batch = buffer_sample(buffer, key_batch, agent.config.batch_size)
    learner, critic_loss_value, q = update_critic(agent, learner, batch, key_critic)
    learner, actor_loss_value, log_prob = update_actor(agent, learner, batch.obs, key_actor)
    if agent.config.autotune:
        learner = update_temperature(agent, learner, log_prob)
    learner = learner.replace(updates=learner.updates + 1)
    losses = Losses(
        critic_loss=critic_loss_value,
        actor_loss=actor_loss_value,
        alpha=alpha,
        q_mean=jnp.mean(q),
        entropy=-jnp.mean(log_prob),
    )
    return learner, losses


def make_train(config: Config):
    """Static work once; returns the pure functions init(key) -> state, run_chunk(state, chunk)
    -> (state, metrics) and train(key) -> (state, metrics with a leading chunk axis)."""
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    obs_dim = env.observation_space(env_params).shape[0]
    action_dim = env.action_space(env_params).shape[0]
    action_scale, action_offset = action_bounds(env, env_params)
    num_envs = config.num_envs
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    # Clipping, if asked for, is by the global norm, as the flag's name says.
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    agent = Agent(
        config=config,
        actor=Actor(config.hidden_sizes, action_dim),
        critic=Critic(config.hidden_sizes),
        actor_optimizer=optax.chain(*clip, optax.adam(config.policy_lr)),
        critic_optimizer=optax.chain(*clip, optax.adam(config.q_lr)),
        alpha_optimizer=optax.adam(config.q_lr),
        action_scale=action_scale,
        action_offset=action_offset,
        target_entropy=-action_dim if config.target_entropy is None else config.target_entropy,
    )

    def init(key: PRNGKey) -> TrainState:
        """Fresh networks, optimisers and envs, and an empty buffer."""
        key_actor, key_critic, key_envs, key_loop = jax.random.split(key, 4)
        reset_envs = jax.vmap(env.reset, in_axes=(0, None))
        obs, env_state = reset_envs(jax.random.split(key_envs, num_envs), env_params)
        actor_params = agent.actor.init(key_actor, obs)
        critic_keys = jax.random.split(key_critic, 2)  # twin critics
        critic_init = jax.vmap(agent.critic.init, in_axes=(0, None, None))
        critic_params = critic_init(critic_keys, obs, jnp.zeros((num_envs, action_dim)))
        # alpha = 1 at the start when tuned, as in CleanRL
        log_alpha = jnp.log(jnp.float32(1.0 if config.autotune else config.alpha))
        learner = Learner(
            actor_params=actor_params,
            critic_params=critic_params,
            target_critic_params=critic_params,
            log_alpha=log_alpha,
            actor_opt_state=agent.actor_optimizer.init(actor_params),
            critic_opt_state=agent.critic_optimizer.init(critic_params),
            alpha_opt_state=agent.alpha_optimizer.init(log_alpha),
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

    def learn(learner: Learner, buffer: Buffer, key: PRNGKey) -> tuple[Learner, Losses]:
        """updates_per_step updates in a row; their losses averaged."""
        update_keys = jax.random.split(key, config.updates_per_step)
        learner, losses = jax.lax.scan(
            functools.partial(update, agent, buffer), learner, update_keys
        )
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
        policy_action, _ = agent.policy(state.learner.actor_params, state.obs, noise)
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
        log = IterationLog(
            episode_ended=info["returned_episode"],
            episode_return=info["episode_return"],
            episode_length=info["episode_length"],
            learning=learning,
            losses=losses,
        )
        return state, log

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """Chunk number `chunk` (from 0): iterations_per_chunk iterations in one scan."""
        indices = chunk * iterations_per_chunk + jnp.arange(iterations_per_chunk)
        state, log = jax.lax.scan(iteration, state, indices)
        params = jax.tree.leaves(trained_params(state))
        metrics = Metrics(
            env_steps=state.env_steps,
            updates=state.learner.updates,
            episode_return=masked_mean(log.episode_return, log.episode_ended),
            episode_length=masked_mean(log.episode_length, log.episode_ended),
            critic_loss=masked_mean(log.losses.critic_loss, log.learning),
            actor_loss=masked_mean(log.losses.actor_loss, log.learning),
            alpha=masked_mean(log.losses.alpha, log.learning),
            q_mean=masked_mean(log.losses.q_mean, log.learning),
            entropy=masked_mean(log.losses.entropy, log.learning),
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


def make_evaluate(config: Config, num_episodes: int):
    """evaluate(params, key) -> {"episode_return", "upright"}, each [num_episodes], of the
    deterministic policy: whole episodes without auto-reset, rewards after a termination masked.
    "upright" is 1.0 where the pole stayed within UPRIGHT_RADIANS of vertical (the angle taken
    in [-pi, pi)), with the episode still running, at every step of the episode's second half."""
    env, env_params, act = make_deterministic_policy(config)
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

import csv
import importlib.util
import io
import itertools
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Annotated, NamedTuple, get_type_hints

import flax.serialization
import numpy as np
import tyro
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec

SOLVED_RETURN = 475.0  # CartPole-v1's bar (gymnasium); swing-up is judged by "upright"
LOSS_COLUMNS = ("critic_loss", "actor_loss", "alpha", "q_mean", "entropy")  # checked for NaN
METRIC_COLUMNS = ("episode_return", "episode_length", *LOSS_COLUMNS)  # fields of Metrics
PROGRESS_COLUMNS = ("critic_loss", "actor_loss", "alpha")  # on each progress line after the return
EVAL_EPISODES = 100  # deterministic-policy episodes per run in the final evaluation, by default


@dataclasses.dataclass(frozen=True)
class Options:
    """What a run writes, shows and runs on: nothing here changes what is learned."""

    output_dir: str | None = None  # where the outputs go; None: runs/<script>__<seed>__<time>
    overwrite: bool = False  # write into an --output-dir that holds files (replacing ours only)
    eval_episodes: int = EVAL_EPISODES  # deterministic-policy episodes per run in the evaluation
    save_model: bool = True  # write model.msgpack (every run's parameters and the config)
    checkpoint_every: int = 10_000_000  # env steps between periodic checkpoint writes (0: off)
    resume: str | None = None  # a run folder (or its checkpoint.msgpack): go on where it stopped
    capture_gif: bool = True  # write policy.gif (the first run's policy in a few envs)
    plot: bool = True  # write curves.png (the metrics against env steps)
    plot_every: float = 15.0  # seconds between redraws of curves.png while training (0: at the end)
    live: bool = False  # show the curves and the first run's policy in a window, every chunk
    track: bool = False  # write TensorBoard event files per run into tensorboard/ (tensorboardX)
    load_model: str | None = None  # a model.msgpack to evaluate with --eval-only
    eval_only: bool = False  # evaluate (and render) the --load-model checkpoint; no training
    compile_cache: bool = True  # JAX's persistent cache: $JAX_COMPILATION_CACHE_DIR or ours
    distributed: bool = False  # one program over several processes or hosts (docs/distributed.md)
    coordinator_address: str | None = None  # HOST:PORT of process 0 (unless a cluster is detected)
    num_processes: int | None = None  # processes of a --distributed run
    process_id: int | None = None  # this process's index in [0, --num-processes)
    coordinator_timeout: float = 120.0  # seconds the --distributed processes wait for each other


class UsageError(Exception):
    """A user error: reported as one line, exit status 2, no traceback."""


def require(holds: bool, name: str, allowed: str, value: Any) -> None:
    if not holds:
        raise UsageError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")


def validate(config: Config) -> None:
    """Raise UsageError naming the first bad flag and its allowed range; compiles nothing."""
    for name in ("num_seeds", "num_envs", "total_timesteps", "batch_size", "updates_per_step"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("policy_lr", "q_lr", "alpha", "log_every"):
        require(getattr(config, name) > 0, name, "> 0", getattr(config, name))
    for name, value in vars(config.env).items():
        require(value > 0, f"env.{name}", "> 0", value)
    require(0 <= config.seed < 2**31 - config.num_seeds, "seed", "in [0, 2**31 - N)", config.seed)
    require(0 < config.gamma <= 1, "gamma", "in (0, 1]", config.gamma)
    require(0 < config.tau <= 1, "tau", "in (0, 1]", config.tau)
    require(
        config.buffer_size >= config.num_envs, "buffer_size", ">= --num-envs", config.buffer_size
    )
    require(
        config.batch_size <= config.buffer_size, "batch_size", "<= --buffer-size", config.batch_size
    )
    norm_ok = config.max_grad_norm is None or config.max_grad_norm > 0
    require(norm_ok, "max_grad_norm", "> 0 or None", config.max_grad_norm)
    widths_ok = len(config.hidden_sizes) > 0 and min(config.hidden_sizes) >= 1
    require(widths_ok, "hidden_sizes", "one or more widths >= 1", config.hidden_sizes)
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    chunk = f"one chunk ({iterations_per_chunk * config.num_envs} env steps, --log-every)"
    require(num_chunks >= 1, "total_timesteps", f">= {chunk}", config.total_timesteps)
    trained = num_chunks * iterations_per_chunk * config.num_envs
    starts_ok = 0 <= config.learning_starts < trained
    require(starts_ok, "learning_starts", f"in [0, {trained})", config.learning_starts)


def check_options(options: Options) -> None:
    require(options.eval_episodes >= 1, "eval_episodes", ">= 1", options.eval_episodes)
    require(options.plot_every >= 0, "plot_every", ">= 0 seconds", options.plot_every)
    require(options.checkpoint_every >= 0, "checkpoint_every", ">= 0", options.checkpoint_every)
    resume_ok = options.resume is None or not (options.eval_only or options.output_dir)
    alone = "without --eval-only and --output-dir (it goes on in its folder)"
    require(resume_ok, "resume", alone, options.resume)
    if options.eval_only != (options.load_model is not None):
        raise UsageError("--eval-only and --load-model PATH go together (evaluate a checkpoint)")
    exists = options.load_model is None or Path(options.load_model).is_file()
    require(exists, "load_model", "an existing file", options.load_model)
    cluster = (options.coordinator_address, options.num_processes, options.process_id)
    if not options.distributed and cluster != (None, None, None):
        raise UsageError("--coordinator-address, --num-processes, --process-id need --distributed")
    count = 2**31 if options.num_processes is None else options.num_processes
    require(count >= 1, "num_processes", ">= 1", options.num_processes)
    process_ok = 0 <= (options.process_id or 0) < count
    require(process_ok, "process_id", "in [0, --num-processes)", options.process_id)
    timeout_ok = options.coordinator_timeout > 0
    require(timeout_ok, "coordinator_timeout", "> 0 seconds", options.coordinator_timeout)
    host, _, port = (options.coordinator_address or "host:1").rpartition(":")
    address_ok = bool(host) and port.isdigit() and 0 < int(port) < 2**16
    require(address_ok, "coordinator_address", "HOST:PORT", options.coordinator_address)
    if options.track and importlib.util.find_spec("tensorboardX") is None:
        raise UsageError("--track needs tensorboardX: pip install tensorboardX")


# --sweep may vary the float fields (rates, coefficients, env physics): they set no shape and no
# Python branch, so they can be traced values inside the one vmapped program.
SWEEPABLE = tuple(
    prefix + name
    for prefix, fields in (("", Config), ("env.", EnvConfig))
    for name, hint in get_type_hints(fields).items()
    if hint in (float, float | None)
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
    """Every combination of the --sweep values (one empty point without --sweep); UsageError for
    a field that cannot be swept and for a value that is not a number or that validate rejects."""
    values: dict[str, list[float]] = {}
    for entry in config.sweep:
        flag, _, listed = entry.partition("=")
        name = flag.removeprefix("--").replace("-", "_")
        if name not in SWEEPABLE:
            can = ", ".join(name.replace("_", "-") for name in SWEEPABLE)
            raise UsageError(f"--sweep {entry}: {flag} cannot be swept; these can: {can}")
        require(name not in values, "sweep", "one entry per field", entry)
        try:
            values[name] = [float(value) for value in listed.split(",")]
        except ValueError:
            raise UsageError(f"--sweep {entry}: expected {flag}=V1,V2,... (numbers)") from None
        require(len(set(values[name])) == len(values[name]), "sweep", "distinct values", entry)
    grid = [dict(zip(values, point, strict=True)) for point in itertools.product(*values.values())]
    for number, point in enumerate(grid, start=1):
        try:
            validate(with_values(config, point))
        except UsageError as error:
            where = f"grid point {number} of {len(grid)} ({describe(point)})"
            raise UsageError(f"--sweep {where}: {error}") from None
    return grid


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


def start_distributed(options: Options) -> None:
    """Join JAX's distributed runtime: jax.devices() then lists every process's devices. A worker
    first waits for process 0's port, where jax would abort with a C++ trace."""
    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # CPUs across processes
    host, _, port = (options.coordinator_address or "").rpartition(":")
    deadline = time.monotonic() + options.coordinator_timeout
    while options.process_id and not listening(host, port):
        if time.monotonic() > deadline:
            where = f"{options.coordinator_address} within {options.coordinator_timeout:g} s"
            raise UsageError(f"--distributed: process 0 not reached at {where}")
        time.sleep(0.2)
    try:
        jax.distributed.initialize(
            options.coordinator_address,
            options.num_processes,
            options.process_id,
            initialization_timeout=round(options.coordinator_timeout),
        )
    except (ValueError, TypeError) as error:
        flags = "--coordinator-address HOST:PORT --num-processes N --process-id I"
        raise UsageError(
            f"--distributed: {error} (with no cluster detected, give {flags})"
        ) from None


def listening(host: str, port: str) -> bool:
    try:
        socket.create_connection((host, int(port)), timeout=1).close()
    except OSError:
        return False
    return True


def is_lead() -> bool:
    return jax.process_index() == 0  # process 0 prints and writes for every process


def fetch(tree: Any) -> Any:
    """Every run's values as numpy arrays, on every process (with --distributed, a collective)."""
    return multihost_utils.process_allgather(tree, tiled=True)


def first_run(tree: Any) -> Any:
    """Run 0 of every array, from the first device of process 0, without the other processes."""
    return jax.tree.map(lambda x: x.addressable_data(0)[0], tree)


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


def png(figure: Any) -> bytes:
    data = io.BytesIO()
    figure.savefig(data, format="png", dpi=80)
    return data.getvalue()


class Plots:
    """Every metric against env steps (per grid point: the mean over its seeds and the min-max
    band) and, with --live, the first run's current policy, in a window where there is a display.
    Drawn in the main thread while the next chunk runs on the device."""

    def __init__(self, config: Config, options: Options, grid: list[Point]) -> None:
        import matplotlib.pyplot as plt  # here: it is slow to import

        self.plt = plt
        self.labels = [describe(point) or None for point in grid]
        self.window = options.live and plt.get_backend().lower() not in ("agg", "pdf", "svg")
        rows = len(METRIC_COLUMNS) // 3 + 1  # and a panel for the policy
        self.figure = (plt.figure if self.window else plt.Figure)(
            figsize=(13, 3.2 * rows), layout="constrained"
        )
        runs = f"{len(grid)} grid point(s) x {config.num_seeds} seed(s)"
        self.figure.suptitle(f"{SCRIPT} on {env_name(config)}, {runs}")
        self.axes = self.figure.subplots(rows, 3).flat
        for axis in self.axes[len(METRIC_COLUMNS) :]:
            axis.set_axis_off()
        self.render = jax.jit(make_render(with_values(config, grid[0]))[0])
        self.frames: np.ndarray | None = None
        if self.window:
            plt.show(block=False)

    def update(self, rows: list[dict], frames: Array | None) -> None:
        """Redraw from every metrics row so far (grid point major, then seed, in each chunk)."""
        steps = np.unique([row["env_steps"] for row in rows])
        for axis, name in zip(self.axes, METRIC_COLUMNS, strict=False):
            values = np.ma.masked_invalid([row[name] for row in rows])  # NaN: nothing to average
            values = values.reshape(len(steps), len(self.labels), -1)
            axis.clear()
            for point, label in enumerate(self.labels):
                axis.plot(steps, values[:, point].mean(axis=1), label=label)
                low = values[:, point].min(axis=1)
                axis.fill_between(steps, low, values[:, point].max(axis=1), alpha=0.3)
            axis.set(title=name, xlabel="env steps")
        self.axes[0].axhline(SOLVED_RETURN, ls="--", c="gray", label=f"solved ({SOLVED_RETURN:g})")
        self.axes[0].legend(fontsize="small")
        if frames is not None:
            self.frames = np.asarray(frames)
            self.image = self.axes[-1].imshow(self.frames[0])
            self.axes[-1].set(title="the first run's policy now", xticks=[], yticks=[])

    def animate(self) -> bool:
        """The policy's next frame in the window, if it is open; False if there is none."""
        if not self.window or self.frames is None or not self.plt.fignum_exists(self.figure.number):
            return False
        self.image.set_data(self.frames[int(time.monotonic() * 20) % len(self.frames)])
        self.plt.pause(0.05)
        return True

    def save(self, path: Path) -> None:
        write_atomic(path, png(self.figure))


def write_sweep(out: Path, config: Config, grid: list[Point], returns: np.ndarray) -> list[dict]:
    """sweep.csv and sweep.png (each grid point's final returns: its seeds as points and their
    mean); returns the report: per grid point its values, returns, mean, std and solved share."""
    from matplotlib.figure import Figure

    returns = returns.reshape(len(grid), config.num_seeds)
    report = [
        {
            **point,
            "mean": float(point_returns.mean()),
            "std": float(point_returns.std()),
            "solved_fraction": float((point_returns >= SOLVED_RETURN).mean()),
            "final_returns": point_returns.tolist(),
        }
        for point, point_returns in zip(grid, returns, strict=True)
    ]
    write_atomic(out / "sweep.csv", csv_text(report))
    figure = Figure(figsize=(max(6, len(grid) + 2), 4.5), layout="constrained")
    axis = figure.subplots()
    axis.plot(range(len(grid)), returns, ".", c="gray")  # a point per seed
    axis.plot(returns.mean(axis=1), "o", label="mean over seeds")
    labels = [describe(point).replace(" ", "\n") for point in grid]
    axis.set_xticks(range(len(grid)), labels, rotation=90 if len(grid) > 8 else 0)
    axis.axhline(SOLVED_RETURN, ls="--", c="gray", label=f"solved ({SOLVED_RETURN:g})")
    axis.set(ylabel="final return", title=f"{SCRIPT}: {config.num_seeds} seed(s) per grid point")
    axis.legend(fontsize="small")
    write_atomic(out / "sweep.png", png(figure))
    return report


def gif(frames: np.ndarray, seconds_per_frame: float, caption: str) -> bytes:
    """Frames [time, height, width, 3] as a GIF playing in real time, the caption above them."""
    from PIL import Image, ImageDraw  # matplotlib's dependency

    frames = np.pad(frames, ((0, 0), (16, 0), (0, 0), (0, 0)), constant_values=255)
    # One palette for every frame, from frames across the GIF (a snake's colours may not be on the
    # first): PIL would otherwise find a palette per frame, 0.8 s more for a 500-frame episode.
    palette = Image.fromarray(np.concatenate(frames[:: max(len(frames) // 8, 1)])).quantize(32)
    images = [Image.fromarray(frame) for frame in frames]
    for image in images:
        ImageDraw.Draw(image).text((4, 2), caption, fill=(0, 0, 0))
    images = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    data = io.BytesIO()
    milliseconds = round(1000 * seconds_per_frame)
    images[0].save(data, "GIF", save_all=True, append_images=images[1:], duration=milliseconds)
    return data.getvalue()


def checkpoint(config: Config, grid: list[Point], params: Params, resume: dict | None) -> bytes:
    """Every run's parameters (leading run axis) with the config and each run's seed and point;
    a resumable one adds the train state, the chunks done and their metrics rows."""
    seeds = range(config.seed, config.seed + config.num_seeds)
    payload = {
        "script": SCRIPT,
        "env": env_name(config),
        "config": json.dumps(dataclasses.asdict(config)),
        "runs": [{"seed": seed, **point} for point in grid for seed in seeds],
        "params": flax.serialization.to_state_dict(params),
    }
    return flax.serialization.msgpack_serialize(payload | (resume or {}))


def flat(config: Config) -> dict[str, Any]:
    """Every field under its command-line name (the env's as env.<name>)."""
    fields = {name: value for name, value in vars(config).items() if name != "env"}
    return fields | {f"env.{name}": value for name, value in vars(config.env).items()}


def load_checkpoint(path: Path, config: Config, flag: str) -> tuple[Config, dict]:
    """(the checkpoint's config, its contents); UsageError for a file that is not this script's
    checkpoint, and for a flag given here that the checkpoint's config overrides."""
    try:
        payload = flax.serialization.msgpack_restore(path.read_bytes())
        saved = json.loads(payload["config"])
        if payload["script"] != SCRIPT:
            found = f"a {payload['script']} checkpoint for {payload['env']}"
            raise UsageError(f"{flag} {path} is {found}, not {SCRIPT}'s")
        saved = {name: tuple(v) if isinstance(v, list) else v for name, v in saved.items()}
        saved = Config(**saved | {"env": EnvConfig(**saved["env"])})
    except UsageError:
        raise
    except Exception as error:  # whatever is wrong with the file, it is the same user error
        reason = getattr(error, "strerror", None) or type(error).__name__
        message = f"{flag} {path} is not a checkpoint of {SCRIPT} ({reason})"
        raise UsageError(message) from None
    # A flag given here must be the default the command line parsed over or the checkpoint's.
    defaults = flat(default_config(config.env_id)) | {"env_id": Config().env_id}
    for name, default in defaults.items():
        if flat(config)[name] not in (default, flat(saved)[name]):
            raise UsageError(f"--{name.replace('_', '-')} is set by the checkpoint; leave it out")
    validate(saved)  # the checkpoint's values meet this script's ranges too
    return saved, payload


def is_key(leaf: Any) -> bool:
    return jnp.issubdtype(leaf.dtype, jax.dtypes.prng_key)


def key_words(tree: Any) -> Any:
    """Typed PRNG keys as their raw uint32 words, which numpy and msgpack can hold."""
    return jax.tree.map(lambda leaf: jax.random.key_data(leaf) if is_key(leaf) else leaf, tree)


def saved_state(config: Config, grid: list[Point], payload: dict, path: Path) -> Any:
    """The checkpoint's train state (keys as words); UsageError unless it has this layout."""
    if "state" not in payload:
        raise UsageError(f"--resume {path} holds parameters only: give the run's folder")
    init = jax.vmap(make_train(config)[0])
    layout = jax.eval_shape(lambda: key_words(init(seed_keys(config, len(grid)).train)))
    try:
        words = flax.serialization.from_state_dict(layout, payload["state"])
    except (KeyError, ValueError, TypeError):
        words = None
    if words is None or jax.tree.map(np.shape, words) != jax.tree.map(np.shape, layout):
        raise UsageError(f"--resume {path} holds another layout of the train state")
    return words


def typed_keys(layout: Any) -> Callable[[Any], Any]:
    """A function of saved words: the leaves that are PRNG keys in `layout` typed as keys again."""

    def restore(words: Any) -> Any:
        return jax.tree.map(
            lambda key, saved: jax.random.wrap_key_data(saved) if is_key(key) else saved,
            layout,
            words,
        )

    return restore


class SeedKeys(NamedTuple):
    """Per run (grid points x seeds), three independent keys split once from the run's seed."""

    train: PRNGKey
    evaluate: PRNGKey
    render: PRNGKey


def seed_keys(config: Config, num_points: int = 1) -> SeedKeys:
    """Run r (grid point r // num_seeds) is the run of --seed (seed + r % num_seeds) alone."""
    seeds = config.seed + jnp.arange(num_points * config.num_seeds) % config.num_seeds
    keys = jax.vmap(lambda seed: jax.random.split(jax.random.key(seed), 3))(seeds)
    return SeedKeys(train=keys[:, 0], evaluate=keys[:, 1], render=keys[:, 2])


def abort(signum: int, frame: Any) -> None:
    """End the run at once, exit 130, no traceback: a KeyboardInterrupt can be lost in JAX's
    garbage-collection callback, and a normal exit while JAX's threads compile can crash."""
    sys.stdout.flush()
    os._exit(128 + signum)


def stop_on_signals() -> list[int]:
    """The first Ctrl-C or SIGTERM (a scheduler's notice) asks the loop to stop after the chunk in
    progress and to exit with 130 or 143, as a shell expects; a second Ctrl-C aborts."""
    stop = [0]

    def request_stop(signum: int, frame: Any) -> None:
        if stop[0] and signum == signal.SIGINT:
            abort(signum, frame)
        stop[0] = stop[0] or 128 + signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"\n{name}: stopping after this chunk (Ctrl-C again aborts)", file=sys.stderr)

    signal.signal(signal.SIGINT, request_stop)
    signal.signal(signal.SIGTERM, request_stop)
    return stop


def open_tensorboard(config: Config, grid: list[Point], out: Path, rows: list[dict]) -> list:
    """A tensorboardX writer per run in tensorboard/<seed and grid point>, the config as text."""
    from tensorboardX import SummaryWriter  # optional: check_options made sure it is installed

    text = f"```\n{json.dumps(dataclasses.asdict(config), indent=2)}\n```"
    writers = []
    for point in grid:
        for seed in range(config.seed, config.seed + config.num_seeds):
            name = "_".join([f"seed{seed}", *describe(point).split()])
            purge = rows[-1]["env_steps"] + 1 if rows else None  # hide a killed run's later steps
            writers.append(SummaryWriter(str(out / "tensorboard" / name), purge_step=purge))
            writers[-1].add_text("config", text)
    return writers


def wait_for(tree: Any, plots: "Plots | None") -> None:
    """Block until `tree` is computed, waking often (a Ctrl-C is heard at once)."""
    while not all(leaf.is_ready() for leaf in jax.tree.leaves(tree)):
        if plots is None or not plots.animate():
            time.sleep(0.01)


def log_chunk(
    config: Config, grid: list[Point], metrics: Metrics, rows: list[dict], now: float
) -> tuple[list[dict], str | None]:
    """The chunk's metrics rows, one per run, and what is not finite in them (or None)."""
    last = rows[-1] if rows else {"env_steps": 0, "updates": 0, "wall_seconds": 0.0}
    seconds = now - last["wall_seconds"]  # the chunk's own (unrounded: a chunk may take < 1 ms)
    new_rows = [
        {
            "seed": config.seed + run % config.num_seeds,
            **grid[run // config.num_seeds],  # the swept values after the seed
            "env_steps": int(metrics.env_steps[run]),
            "updates": int(metrics.updates[run]),
            "wall_seconds": now,
            "sps": round((int(metrics.env_steps[run]) - last["env_steps"]) / seconds, 1),
            **{name: float(getattr(metrics, name)[run]) for name in METRIC_COLUMNS},
        }
        for run in range(len(metrics.env_steps))
    ]
    updated = new_rows[0]["updates"] > last["updates"]  # else the losses are NaN: none to average
    finite = {name: np.isfinite(getattr(metrics, name)) | ~updated for name in LOSS_COLUMNS}
    for name, ok in ({"parameter": metrics.params_finite} | finite).items():
        if not ok.all():
            run = int(np.argmin(ok))
            where = f"chunk {len(rows) // len(new_rows) + 1}, seed {new_rows[run]['seed']}"
            point = describe(grid[run // config.num_seeds])
            return new_rows, f"{SCRIPT}: non-finite {name} in {where} {point}".strip() + "; stopped"
    return new_rows, None


def progress(config: Config, grid: list[Point], metrics: Metrics, rows: list[dict], total: int):
    """The progress line: steps, rates, the return over runs (with a sweep's best and worst
    grid point), the main losses, the time so far and to go."""
    returns = metrics.episode_return
    shown = "-" if np.isnan(returns).all() else f"{np.nanmean(returns):.1f}"
    if returns.size > 1 and not np.isnan(returns).all():
        shown += f" ± {np.nanstd(returns):.1f} (min {np.nanmin(returns):.1f})"
    if config.sweep and np.isfinite(returns).all():
        means = returns.reshape(len(grid), config.num_seeds).mean(axis=1)
        shown += f" | best {describe(grid[means.argmax()])} {means.max():.1f}"
        shown += f", worst {describe(grid[means.argmin()])} {means.min():.1f}"
    losses = " ".join(f"{name} {np.mean(getattr(metrics, name)):.3g}" for name in PROGRESS_COLUMNS)
    now = rows[-1]
    start = {"updates": 0, "wall_seconds": 0.0}
    before = rows[-returns.size - 1] if len(rows) > returns.size else start
    updates = (now["updates"] - before["updates"]) / (now["wall_seconds"] - before["wall_seconds"])
    done = now["env_steps"] / total
    eta = now["wall_seconds"] * (1 / done - 1)
    rates = f"SPS {now['sps']:,.0f} | updates/s {updates:,.0f}"
    times = f"{now['wall_seconds']:.1f} s, ETA {eta:.1f} s"
    steps = f"steps {now['env_steps']:,}/{total:,} ({done:.0%})"
    return f"{steps} | {rates} | return {shown} | {losses} | {times}"


def train_and_log(
    config: Config,
    options: Options,
    grid: list[Point],
    out: Path,
    keys: SeedKeys,
    values: dict[str, Array],
    resumed: dict | None,
) -> tuple[TrainState, list[dict], list, dict]:
    """Every run (grid point x seed) in one program: the jitted, vmapped run_chunk once per chunk
    with the train state donated (updated in place, never copied). The next chunk is dispatched
    before this one is logged and drawn, so that the device does not wait for the host."""

    def init(key: PRNGKey, values: dict[str, Array]) -> TrainState:
        return make_train(with_values(config, values))[0](key)

    def run_chunk(state: TrainState, chunk: Array, values: dict[str, Array]):
        return make_train(with_values(config, values))[1](state, chunk)

    start = time.perf_counter()
    if resumed:  # the saved state, each run's part on its device (no fresh state made first)
        layout = jax.eval_shape(jax.vmap(init), keys.train, values)
        words = jax.device_put(resumed["state"], keys.train.sharding)
        state = jax.jit(typed_keys(layout), out_shardings=keys.train.sharding)(words)
    else:
        state = jax.jit(jax.vmap(init), out_shardings=keys.train.sharding)(keys.train, values)
    chunk_fn = jax.jit(
        jax.vmap(run_chunk, (0, None, 0)), out_shardings=keys.train.sharding, donate_argnums=0
    )
    chunk_fn = chunk_fn.lower(state, jnp.int32(0), values).compile()
    compile_seconds = time.perf_counter() - start
    megabytes = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) / 2**20 / len(keys.train)
    print(
        f"compiled in {compile_seconds:.1f} s; train state {megabytes:.1f} MB per run", flush=True
    )
    if is_lead():
        out.mkdir(parents=True, exist_ok=True)
        write_atomic(out / "config.json", json.dumps(dataclasses.asdict(config), indent=2))
    rows = json.loads(resumed["rows"]) if resumed else []
    first_chunk = resumed["chunk"] if resumed else 0
    num_chunks = chunk_sizes(config)[1]
    if resumed:
        print(f"{SCRIPT}: resumed at chunk {first_chunk} of {num_chunks} in {out}", flush=True)
    writers = open_tensorboard(config, grid, out, rows) if options.track and is_lead() else []
    plots = None
    stop = stop_on_signals()
    start = time.perf_counter() - (rows[-1]["wall_seconds"] if rows else 0.0)
    plotted = time.perf_counter()
    state, pending = chunk_fn(state, jnp.int32(first_chunk), values)
    for chunk in range(first_chunk, num_chunks):
        wait_for(pending, plots)
        metrics, stops = fetch((pending, np.array([stop[0]])))
        stopped = bool(stops.any())  # a Ctrl-C on any process stops every process
        if stopped and not stop[0]:
            print(f"{SCRIPT}: Ctrl-C on another process: stopping after this chunk", flush=True)
        every = max(options.checkpoint_every // (int(metrics.env_steps[0]) // (chunk + 1)), 1)
        periodic = options.checkpoint_every > 0 and (chunk + 1) % every == 0  # in whole chunks
        ends = chunk + 1 == num_chunks and options.save_model
        saved = fetch(key_words(state)) if stopped or periodic or ends else None
        live_params = first_run(trained_params(state)) if options.live and is_lead() else None
        if chunk + 1 < num_chunks and not stopped:  # runs while this chunk is logged and drawn
            state, pending = chunk_fn(state, jnp.int32(chunk + 1), values)
        new_rows, non_finite = log_chunk(config, grid, metrics, rows, time.perf_counter() - start)
        rows += new_rows
        total = new_rows[0]["env_steps"] // (chunk + 1) * num_chunks  # chunks are alike
        print(progress(config, grid, metrics, rows, total), flush=True)
        for writer, row in zip(writers, new_rows, strict=False):
            for name in ("sps", *METRIC_COLUMNS):
                if np.isfinite(row[name]):
                    group = "losses" if name in LOSS_COLUMNS else "charts"
                    writer.add_scalar(f"{group}/{name}", row[name], row["env_steps"])
        if is_lead():
            write_atomic(out / "metrics.csv", csv_text(rows))
        if non_finite:  # every process has every run's metrics: they all stop here
            if is_lead():
                print(f"{non_finite} (the files in {out} hold the chunks so far)", file=sys.stderr)
            sys.exit(1)
        if saved is not None and is_lead():  # after the chunk's rows: a resume continues them
            resume = {"chunk": chunk + 1, "rows": json.dumps(rows)}
            resume["state"] = flax.serialization.to_state_dict(saved)
            data = checkpoint(config, grid, trained_params(saved), resume)
            write_atomic(out / "checkpoint.msgpack", data)
        plot_due = options.plot and 0 < options.plot_every <= time.perf_counter() - plotted
        if is_lead() and plots is None and (options.live or plot_due):
            plots = Plots(config, options, grid)  # here: matplotlib's import takes a while
        if plots and (plots.window or plot_due):
            frames = plots.render(live_params, first_run(keys.render)) if live_params else None
            plots.update(rows, frames)
        if plots and plot_due:
            plots.save(out / "curves.png")
            plotted = time.perf_counter()
        if stopped:
            break
    train_seconds = time.perf_counter() - start
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if is_lead() and options.plot:
        plots = plots or Plots(config, options, grid)
        plots.update(rows, None)
        plots.save(out / "curves.png")
    summary = {
        "train_seconds": train_seconds,
        "compile_seconds": compile_seconds,
        "env_steps": rows[-1]["env_steps"],
        "updates": rows[-1]["updates"],
        "env_steps_per_second": rows[-1]["env_steps"] / train_seconds,
        "updates_per_second": rows[-1]["updates"] / train_seconds,
        "stopped_early": stopped,
        "exit_status": max(int(stops.max()), stop[0]),  # 130 after Ctrl-C, 143 after SIGTERM
    }
    return state, rows, writers, summary


def main(config: Config, options: Options) -> None:
    try:
        compile_cache = enable_compile_cache(options)  # before anything starts JAX's backend
        check_options(options)
        validate(config)
        if options.eval_only:
            config, payload = load_checkpoint(Path(options.load_model), config, "--load-model")
            params = payload["params"]
        resumed = None
        if options.resume is not None:
            path = Path(options.resume)
            path = path / "checkpoint.msgpack" if path.is_dir() else path
            config, resumed = load_checkpoint(path, config, "--resume")
        if options.distributed:
            start_distributed(options)
        grid = sweep_grid(config)
        num_runs = len(grid) * config.num_seeds
        devices = jax.devices()  # of every process: the runs are sharded over all of them
        divides = f"such that the {num_runs} runs divide over the {len(devices)} devices"
        require(num_runs % len(devices) == 0, "num_seeds", divides, config.num_seeds)
        if resumed:
            resumed["state"] = saved_state(config, grid, resumed, path)
        if resumed and resumed["chunk"] == chunk_sizes(config)[1]:
            print(f"{SCRIPT}: {path} holds a finished run; nothing to resume")
            sys.exit(0)
        out = Path(options.output_dir or f"runs/{SCRIPT}__{config.seed}__{int(time.time())}")
        out = path.parent if resumed else out
        taken = out.is_dir() and any(out.iterdir()) and not (options.overwrite or resumed)
        if is_lead() and taken:
            raise UsageError(f"--output-dir {out} already holds files; --overwrite writes there")
        try:  # can it be made? It is made once the programs are compiled (a Ctrl-C leaves none)
            if is_lead() and not out.is_dir():
                out.mkdir(parents=True)
                out.rmdir()
        except OSError as error:
            message = f"--output-dir {out}: cannot make this folder ({error.strerror})"
            raise UsageError(message) from None
    except UsageError as error:
        print(f"{SCRIPT}.py: error: {error}", file=sys.stderr)
        sys.exit(2)
    if not is_lead():
        print(f"{SCRIPT}: process {jax.process_index()}, a worker; process 0 writes", flush=True)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # process 0 speaks
    started = time.time()
    sharding = NamedSharding(Mesh(np.array(devices), ("runs",)), PartitionSpec("runs"))
    runs = f"{len(grid)} grid points x " * bool(config.sweep) + f"{config.num_seeds} seed(s)"
    where = (
        f"{len(devices)} device(s) ({devices[0].device_kind}), {jax.process_count()} process(es)"
    )
    print(
        f"{SCRIPT}: {env_name(config)}, {runs} x {config.num_envs} envs on {where}; "
        f"compile cache: {compile_cache}",
        flush=True,
    )
    # Each process computes and holds only the keys and swept values of its own runs.
    keys = jax.jit(seed_keys, static_argnums=(0, 1), out_shardings=sharding)(config, len(grid))
    by_run = {
        name: np.repeat([point[name] for point in grid], config.num_seeds) for name in grid[0]
    }
    values = jax.device_put(jax.tree.map(np.float32, by_run), sharding)

    def evaluate_run(params: Params, key: PRNGKey, values: dict[str, Array]) -> dict[str, Array]:
        return make_evaluate(with_values(config, values), options.eval_episodes)(params, key)

    summary: dict[str, Any] = {"stopped_early": False, "exit_status": 0}
    writers = []
    if options.eval_only:
        params = jax.device_put(params, sharding)
    else:
        state, rows, writers, summary = train_and_log(
            config, options, grid, out, keys, values, resumed
        )
        params = trained_params(state)
    evaluation = fetch(jax.jit(jax.vmap(evaluate_run))(params, keys.evaluate, values))
    per_run = {name: np.mean(values, axis=1) for name, values in evaluation.items()}
    saved_params = fetch(params) if options.save_model and not options.eval_only else None
    if not is_lead():
        sys.exit(summary["exit_status"])  # process 0 writes the outputs
    out.mkdir(parents=True, exist_ok=True)
    if saved_params is not None:
        write_atomic(out / "model.msgpack", checkpoint(config, grid, saved_params, None))
    for run, writer in enumerate(writers):
        for name, values in per_run.items():
            writer.add_scalar(f"eval/{name}", values[run], rows[-1]["env_steps"])
        writer.close()
    returns = per_run.pop("episode_return")
    summary = {
        "final_returns": returns.tolist(),
        "final_return_mean": float(returns.mean()),
        "final_return_std": float(returns.std()),
        **{f"final_{name}": values.tolist() for name, values in per_run.items()},
        **summary,
        "num_seeds": config.num_seeds,
        "num_envs": config.num_envs,
        "device": f"{len(devices)} x {devices[0].device_kind}",
    }
    if config.sweep:
        summary["sweep"] = write_sweep(out, config, grid, returns)
    write_atomic(out / "summary.json", json.dumps(summary, indent=2))
    if options.capture_gif:
        render, seconds_per_frame = make_render(with_values(config, grid[0]))
        frames = np.asarray(jax.jit(render)(first_run(params), first_run(keys.render)))
        caption = f"{SCRIPT}, seed {config.seed} {describe(grid[0])}: return {returns[0]:.1f}"
        write_atomic(out / "policy.gif", gif(frames, seconds_per_frame, caption))
    spread = f" ± {returns.std():.1f} (mean ± std over {num_runs} runs)" if num_runs > 1 else ""
    others = "".join(f", {name} {values.mean():.3g}" for name, values in per_run.items())
    solved = f"{(returns >= SOLVED_RETURN).sum()}/{num_runs} >= {SOLVED_RETURN:g}"
    episodes = f"{options.eval_episodes} deterministic episodes per run"
    print(f"evaluation, {episodes}: return {returns.mean():.1f}{spread}; {solved}{others}")
    wrote = sorted(path.name for path in out.iterdir() if path.stat().st_mtime >= started)
    print(f"wrote {', '.join(wrote)} in {out}", flush=True)
    if summary["exit_status"]:
        sys.exit(summary["exit_status"])  # interrupted: 130 after Ctrl-C, 143 after SIGTERM


@dataclasses.dataclass(frozen=True)
class Arguments:
    """The command line: the config's flags, then the options (tyro reads both, flat)."""

    config: Annotated[Config, tyro.conf.arg(name="")] = Config()
    run: Annotated[Options, tyro.conf.OmitArgPrefixes] = Options()


def parse_args(args: Sequence[str] | None = None) -> tuple[Config, Options]:
    """tyro over the defaults of the task that --env-id names (so --help lists those)."""
    import argparse

    args = sys.argv[1:] if args is None else list(args)
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --env-id alone
    peek.add_argument("--env-id", "--env_id", default="CartPoleContinuous", nargs="?")
    default = Arguments(config=default_config(peek.parse_known_args(args)[0].env_id))
    parsed = tyro.cli(Arguments, args=args, default=default, description=__doc__.splitlines()[0])
    return parsed.config, parsed.run


if __name__ == "__main__":
    signal.signal(signal.SIGINT, abort)  # a Ctrl-C before training (during compile, say)
    try:
        main(*parse_args())
    except KeyboardInterrupt:  # a Ctrl-C after training
        abort(signal.SIGINT, None)
    except BrokenPipeError:  # `--help | head` closed the pipe: end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
