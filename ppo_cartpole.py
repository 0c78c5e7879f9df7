"""PPO on CartPole-v1, fully on device. Docs: docs/ppo.md

CleanRL's ppo.py in pure JAX, one compiled lax.scan per chunk of PPO iterations (Schulman et al.
2017; GAE, Schulman et al. 2016; the implementation details of Huang et al. 2022).

    python ppo_cartpole.py                   # train, evaluate, write runs/ppo_cartpole__0__<time>/
    python ppo_cartpole.py --num-seeds 16    # 16 seeds in one vmapped program
    python ppo_cartpole.py --eval-only --load-model runs/<run>/model.msgpack
"""

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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

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

SCRIPT = "ppo_cartpole"
ENV_ID = "CartPole-v1"
SOLVED_RETURN = 475.0  # CartPole-v1's reward_threshold in gymnasium's registry
LOSS_NAMES = ("value_loss", "policy_loss", "entropy", "approx_kl", "clip_frac")
METRIC_NAMES = ("episode_return", "episode_length", *LOSS_NAMES)
CSV_COLUMNS = ("seed", "env_steps", "updates", "wall_seconds", "sps", *METRIC_NAMES)

# ---- config ---------------------------------------------------------------------------------


@dataclass(frozen=True)
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


@dataclass(frozen=True)
class Config:
    seed: int = 0
    """seed of the first run; seed i of --num-seeds uses seed + i"""
    num_seeds: int = 1
    """independent runs trained at once in one vmapped program"""
    total_timesteps: int = 98_304
    """env steps per seed, all envs together (rounded down to whole chunks); default 48 iterations"""
    learning_rate: float = 1e-2
    """Adam step size"""
    anneal_lr: bool = True
    """decay the learning rate linearly to 0 over training"""
    num_envs: int = 32
    """parallel envs per seed"""
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
    """where outputs go; None: runs/ppo_cartpole__<seed>__<unix time>"""
    save_model: bool = True
    """write model.msgpack (every seed's parameters and this config)"""
    capture_gif: bool = True
    """write policy.gif (the first seed's greedy policy in four carts side by side)"""
    plot: bool = True
    """write curves.png (return and losses against env steps)"""
    load_model: str | None = None
    """model.msgpack to evaluate with --eval-only"""
    eval_only: bool = False
    """evaluate (and render) the --load-model checkpoint instead of training"""
    env: EnvConfig = EnvConfig()
    """CartPole-v1's constants"""


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
        (">= 0", lambda value: value >= 0, ["ent_coef", "vf_coef"]),
        ("in (0, 1]", lambda value: 0 < value <= 1, ["gamma"]),
        ("in [0, 1]", lambda value: 0 <= value <= 1, ["gae_lambda"]),
        (
            "in [0, 2**31 - num_seeds)",
            lambda value: 0 <= value < 2**31 - config.num_seeds,
            ["seed"],
        ),
        (
            "> 0",
            lambda value: value > 0,
            [f"env.{name}" for name in dataclasses.asdict(config.env)],
        ),
    ]
    for allowed, holds, names in rules:
        for name in names:
            value = (
                getattr(config.env, name[4:]) if name.startswith("env.") else getattr(config, name)
            )
            if not holds(value):
                raise UsageError(f"--{name.replace('_', '-')} must be {allowed}, got {value}")
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


class MLP(nn.Module):
    """tanh hidden layers and a linear head; init_orthogonal sets the weights."""

    hidden_sizes: Sequence[int]
    out_size: int

    @nn.compact
    def __call__(self, x: chex.Array) -> chex.Array:
        for width in self.hidden_sizes:
            x = nn.tanh(nn.Dense(width)(x))
        return nn.Dense(self.out_size)(x)


def make_networks(config: Config, num_actions: int) -> tuple[MLP, MLP]:
    """Separate actor (logits) and critic (value), no shared trunk: on CartPole one would only couple
    two losses of different scales (Huang et al. 2022, detail 13), and the rollout runs the actor alone."""
    hidden = (config.hidden_size, config.hidden_size)
    return MLP(hidden, num_actions), MLP(hidden, 1)


def init_orthogonal(
    networks: dict[str, tuple[MLP, float]], key: chex.PRNGKey, obs_shape: Sequence[int]
) -> dict:
    """Parameters of each named (network, head gain): orthogonal weights, gain sqrt(2) and the head's
    own (0.01 for the policy, which then starts near uniform; 1 for the value), zero biases (Huang et
    al. 2022, detail 2). A weight is the polar factor G (G^T G)^-1/2 of a Gaussian G, as uniform as
    flax's QR of G, by Newton-Schulz steps (batched LAPACK QR can deadlock on CPU: docs/ppo.md),
    from one Gaussian draw for all layers (on CPU each random-draw site is costly code to compile)."""
    shapes = {
        name: jax.eval_shape(net.init, key, jnp.zeros(obs_shape))
        for name, (net, _) in networks.items()
    }
    flat, unravel = flatten_util.ravel_pytree(
        jax.tree.map(lambda leaf: jnp.zeros(leaf.shape), shapes)
    )
    gaussians = unravel(jax.random.normal(key, flat.shape))

    def orthogonal(path, gaussian: chex.Array) -> chex.Array:
        if path[-1].key == "bias":
            return jnp.zeros_like(gaussian)
        net, head_gain = networks[path[0].key]
        x = gaussian / jnp.linalg.norm(gaussian)  # singular values in (0, 1]
        # A step maps each singular value s to s (3 - s^2) / 2: towards 1, x 1.5 while small.
        polar = jax.lax.fori_loop(0, 60, lambda _, x: 1.5 * x - 0.5 * x @ (x.T @ x), x)
        return polar * (
            head_gain if path[-2].key == f"Dense_{len(net.hidden_sizes)}" else math.sqrt(2)
        )

    return jax.tree_util.tree_map_with_path(orthogonal, gaussians)


def categorical_log_prob(logits: chex.Array, action: chex.Array) -> chex.Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)[..., 0]


# ---- train state and losses -----------------------------------------------------------------


@struct.dataclass
class TrainState:
    params: dict  # {"actor": ..., "critic": ...}
    opt_state: optax.OptState
    env_state: envs.EpisodeStatsState  # batched over num_envs
    obs: chex.Array  # [num_envs, obs_size], what each env shows now
    key: chex.PRNGKey


@struct.dataclass
class Transition:  # one rollout step of every env; [num_steps, num_envs, ...] after the scan
    obs: chex.Array
    action: chex.Array
    log_prob: chex.Array
    reward: chex.Array
    terminated: chex.Array
    truncated: chex.Array
    final_obs: chex.Array  # the observation the step reached, before any auto-reset
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
    nothing; a time-limit truncation bootstraps next_values[t], as the state is not terminal.
    Either end stops the advantage sum at the boundary. Returns (advantages, advantages + values)."""
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


def make_env(config: Config) -> tuple[envs.Environment, envs.CartPoleParams]:
    return envs.make(ENV_ID)[0], envs.CartPoleParams(**dataclasses.asdict(config.env))


def make_train(config: Config) -> tuple[Callable, Callable, Callable]:
    """Static work once; returns pure init(key) -> state, run_chunk(state) -> (state, metrics)
    and train(key) -> (state, metrics with a leading chunk axis)."""
    size = sizes(config)
    env, env_params = make_env(config)
    env = envs.EpisodeStats(env)
    obs_shape = env.observation_space(env_params).shape
    actor, critic = make_networks(config, env.num_actions)
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
        params = init_orthogonal(
            {"actor": (actor, 0.01), "critic": (critic, 1.0)}, key_params, obs_shape
        )
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(
            jax.random.split(key_envs, config.num_envs), env_params
        )
        return TrainState(params, optimizer.init(params), env_state, obs, key)

    def rollout(state: TrainState, key_actions: chex.PRNGKey, env_keys: chex.PRNGKey):
        # The actions' randomness in one draw before the scan: Gumbel noise, as
        # argmax(logits + Gumbel) is a sample of softmax(logits). env_keys: [num_steps, num_envs].
        gumbel = jax.random.gumbel(
            key_actions, (config.num_steps, config.num_envs, env.num_actions)
        )

        def env_step(carry, noise_and_keys):
            env_state, obs = carry
            noise, keys = noise_and_keys
            logits = actor.apply(state.params["actor"], obs)
            action = jnp.argmax(logits + noise, axis=-1)
            next_obs, env_state, reward, terminated, truncated, info = step_envs(
                keys, env_state, action, env_params
            )
            transition = Transition(
                obs,
                action,
                categorical_log_prob(logits, action),
                reward,
                terminated,
                truncated,
                info["final_observation"],
                info["episode_return"],
                info["episode_length"],
            )
            return (env_state, next_obs), transition

        (env_state, obs), transitions = jax.lax.scan(
            env_step, (state.env_state, state.obs), (gumbel, env_keys)
        )
        return state.replace(env_state=env_state, obs=obs), transitions

    def loss_fn(params: dict, minibatch: Batch) -> tuple[chex.Array, dict]:
        logits = actor.apply(params["actor"], minibatch.obs)
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
        values = critic.apply(params["critic"], minibatch.obs)[..., 0]
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
        # One rollout, GAE, then update_epochs x num_minibatches steps. All keys from one split:
        # on CPU every random-draw site is costly code to compile.
        keys = jax.random.split(state.key, 3 + config.num_steps * config.num_envs)
        key, key_actions, key_minibatches = keys[:3]
        state, transitions = rollout(
            state, key_actions, keys[3:].reshape(config.num_steps, config.num_envs)
        )
        chex.assert_shape(transitions.reward, (config.num_steps, config.num_envs))
        values = critic.apply(state.params["critic"], transitions.obs)[..., 0]
        next_values = critic.apply(state.params["critic"], transitions.final_obs)[..., 0]
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
            transitions.obs, transitions.action, transitions.log_prob, values, advantages, targets
        )
        batch = jax.tree.map(lambda x: x.reshape(size.batch_size, *x.shape[2:]), batch)
        indices = minibatch_indices(
            key_minibatches, config.update_epochs, size.batch_size, config.num_minibatches
        )
        (params, opt_state), losses = jax.lax.scan(
            partial(update_epoch, batch), (state.params, state.opt_state), indices
        )
        done = transitions.terminated | transitions.truncated
        stats = {name: loss.mean() for name, loss in losses.items()}
        stats |= dict(
            episodes=done.sum(),
            return_sum=jnp.where(done, transitions.episode_return, 0.0).sum(),
            length_sum=jnp.where(done, transitions.episode_length, 0).sum(),
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
    """evaluate(actor_params, key) -> (returns [eval_episodes], env states [eval_episodes, max_steps]) of
    the greedy policy: the time limit's steps without auto-reset, the state kept once an episode ended."""
    env, env_params = make_env(config)
    actor, _ = make_networks(config, env.num_actions)

    def episode(actor_params: dict, keys: chex.PRNGKey) -> tuple[chex.Array, envs.CartPoleState]:
        def step(carry, key):
            obs, env_state, total, running = carry
            action = jnp.argmax(actor.apply(actor_params, obs))
            obs, next_state, reward, terminated, _ = env.step_env(
                key, env_state, action, env_params
            )
            env_state = jax.tree.map(
                lambda new, old: jnp.where(running, new, old), next_state, env_state
            )
            return (obs, env_state, total + reward * running, running & ~terminated), env_state

        carry = (*env.reset(keys[0], env_params), jnp.float32(0.0), jnp.bool_(True))
        (_, _, total, _), states = jax.lax.scan(step, carry, keys[1:])
        return total, states

    def evaluate(actor_params: dict, key: chex.PRNGKey) -> tuple[chex.Array, envs.CartPoleState]:
        keys = jax.random.split(key, (config.eval_episodes, 1 + config.env.max_steps_in_episode))
        return jax.vmap(episode, in_axes=(None, 0))(actor_params, keys)

    return evaluate


def write_atomic(path: Path, write: Callable[[Path], Any]) -> None:
    """write(temporary path), then a rename: a reader never sees a half-written file."""
    temporary = path.with_name(path.name + ".tmp")
    write(temporary)
    os.replace(temporary, path)


def write_csv(path: Path, rows: list[dict]) -> None:
    lines = [",".join(CSV_COLUMNS)] + [
        ",".join(str(row[column]) for column in CSV_COLUMNS) for row in rows
    ]
    write_atomic(path, lambda temporary: temporary.write_text("\n".join(lines) + "\n"))


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
    """(the checkpoint's config with this run's evaluation and output flags, every seed's actor
    params); UsageError for a file that is not a checkpoint of this script and env."""
    try:
        payload = serialization.msgpack_restore(Path(config.load_model).read_bytes())
        script, env_id = payload["script"], payload["env_id"]
        if (script, env_id) == (SCRIPT, ENV_ID):
            saved = json.loads(payload["config"])
            saved = Config(**{**saved, "env": EnvConfig(**saved["env"])})
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
    return config, payload["params"]["actor"]


def plot_curves(path: Path, rows: list[dict]) -> None:
    """Return and losses against env steps: the mean over seeds and the min-max band."""
    from matplotlib.figure import (
        Figure,
    )  # imported here: only this output needs it, and it is slow to import

    seeds = sorted({row["seed"] for row in rows})
    steps = [row["env_steps"] for row in rows if row["seed"] == seeds[0]]
    fig = Figure(figsize=(13, 7), layout="tight")
    axes = fig.subplots(2, 3)
    for ax, name in zip(axes.flat, ["episode_return", *LOSS_NAMES], strict=True):
        values = np.array(
            [[row[name] for row in rows if row["seed"] == seed] for seed in seeds], float
        )
        ax.plot(steps, np.nanmean(values, axis=0))
        ax.fill_between(steps, np.nanmin(values, axis=0), np.nanmax(values, axis=0), alpha=0.25)
        ax.set(title=name, xlabel="env steps")
        ax.ticklabel_format(axis="x", style="sci", scilimits=(0, 0))
    axes.flat[0].axhline(SOLVED_RETURN, color="gray", linestyle="--", linewidth=1)
    fig.suptitle(f"PPO on {ENV_ID}, {len(seeds)} seed(s)")
    write_atomic(path, lambda temporary: fig.savefig(temporary, format="png", dpi=90))


def write_gif(
    path: Path, config: Config, states: envs.CartPoleState, steps_per_frame: int = 2
) -> None:
    """The first four evaluation episodes ([episodes, steps] states) side by side, drawn by the
    env's own renderer, every `steps_per_frame`-th step, in real time."""
    from PIL import Image  # matplotlib's dependency

    env, env_params = make_env(config)
    states = jax.tree.map(lambda x: x[:4, ::steps_per_frame], states)
    render = jax.jit(
        jax.vmap(jax.vmap(lambda state: env.render(state, env_params, height=120, width=180)))
    )
    images = [
        Image.fromarray(frame) for frame in np.concatenate(list(np.asarray(render(states))), axis=2)
    ]
    palette = images[0].quantize(
        colors=16
    )  # a few flat colours: one palette for all frames, 7x faster
    images = [image.quantize(palette=palette, dither=Image.Dither.NONE) for image in images]
    write_atomic(
        path,
        lambda temporary: images[0].save(
            temporary,
            format="GIF",
            save_all=True,
            loop=0,
            append_images=images[1:],
            duration=round(1000 * steps_per_frame * env_params.tau),
        ),
    )


# ---- main -----------------------------------------------------------------------------------


def seed_keys(config: Config) -> chex.PRNGKey:
    """One key per seed: seed i of a vmapped run is the same run as --seed seed+i alone."""
    return jax.vmap(jax.random.key)(config.seed + jnp.arange(config.num_seeds))


def train_with_progress(
    config: Config, sharding: NamedSharding, out: Path, evaluate: Callable, eval_keys: chex.PRNGKey
) -> tuple[dict, dict, list[dict], Callable]:
    """The CLI's loop: the jitted, vmapped run_chunk once per chunk with the state donated, a progress
    line and metrics rows in between, `evaluate` compiling meanwhile in a thread. Ctrl-C stops after
    the chunk; a non-finite value exits. Returns (params, summary, rows, the compiled evaluate)."""
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
    evaluate = ThreadPoolExecutor(1).submit(
        evaluate.lower(state.params["actor"], eval_keys).compile
    )

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
        ended = metrics["episode_return"][
            np.isfinite(metrics["episode_return"])
        ]  # seeds with an episode end
        shown = (
            f"{ended.mean():.1f} ± {ended.std():.1f} (min {ended.min():.1f})" if ended.size else "-"
        )
        print(
            f"steps {env_steps:,}/{size.env_steps:,} ({env_steps / size.env_steps:.0%}) | SPS {sps:,.0f} | "
            f"updates/s {size.iterations_per_chunk * size.updates_per_iteration * sps / size.chunk_steps:,.0f} | "
            f"return {shown} | "
            + " ".join(f"{name} {np.mean(metrics[name]):.3g}" for name in LOSS_NAMES)
            + f" | {elapsed:.1f} s, ETA {elapsed / chunk * (size.num_chunks - chunk):.1f} s",
            flush=True,
        )
        finite = {name: np.isfinite(metrics[name]) for name in LOSS_NAMES} | {
            "parameter": metrics["params_finite"]
        }
        for name, ok in finite.items():
            if not ok.all():  # exit status 1, the message on stderr
                sys.exit(
                    f"{SCRIPT}: non-finite {name} in chunk {chunk}, seed {config.seed + int(np.argmin(ok))}; "
                    f"stopped, the files in {out} hold the chunks so far"
                )
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
    return state.params, summary, rows, evaluate.result()


def main(config: Config) -> None:
    try:
        validate(config)
        if config.eval_only:
            config, actor_params = load_checkpoint(config)
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
        lambda path: path.write_text(json.dumps(dataclasses.asdict(config), indent=2)),
    )
    size = sizes(config)
    print(
        f"{SCRIPT}: {ENV_ID} on {device}, {config.num_seeds} seed(s) x {config.num_envs} envs"
        + (
            ""
            if config.eval_only
            else f", {size.num_iterations} iterations of {size.batch_size} steps in "
            f"{size.num_chunks} chunks ({size.env_steps:,} env steps per seed)"
        )
        + f"; outputs in {out}",
        flush=True,
    )
    evaluate = jax.jit(jax.vmap(make_evaluate(config)))
    eval_keys = jax.device_put(
        jax.vmap(lambda key: jax.random.fold_in(key, 1))(seed_keys(config)), sharding
    )
    summary: dict[str, Any] = dict(
        eval_only=config.eval_only
    )  # evaluation keys: a stream apart from training's
    if not config.eval_only:
        params, train_summary, rows, evaluate = train_with_progress(
            config, sharding, out, evaluate, eval_keys
        )
        actor_params, summary = params["actor"], summary | train_summary
        if config.save_model:
            save_checkpoint(out / "model.msgpack", config, params)
    returns, states = evaluate(jax.device_put(actor_params, sharding), eval_keys)
    final_returns = np.asarray(returns).mean(axis=1)
    print(
        f"greedy evaluation, {config.eval_episodes} episodes per seed: return {final_returns.mean():.1f} ± "
        f"{final_returns.std():.1f} (min {final_returns.min():.1f}); {(final_returns >= SOLVED_RETURN).sum()}/"
        f"{config.num_seeds} seed(s) >= {SOLVED_RETURN:g}",
        flush=True,
    )
    summary = dict(
        final_returns=final_returns.tolist(),
        final_return_mean=float(final_returns.mean()),
        final_return_std=float(final_returns.std()),
        **summary,
        num_seeds=config.num_seeds,
        num_envs=config.num_envs,
        eval_episodes=config.eval_episodes,
        device=device,
    )
    write_atomic(
        out / "summary.json", lambda temporary: temporary.write_text(json.dumps(summary, indent=2))
    )
    if config.plot and not config.eval_only:
        plot_curves(out / "curves.png", rows)
    if config.capture_gif:
        write_gif(out / "policy.gif", config, jax.device_get(jax.tree.map(lambda x: x[0], states)))
    print(f"wrote {', '.join(sorted(path.name for path in out.iterdir()))}")


if __name__ == "__main__":
    main(parse_config())
