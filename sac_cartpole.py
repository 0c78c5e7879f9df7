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
from jax.flatten_util import ravel_pytree

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
    theta_threshold_radians: float = 12 * 2 * math.pi / 360  # balance ends past it (not swing-up)
    x_threshold: float = 2.4  # the episode ends when |x| exceeds this (the track's half length, m)
    max_steps_in_episode: int = 500  # time limit in steps (a truncation: the TD target bootstraps)


@dataclasses.dataclass(frozen=True)
class Config:
    env_id: Literal["CartPoleContinuous", "CartPoleSwingup"] = "CartPoleContinuous"
    """balance (CartPoleContinuous) or swing-up (CartPoleSwingup); each has its own defaults"""
    seed: int = 1  # seed of the first run; seed i of --num-seeds uses seed + i
    num_seeds: int = 1  # independent runs trained at once in one vmapped program
    sweep: tuple[str, ...] | None = None
    """NAME=V1,V2,... entries of any field, e.g. q-lr=1e-3,3e-3 hidden-sizes=64x64,128x128: every
    combination x --num-seeds runs, in one process (docs/sweeps.md)"""
    num_envs: int = 1024  # parallel envs per seed
    total_timesteps: int = 4_096_000  # env steps per seed (all envs), rounded down to whole chunks
    policy_lr: float = 3e-3  # Adam step size of the actor
    q_lr: float = 3e-3  # Adam step size of the critics and of the temperature (CleanRL's q_lr)
    lr_decay_start: float = 0.5
    """share of the run's updates after which every step size decays linearly (1: never)"""
    lr_decay_to: float = 0.1  # the step sizes at the run's end, as a share of their rates
    gamma: float = 0.99  # discount factor
    tau: float = 0.2
    """Polyak step of the target critics: target <- tau * critic + (1 - tau) * target"""
    batch_size: int = 256  # transitions per gradient update
    buffer_size: int = 100_000  # replay buffer capacity in transitions (per seed)
    learning_starts: int = 1_000  # env steps of uniformly random actions before the first update
    updates_per_step: int = 1  # gradient updates per vectorised env step (of num_envs transitions)
    hidden_sizes: tuple[int, ...] = (128, 128)  # hidden layer widths of the actor and each critic
    max_grad_norm: float | None = None
    """clip the whole gradient, log alpha's too, to this global norm (optax.clip_by_global_norm)"""
    autotune: bool = True
    """tune the temperature alpha towards --target-entropy (from alpha = 1); off: fixed --alpha"""
    alpha: float = 0.2  # the fixed temperature with --no-autotune (CleanRL's default)
    target_entropy: float | None = 0.0
    """entropy that the temperature is tuned towards; None: -|A| (the SAC paper's choice)"""
    log_every: int = 204_800  # env steps (all envs) per chunk: a progress line and a metrics row
    env: EnvConfig = EnvConfig()  # CartPole physics


def default_config(env_id: str = "CartPoleContinuous") -> Config:
    """A task's defaults, which the command line's flags override. Swing-up explores more (its
    policies then learn to brake a pole that overshoots the top), remembers longer (1,000
    iterations of all envs) and trains twice as long (docs/sac.md)."""
    if env_id != "CartPoleSwingup":
        return Config()
    return Config(
        env_id="CartPoleSwingup",
        tau=0.1,
        batch_size=192,
        target_entropy=0.5,
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
        # The mean and log-std heads as one layer: one matrix multiply, not two.
        heads = nn.Dense(2 * self.action_dim, kernel_init=TORCH_LINEAR_INIT, name="heads")(x)
        mean, log_std = jnp.split(heads, 2, axis=-1)
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


def unraveler(shapes: Params) -> Callable[[Array], Params]:
    """vector -> a parameter tree of these shapes: jax.flatten_util.ravel_pytree's inverse, made
    from the shapes alone (ravel_pytree needs arrays, which would cost a compile per shape)."""
    leaves, treedef = jax.tree.flatten(shapes)
    ends = [sum(leaf.size for leaf in leaves[: index + 1]) for index in range(len(leaves))]

    def unravel(vector: Array) -> Params:
        parts = jnp.split(vector, ends[:-1])
        shaped = [part.reshape(leaf.shape) for part, leaf in zip(parts, leaves, strict=True)]
        return treedef.unflatten(shaped)

    return unravel


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
    """Preallocated; a transition per row of one array (obs, action, reward, next_obs,
    terminated side by side), so that storing and sampling are one operation, not one per field."""

    rows: Array  # [capacity, 2 obs_dim + action_dim + 2]
    added: Array  # int32, transitions written so far: the next goes to slot added % capacity
    obs_dim: int = struct.field(pytree_node=False)


def buffer_init(capacity: int, obs_dim: int, action_dim: int) -> Buffer:
    rows = jnp.zeros((capacity, 2 * obs_dim + action_dim + 2))
    return Buffer(rows=rows, added=jnp.int32(0), obs_dim=obs_dim)


def buffer_add(buffer: Buffer, transitions: Transition) -> Buffer:
    """Write one step's transitions (leading axis num_envs <= capacity) at once, wrapping around."""
    capacity = buffer.rows.shape[0]
    count = transitions.reward.shape[0]
    slots = (buffer.added + jnp.arange(count)) % capacity
    fields = [transitions.obs, transitions.action, transitions.reward[:, None]]
    rows = jnp.concatenate([*fields, transitions.next_obs, transitions.terminated[:, None]], axis=1)
    stored = buffer.rows.at[slots].set(rows, unique_indices=True)
    return buffer.replace(rows=stored, added=buffer.added + count)


def buffer_sample(buffer: Buffer, key: PRNGKey, batch_size: int) -> Transition:
    """A uniform batch from the filled slots only."""
    filled = jnp.minimum(buffer.added, len(buffer.rows))
    rows = buffer.rows[jax.random.randint(key, (batch_size,), 0, filled)]
    obs_end, action_end = buffer.obs_dim, rows.shape[1] - buffer.obs_dim - 2
    return Transition(
        obs=rows[:, :obs_end],
        action=rows[:, obs_end:action_end],
        reward=rows[:, action_end],
        next_obs=rows[:, action_end + 1 : -1],
        terminated=rows[:, -1],
    )


# ---- train state and losses ----


@struct.dataclass
class Learner:
    """What a gradient update changes: every parameter in one vector (`Agent.unravel`), so that
    one Adam step and one Polyak step move them all (docs/sac.md, "The loop")."""

    params: Array  # the actor's, the twin critics' and log(alpha), the temperature
    target_critics: Array  # the twin critics' Polyak-averaged copy, as a vector
    opt_state: optax.OptState


@struct.dataclass
class TrainState:
    """Everything that flows through the training scan (one seed)."""

    learner: Learner
    buffer: Buffer
    env_state: envs.EpisodeStatsState  # [num_envs]
    obs: Array  # [num_envs, obs_dim]
    key: PRNGKey  # the run's key: iteration i draws from fold_in(key, i)
    env_steps: Array  # int32, all envs together


@struct.dataclass
class Losses:
    critic_loss: Array
    actor_loss: Array
    alpha: Array
    q_mean: Array
    entropy: Array  # -E[log pi(a|s)] of the env's (scaled) actions


@struct.dataclass
class Totals:
    """A chunk's running sums, each one array: an iteration adds to each in one operation."""

    episodes: Array  # [3, num_envs]: per env, the episodes ended, their returns and lengths
    losses: Array  # [fields of Losses]: the updates' Losses, summed (ravel_pytree's order)


@struct.dataclass
class Metrics:
    """A chunk's numbers for one seed: means over its ended episodes and its updates (or NaN)."""

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


def trained_params(config: Config, state: TrainState) -> Params:
    """What model.msgpack keeps and the evaluation reads: a run's parameters by network
    ({"actor": ..., "critics": ..., "log_alpha": ...}); a checkpoint keeps the train state."""
    return make_agent(config).unravel(state.learner.params)


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


def alpha_loss(log_alpha: Array, entropy: Array, target_entropy: float) -> Array:
    """alpha * (entropy - target_entropy): alpha grows while the entropy is below target."""
    return jnp.exp(log_alpha) * (entropy - target_entropy)


# ---- training ----


@dataclasses.dataclass(frozen=True)
class Agent:
    """What make_agent builds once and the update reads: the networks, how to unravel the
    parameter vector, the optimiser and the action bounds; the train state holds the rest."""

    config: Config
    actor: Actor
    critic: Critic
    unravel: Callable[[Array], dict]  # params -> {"actor": ..., "critics": ..., "log_alpha": ...}
    unravel_critics: Callable[[Array], Params]  # the twin critics' part -> their parameters
    part_sizes: tuple[int, int, int]  # the actor's, the twin critics' and log(alpha)'s
    optimizer: optax.GradientTransformation  # Adam's scaling (step_sizes gives the rates)
    action_scale: Array
    action_offset: Array
    target_entropy: float

    @property
    def critic_part(self) -> slice:
        """Where the twin critics' parameters sit in the vector."""
        return slice(self.part_sizes[0], self.part_sizes[0] + self.part_sizes[1])

    def step_sizes(self, progress: Array) -> Array:
        """Each parameter's Adam step size with `progress` of the run's updates done: the actor's
        --policy-lr, the critics' and alpha's --q-lr (CleanRL's split), held until
        --lr-decay-start, then decayed linearly to --lr-decay-to of themselves, so that the final
        policy settles (docs/sac.md). One Adam for all is the three networks' Adams in one
        operation, as Adam acts element by element."""
        rates = [self.config.policy_lr, self.config.q_lr, self.config.q_lr]
        pieces = [jnp.full(size, rate) for size, rate in zip(self.part_sizes, rates, strict=True)]
        start, end = self.config.lr_decay_start, self.config.lr_decay_to
        # 0 until --lr-decay-start, then linearly to 1 at the run's end (start 1: -inf, so 0)
        decayed = jnp.clip((progress - start) / (1 - start), 0.0, 1.0)
        return (1 - (1 - end) * decayed) * jnp.concatenate(pieces)

    def policy(self, actor_params: Params, obs: Array, noise: Array) -> tuple[Array, Array]:
        mean, log_std = self.actor.apply(actor_params, obs)
        return squashed_gaussian_sample(mean, log_std, noise, self.action_scale, self.action_offset)

    def q_values(self, critic_params: Params, obs: Array, action: Array) -> Array:
        """[2, batch]: the twin critics' Q. Each critic gets its own copy of the inputs: one
        batched matrix multiply a layer for the pair, no transposed copy of their weights."""
        inputs = [jnp.broadcast_to(x, (2, *x.shape)) for x in (obs, action)]
        return jax.vmap(self.critic.apply)(critic_params, *inputs)


def make_agent(config: Config) -> Agent:
    env, env_params = make_env(config)
    space = env.action_space(env_params)  # gymnax's own boxes have Python floats as bounds
    obs = jax.ShapeDtypeStruct((1, *env.observation_space(env_params).shape), jnp.float32)
    action = jax.ShapeDtypeStruct((1, space.shape[0]), jnp.float32)
    actor = Actor(config.hidden_sizes, space.shape[0])
    critic = Critic(config.hidden_sizes)
    twin_critics = jax.vmap(critic.init, in_axes=(0, None, None))
    key = jax.ShapeDtypeStruct((2,), jnp.uint32)  # a raw key's shape: for the shapes alone
    twin_keys = jax.ShapeDtypeStruct((2, 2), jnp.uint32)
    shapes = {
        "actor": jax.eval_shape(actor.init, key, obs),
        "critics": jax.eval_shape(twin_critics, twin_keys, obs, action),
        "log_alpha": jax.ShapeDtypeStruct((), jnp.float32),
    }
    sizes = [sum(leaf.size for leaf in jax.tree.leaves(shapes[part])) for part in shapes]
    # Clipping, if asked for, is by the global norm of the update's whole gradient.
    clip = [] if config.max_grad_norm is None else [optax.clip_by_global_norm(config.max_grad_norm)]
    return Agent(
        config=config,
        actor=actor,
        critic=critic,
        unravel=unraveler(shapes),
        unravel_critics=unraveler(shapes["critics"]),
        part_sizes=tuple(sizes),
        optimizer=optax.chain(*clip, optax.scale_by_adam()),
        action_scale=jnp.broadcast_to((space.high - space.low) / 2, space.shape),  # tanh's (-1, 1)
        action_offset=jnp.broadcast_to((space.high + space.low) / 2, space.shape),  # to the box
        target_entropy=-space.shape[0] if config.target_entropy is None else config.target_entropy,
    )


@struct.dataclass
class UpdateKeys:
    """An update's random keys, one per draw: another draw is another field here, used by name."""

    batch: PRNGKey  # which transitions the batch holds
    noise: PRNGKey  # the Gaussian noise of the actor's samples at s and s'


def sac_loss(
    params: Array, target_critics: Array, batch: Transition, keys: UpdateKeys, agent: Agent
) -> tuple[Array, Losses]:
    """The critics', the actor's and the temperature's losses at the networks as the update found
    them, each differentiated in its own parameters only: their sum's gradient is the three
    gradients at once (the SAC authors' update; CleanRL steps the critics before the actor)."""
    parts = agent.unravel(params)
    fixed = jax.lax.stop_gradient
    alpha = jnp.exp(parts["log_alpha"])
    noise = jax.random.normal(keys.noise, (2, *batch.action.shape))  # for the actor at s and s'

    # CRITICS: towards the soft TD target of a' ~ pi(s') and the target critics
    next_action, next_log_prob = agent.policy(fixed(parts["actor"]), batch.next_obs, noise[1])
    target_critics = agent.unravel_critics(target_critics)
    next_q = agent.q_values(target_critics, batch.next_obs, next_action)
    target = td_target(batch, next_q, next_log_prob, fixed(alpha), agent.config.gamma)
    critic, q = critic_loss(parts["critics"], batch, target, agent.q_values)

    # ACTOR: against the critics, held fixed
    actor, log_prob = actor_loss(
        parts["actor"],
        fixed(parts["critics"]),
        batch.obs,
        noise[0],
        fixed(alpha),
        agent.policy,
        agent.q_values,
    )

    # TEMPERATURE: towards the target entropy (with --autotune; else alpha stays)
    entropy = -jnp.mean(fixed(log_prob))
    temperature = alpha_loss(parts["log_alpha"], entropy, agent.target_entropy)
    temperature = temperature if agent.config.autotune else 0.0
    losses = Losses(
        critic_loss=critic, actor_loss=actor, alpha=alpha, q_mean=jnp.mean(q), entropy=entropy
    )
    return critic + actor + temperature, losses


def update(
    agent: Agent, buffer: Buffer, learner: Learner, keys: UpdateKeys, progress: Array
) -> tuple[Learner, Losses]:
    """One SAC update on a batch from the buffer: one gradient, one Adam step for every
    parameter, then the Polyak step of the target critics. progress: the share of the run's
    updates done."""
    batch = buffer_sample(buffer, keys.batch, agent.config.batch_size)
    loss_grad = jax.value_and_grad(sac_loss, has_aux=True)
    (_, losses), grads = loss_grad(learner.params, learner.target_critics, batch, keys, agent)
    updates, opt_state = agent.optimizer.update(grads, learner.opt_state)
    params = learner.params - agent.step_sizes(progress) * updates
    critics = params[agent.critic_part]
    target_critics = optax.incremental_update(critics, learner.target_critics, agent.config.tau)
    return Learner(params=params, target_critics=target_critics, opt_state=opt_state), losses


def make_train(config: Config):
    """Static work once; returns the pure functions init(key) -> state, run_chunk(state, chunk)
    -> (state, metrics) and train(key) -> (state, metrics with a leading chunk axis)."""
    iterations_per_chunk, num_chunks = chunk_sizes(config)
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    obs_dim = env.observation_space(env_params).shape[0]
    action_dim = env.action_space(env_params).shape[0]
    num_envs = config.num_envs
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    agent = make_agent(config)
    warm_up = math.ceil(config.learning_starts / num_envs)  # iterations before the first update
    learning_iterations = num_chunks * iterations_per_chunk - warm_up  # the step sizes' schedule

    def init(key: PRNGKey) -> TrainState:
        """Fresh networks, optimiser and envs, and an empty buffer."""
        key_actor, key_critics, key_envs, key_loop = jax.random.split(key, 4)
        reset_envs = jax.vmap(env.reset, in_axes=(0, None))
        obs, env_state = reset_envs(jax.random.split(key_envs, num_envs), env_params)
        twin_critics_init = jax.vmap(agent.critic.init, in_axes=(0, None, None))
        twin_keys = jax.random.split(key_critics, 2)
        parts = {
            "actor": agent.actor.init(key_actor, obs),
            "critics": twin_critics_init(twin_keys, obs, jnp.zeros((num_envs, action_dim))),
            # alpha = 1 at the start when tuned, as in CleanRL
            "log_alpha": jnp.log(jnp.float32(1.0 if config.autotune else config.alpha)),
        }
        params = ravel_pytree(parts)[0]
        learner = Learner(
            params=params,
            target_critics=params[agent.critic_part],
            opt_state=agent.optimizer.init(params),
        )
        return TrainState(
            learner=learner,
            buffer=buffer_init(config.buffer_size, obs_dim, action_dim),
            env_state=env_state,
            obs=obs,
            key=key_loop,
            env_steps=jnp.int32(0),
        )

    def learn(
        learner: Learner, buffer: Buffer, keys: UpdateKeys, index: Array
    ) -> tuple[Learner, Losses]:
        """updates_per_step updates in a row; their losses averaged."""
        progress = (index - warm_up) / learning_iterations  # the run's updates done, as a share
        if config.updates_per_step == 1:  # (a scan of one step still costs copies of its carry)
            return update(agent, buffer, learner, keys, progress)
        keys = jax.tree.map(lambda key: jax.random.split(key, config.updates_per_step), keys)
        one_update = functools.partial(update, agent, buffer, progress=progress)
        learner, losses = jax.lax.scan(one_update, learner, keys)
        return learner, jax.tree.map(jnp.mean, losses)

    def iteration(carry: tuple[TrainState, Totals], index: Array):
        """Step every env, store the transitions, then update once past the warm-up."""
        state, totals = carry
        draws = 2 + len(dataclasses.fields(UpdateKeys))  # the action's, the envs' and the update's
        keys = jax.random.split(jax.random.fold_in(state.key, index), draws)
        key_action, key_envs, *update_keys = keys
        learning = index >= warm_up

        # COLLECT: the policy's actions, or uniformly random ones during the warm-up
        noise = jax.random.normal(key_action, (num_envs, action_dim))
        actor_params = agent.unravel(state.learner.params)["actor"]
        policy_action, _ = agent.policy(actor_params, state.obs, noise)
        # erf(z / sqrt 2) of a standard normal z is uniform on (-1, 1): one draw serves both.
        uniform = jax.scipy.special.erf(noise / jnp.sqrt(2.0))
        random_action = agent.action_offset + agent.action_scale * uniform
        action = jnp.where(learning, policy_action, random_action)
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

        # UPDATE NETWORKS, in the warm-up too but then dropped: a select where a branch would
        # cost more operations on every iteration than the warm-up's work (docs/sac.md)
        learned, losses = learn(state.learner, buffer, UpdateKeys(*update_keys), index)
        learner = jax.tree.map(functools.partial(jnp.where, learning), learned, state.learner)

        state = state.replace(
            learner=learner,
            buffer=buffer,
            env_state=env_state,
            obs=obs,
            env_steps=state.env_steps + num_envs,
        )
        episodes = [info["returned_episode"], info["episode_return"], info["episode_length"]]
        totals = Totals(
            episodes=totals.episodes + jnp.stack(episodes),
            losses=totals.losses + learning * ravel_pytree(losses)[0],
        )
        return (state, totals), None

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """Chunk number `chunk` (from 0): iterations_per_chunk iterations in one scan."""
        indices = chunk * iterations_per_chunk + jnp.arange(iterations_per_chunk)
        totals = Totals(jnp.zeros((3, num_envs)), jnp.zeros(len(dataclasses.fields(Losses))))
        (state, totals), _ = jax.lax.scan(iteration, (state, totals), indices)
        episodes, episode_return, episode_length = jnp.sum(totals.episodes, axis=1)
        loss_sums = Losses(*totals.losses)  # in Losses' field order, as ravel_pytree wrote them
        mean_losses = jax.tree.map(lambda total: total / jnp.sum(indices >= warm_up), loss_sums)
        metrics = Metrics(
            env_steps=state.env_steps,
            updates=config.updates_per_step * jnp.maximum(indices[-1] + 1 - warm_up, 0),
            episode_return=episode_return / episodes,  # NaN where no episode ended
            episode_length=episode_length / episodes,
            **dataclasses.asdict(mean_losses),  # NaN where there was no update
            params_finite=jnp.isfinite(state.learner.params).all(),
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
    agent = make_agent(config)

    def act(params: Params, obs: Array) -> Array:
        mean, _ = agent.actor.apply(params["actor"], obs)
        return agent.action_offset + agent.action_scale * jnp.tanh(mean)

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
PROGRESS_COLUMNS = ("critic_loss", "actor_loss", "alpha")  # on each progress line after the return
EVAL_EPISODES = 100  # deterministic-policy episodes per run in the final evaluation, by default
# The chunk on a CPU: LLVM -O2 (docs/usage.md) and XLA's own matrix multiplies, not YNNPACK's
# (1.07x-1.16x the updates/s on two cores, the same on one: docs/log/sac_kernels.md)
CPU_CHUNK = {"xla_backend_optimization_level": 2, "xla_cpu_experimental_ynn_fusion_type": ""}


def solved_return(config: Config) -> float:
    """Balance: CartPole-v1's bar in gymnasium. Swing-up: our bar, between the returns of a
    policy that swings the pole but never holds it (about 250) and one that holds it (400-440)."""
    return 350.0 if config.env_id == "CartPoleSwingup" else 475.0


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
    for name in ("num_seeds", "num_envs", "total_timesteps", "batch_size", "updates_per_step"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("policy_lr", "q_lr", "alpha", "log_every"):
        require(getattr(config, name) > 0, name, "> 0", getattr(config, name))
    for name, value in vars(config.env).items():  # physics whose default is positive stay so
        require(value > 0 or getattr(EnvConfig(), name) <= 0, f"env.{name}", "> 0", value)
    last_seed = 2**31 - config.num_seeds  # every run's seed fits in int32
    require(0 <= config.seed <= last_seed, "seed", f"in [0, {last_seed}]", config.seed)
    require(0 < config.gamma <= 1, "gamma", "in (0, 1]", config.gamma)
    require(0 < config.tau <= 1, "tau", "in (0, 1]", config.tau)
    require(0 <= config.lr_decay_start <= 1, "lr_decay_start", "in [0, 1]", config.lr_decay_start)
    require(config.lr_decay_to >= 0, "lr_decay_to", ">= 0", config.lr_decay_to)
    fits = config.num_envs <= config.buffer_size
    require(fits, "buffer_size", ">= --num-envs", config.buffer_size)
    fits = config.batch_size <= config.buffer_size
    require(fits, "batch_size", "<= --buffer-size", config.batch_size)
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
    """tyro over the defaults of the task that --env-id names (so --help lists those)."""
    import argparse

    args = sys.argv[1:] if args is None else list(args)
    peek = argparse.ArgumentParser(add_help=False, allow_abbrev=False)  # --env-id alone
    peek.add_argument("--env-id", "--env_id", default="CartPoleContinuous", nargs="?")
    default = Arguments(config=default_config(peek.parse_known_args(args)[0].env_id))
    parsed = tyro.cli(Arguments, args=args, default=default, description=__doc__.splitlines()[0])
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
