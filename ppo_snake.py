"""PPO on Snake with a CNN (or a transformer) over the board, fully on device. Docs: docs/ppo.md

ppo_cartpole.py's loop with a board-sized network, as CleanRL's ppo_atari.py is ppo.py's sibling
(Schulman et al. 2017; GAE, Schulman et al. 2016; the details of Huang et al. 2022), and a death
may rewind its game to retry the stretch that killed it (docs/ppo.md).

    python ppo_snake.py                          # 10x10 board: train, evaluate, write runs/
    python ppo_snake.py --env.grid-size 6        # any board from 6x6 to 20x20
    python ppo_snake.py --network transformer    # a small transformer over the cells instead
    python ppo_snake.py --eval-only --load-model runs/<run>/model.msgpack
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
from optax.tree_utils import tree_where

import envs

SCRIPT = "ppo_snake"
Params = Any  # a flax parameter tree

# ---- config ----

GRID_SIZES = range(6, 21)  # the boards --env.grid-size accepts


@dataclasses.dataclass(frozen=True)
class EnvConfig:
    """Snake's board and hunger limit (envs.SnakeParams)."""

    grid_size: int = 10  # side of the square board in cells, 6 to 20
    egocentric: bool = True  # the view turns with the snake: head up, moves left/straight/right
    max_steps_without_food: int | None = None
    """steps without food before a truncation; None: 2 * grid_size**2, to go round the body"""


@dataclasses.dataclass(frozen=True)
class Config:
    seed: int = 1  # seed of the first run; seed i of --num-seeds uses seed + i
    num_seeds: int = 1  # independent runs trained at once in one vmapped program
    sweep: tuple[str, ...] | None = None
    """NAME=V1,V2,... entries of any field, e.g. ent-coef=0,0.01 conv-channels=16x32,32x64: every
    combination x --num-seeds runs, in one process (docs/sweeps.md)"""
    total_timesteps: int = 6_291_456  # env steps per seed (all envs), rounded down to whole chunks
    learning_rate: float = 2e-3  # Adam step size
    anneal_lr: bool = True  # decay the learning rate linearly to 0 over training
    num_envs: int = 64  # parallel envs per seed
    num_steps: int = 128  # steps per env per rollout (an iteration: num_envs * num_steps)
    gamma: float = 0.999  # discount factor: a horizon of 1,000 steps, a good snake's whole game
    gae_lambda: float = 0.95  # lambda of generalised advantage estimation
    num_minibatches: int = 32  # minibatches per epoch; must divide num_envs * num_steps
    update_epochs: int = 2  # passes over each rollout
    norm_adv: bool = True  # normalise the advantages within each minibatch
    clip_coef: float = 0.2  # clip range of the probability ratio (and of the value, --clip-vloss)
    clip_vloss: bool = False  # clip the value loss around the rollout's value estimates
    ent_coef: float = 0.01  # weight of the entropy bonus
    vf_coef: float = 0.5  # weight of the value loss
    max_grad_norm: float = 0.5  # clip the gradient to this global norm (optax.clip_by_global_norm)
    food_shaping: float = 1.0  # weight of the potential-based reward for steps towards the food
    rewind_prob: float = 0.5  # chance that a death rewinds its game to after the meal before last
    move_mask: bool = True  # forbid the moves into a wall or the body (the tail excepted)
    shield: bool = True  # evaluation only: the greedy policy also avoids dead ends (docs/ppo.md)
    network: Literal["conv", "transformer"] = "conv"
    """trunk under the policy and value heads: a small CNN, or a transformer over the cells"""
    conv_channels: tuple[int, ...] = (16, 32)  # channels of each 3x3 convolution of the conv trunk
    hidden_size: int = 128  # width of the dense ReLU layer on top of either trunk
    log_every: int = 65_536
    """env steps per chunk (whole iterations): one progress line and one metrics row per seed"""
    env: EnvConfig = EnvConfig()  # Snake's board


def make_env(config: Config) -> tuple[envs.Environment, envs.SnakeParams]:
    """The one place the env is made (the shaping and the evaluation read Snake's board)."""
    grid_size = config.env.grid_size
    hunger_limit = config.env.max_steps_without_food or 2 * grid_size**2  # None: the default
    env = envs.Snake(egocentric=config.env.egocentric)
    return env, envs.SnakeParams(grid_size=grid_size, max_steps_without_food=hunger_limit)


def env_name(config: Config) -> str:
    return f"Snake {config.env.grid_size}x{config.env.grid_size}"


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


HIDDEN_INIT = orthogonal(math.sqrt(2))  # the gains of Huang et al. 2022, detail 2
POLICY_INIT = orthogonal(0.01)  # a near-uniform first policy
VALUE_INIT = orthogonal(1.0)


def patches_3x3(x: Array) -> Array:
    """[..., rows, cols, 9 * channels]: each cell's 3x3 neighbourhood, zeros beyond the board; a
    dense layer on it is a 3x3 'same' convolution."""
    rows, cols = x.shape[-3:-1]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 3) + [(1, 1), (1, 1), (0, 0)])
    return jnp.concatenate(
        [padded[..., i : i + rows, j : j + cols, :] for i in range(3) for j in range(3)], axis=-1
    )


def reverse_move_mask(obs: Array) -> Array:
    """bool[..., 4]: True for the move back into the neck, which envs.Snake turns into "keep
    going" (for a snake longer than one): masked, the policy picks among three distinct moves.
    The neck is the head's neighbour of highest recency (channel 1: head 1 .. tail 1/length)."""
    around_head = jnp.einsum("...ij,...ijk->...k", obs[..., 0], patches_3x3(obs[..., 1:2]))
    # The recency of the cell each move enters: patch index 3 (row + 1) + (col + 1).
    neighbour_recency = around_head[..., [3 * row + col + 4 for row, col in envs.SNAKE_MOVES]]
    highest = neighbour_recency == neighbour_recency.max(-1, keepdims=True)
    return highest & (neighbour_recency > 0)


def soon_free_channel(obs: Array) -> Array:
    """[..., rows, cols, 1]: 1/k for a body cell free in k steps, else 0. The body channel (head 1
    .. tail 1/length) barely tells the tail, which the head may enter, from the cell behind it,
    which kills: tail / recency is 1/k."""
    recency = obs[..., 1:2]
    tail = jnp.min(jnp.where(recency > 0, recency, 1.0), axis=(-3, -2), keepdims=True)
    return tail / jnp.where(recency > 0, recency, jnp.inf)


def deadly_move_mask(obs: Array, soon_free: Array, num_actions: int) -> Array:
    """bool[..., num_actions]: True for a move into a wall or into a body cell still held after
    the next step (soon-free in (0, 1); the tail, 1, leaves as the head enters): envs.Snake's
    death rule, read from the board. Boxed in, every move is masked and the policy is uniform."""
    enterable = (soon_free == 0) | (soon_free == 1)  # zero beyond the board: a wall
    around_head = jnp.einsum("...ij,...ijk->...k", obs[..., 0], patches_3x3(enterable * 1.0))
    # The egocentric view's head points up: left, straight and right enter these cells.
    moves = ((0, -1), (-1, 0), (0, 1)) if num_actions == 3 else envs.SNAKE_MOVES
    return around_head[..., [3 * row + col + 4 for row, col in moves]] == 0


def shifted(x: Array, row: int, col: int) -> Array:
    """y[..., r, c] = x[..., r - row, c - col]: x moved by (row, col) cells, zeros shifted in."""
    rows, cols = x.shape[-2:]
    padded = jnp.pad(x, [(0, 0)] * (x.ndim - 2) + [(1, 1), (1, 1)])
    return padded[..., 1 - row : 1 - row + rows, 1 - col : 1 - col + cols]


def room_after_move(obs: Array, num_actions: int) -> Array:
    """int[..., num_actions]: the cells of the region each move enters, by a flood fill in which
    a body cell joins the region R only if it is free after |R| moves (soon-free 1/k: free in k),
    as the snake can make at most |R| moves in R, each into a new cell. 0 is envs.Snake's death
    rule: a wall, or a body cell still held after the step (the tail leaves as the head enters)."""
    soon_free = soon_free_channel(obs)[..., 0]
    free_in = jnp.where(soon_free > 0, jnp.round(1 / soon_free), 0)[..., None, :, :]
    moves = ((0, -1), (-1, 0), (0, 1)) if num_actions == 3 else envs.SNAKE_MOVES
    entered = jnp.stack([shifted(obs[..., 0], row, col) for row, col in moves], axis=-3) > 0

    def grow(region_and_growing: tuple[Array, Array]) -> tuple[Array, Array]:
        region, _ = region_and_growing
        near = functools.reduce(jnp.logical_or, [shifted(region, *m) for m in envs.SNAKE_MOVES])
        moves_in_region = region.sum((-2, -1), keepdims=True)
        grown = region | (near & (free_in <= moves_in_region + 1))
        return grown, jnp.any(grown != region)

    start = (entered & (free_in <= 1), jnp.bool_(True))
    return jax.lax.while_loop(lambda c: c[1], grow, start)[0].sum((-2, -1))


def dead_end_mask(obs: Array, num_actions: int) -> Array:
    """bool[..., num_actions]: the shield. True for a move with no room, and for a dead end: less
    room than the snake's length where another move has more (the largest region stays open)."""
    room = room_after_move(obs, num_actions)
    length = jnp.sum(obs[..., 1] > 0, axis=(-2, -1))[..., None]
    return room < jnp.minimum(length, jnp.maximum(room.max(-1, keepdims=True), 1))


class ConvTrunk(nn.Module):
    """3x3 'same' convolutions with ReLU into a dense ReLU layer (Mnih et al. 2015's Atari network
    for a small board). Each is a dense layer on 3x3 patches: under vmap over seeds nn.Conv
    becomes a grouped convolution whose gradient is 3.3x slower on the CPU (docs/ppo.md)."""

    channels: Sequence[int]
    hidden_size: int

    @nn.compact
    def __call__(self, board: Array) -> Array:
        x = board
        for layer, channels in enumerate(self.channels):
            conv = nn.Dense(channels, kernel_init=HIDDEN_INIT, name=f"conv_{layer}")
            x = nn.relu(conv(patches_3x3(x)))
        x = x.reshape(*x.shape[:-3], -1)
        return nn.relu(nn.Dense(self.hidden_size, kernel_init=HIDDEN_INIT, name="dense")(x))


class TransformerTrunk(nn.Module):
    """The cells as tokens (a linear embedding plus a learned position embedding), pre-norm
    self-attention blocks (Vaswani et al. 2017; Xiong et al. 2020), then the head's token into a
    dense ReLU layer: a mean over the cells would bury the few that matter among the empty ones."""

    hidden_size: int
    embed_dim: int = 32
    num_blocks: int = 2
    num_heads: int = 2

    @nn.compact
    def __call__(self, board: Array) -> Array:
        tokens = board.reshape(*board.shape[:-3], -1, board.shape[-1])  # [..., cells, channels]
        position = self.param(
            "position", nn.initializers.normal(0.02), (tokens.shape[-2], self.embed_dim)
        )
        x = nn.Dense(self.embed_dim, name="embed")(tokens) + position
        for block in range(self.num_blocks):
            attention = nn.MultiHeadDotProductAttention(self.num_heads, name=f"attention_{block}")
            x = x + attention(nn.LayerNorm()(x))
            mlp_in = nn.Dense(4 * self.embed_dim, name=f"mlp_in_{block}")
            hidden = nn.gelu(mlp_in(nn.LayerNorm()(x)))
            x = x + nn.Dense(self.embed_dim, name=f"mlp_out_{block}")(hidden)
        # Channel 0 marks the head: this picks the head's token.
        head_token = jnp.einsum("...t,...te->...e", tokens[..., 0], nn.LayerNorm()(x))
        dense = nn.Dense(self.hidden_size, kernel_init=HIDDEN_INIT, name="dense")
        return nn.relu(dense(head_token))


class ActorCritic(nn.Module):
    """Policy logits and value on one shared trunk, as ppo_atari.py: the features that find the
    food and the walls serve both heads, and one trunk costs half of two."""

    trunk: nn.Module
    num_actions: int
    move_mask: bool

    @nn.compact
    def __call__(self, obs: Array) -> tuple[Array, Array]:
        soon_free = soon_free_channel(obs)
        # A channel of ones marks the board, so that the zero padding beyond it reads as wall.
        board = jnp.concatenate([obs, soon_free, jnp.ones_like(soon_free)], axis=-1)
        features = self.trunk(board)
        logits = nn.Dense(self.num_actions, kernel_init=POLICY_INIT, name="policy")(features)
        if self.move_mask:  # finite logits, so that 0 x log-prob stays 0 in the entropy
            logits = jnp.where(deadly_move_mask(obs, soon_free, self.num_actions), -1e9, logits)
        if self.num_actions == 4:  # the fixed board's moves
            logits = jnp.where(reverse_move_mask(obs), -1e9, logits)
        value = nn.Dense(1, kernel_init=VALUE_INIT, name="value")(features)
        return logits, value[..., 0]


def make_network(config: Config, num_actions: int) -> ActorCritic:
    mask = config.move_mask
    if config.network == "conv":
        return ActorCritic(ConvTrunk(config.conv_channels, config.hidden_size), num_actions, mask)
    return ActorCritic(TransformerTrunk(config.hidden_size), num_actions, mask)


def categorical_log_prob(logits: Array, action: Array) -> Array:
    return jnp.take_along_axis(jax.nn.log_softmax(logits), action[..., None], axis=-1)[..., 0]


# ---- train state and losses ----


@struct.dataclass
class TrainState:
    """Everything that flows through the training scan (one seed)."""

    params: Params  # the ActorCritic's
    opt_state: optax.OptState
    env_state: envs.EpisodeStatsState  # [num_envs]
    obs: Array  # [num_envs, grid, grid, 3], what each env shows now
    last_meal: tuple[envs.EpisodeStatsState, Array]  # per env, (env state, obs) after it ate
    meal_before: tuple[envs.EpisodeStatsState, Array]  # the same one meal earlier: a rewind's
    key: PRNGKey
    env_steps: Array  # int32, all envs together
    updates: Array  # int32, gradient updates done


@struct.dataclass
class EpisodeEnds:
    """Per env step: whether an episode ended there, and its totals (0 elsewhere)."""

    ended: Array
    episode_return: Array
    episode_length: Array
    died: Array  # ended by a collision: the return counts -1 for it, the score does not
    won: Array  # ended by filling the board


@struct.dataclass
class Transition:
    """One rollout step of every env; [num_steps, num_envs, ...] after the scan."""

    obs: Array
    action: Array
    log_prob: Array
    value: Array  # the critic's, from the same forward pass as the action (one shared trunk)
    reward: Array
    terminated: Array
    truncated: Array
    final_obs: Array  # the observation the step reached, before any auto-reset
    episodes: EpisodeEnds


@struct.dataclass
class Batch:
    """What the PPO update needs of each sample; leading axis: samples."""

    obs: Array
    action: Array
    log_prob: Array
    value: Array
    advantage: Array
    target: Array  # the lambda-return: advantage + value


@struct.dataclass
class Losses:
    value_loss: Array
    policy_loss: Array
    entropy: Array
    approx_kl: Array
    clip_frac: Array


@struct.dataclass
class Metrics:
    """A chunk's numbers for one seed: means over its ended episodes (NaN if none), its updates."""

    env_steps: Array
    updates: Array
    episode_return: Array
    episode_length: Array
    score: Array  # food eaten per episode: the return plus 1 for a death
    win_rate: Array  # the fraction of episodes that filled the board
    value_loss: Array
    policy_loss: Array
    entropy: Array
    approx_kl: Array
    clip_frac: Array
    params_finite: Array  # False once any parameter is NaN or inf


def trained_params(config: Config, state: TrainState) -> Params:
    """What model.msgpack keeps and the evaluation reads: a run's parameters."""
    return state.params


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

    next_values[t] is the value of the state step t reached (at an episode end the final
    observation's, before the auto-reset). A termination bootstraps nothing, a truncation (the
    hunger limit) bootstraps it; either stops the advantage at the episode boundary.
    Returns (advantages, targets = advantages + values)."""
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


def food_potential(obs: Array) -> Array:
    """-(Manhattan distance from the head to the food) / grid size, per observation."""
    size = obs.shape[-2]
    offset = obs[..., 0] - obs[..., 2]  # one-hots: +1 at the head, -1 at the food
    lines = jnp.arange(size, dtype=jnp.float32)
    rows = jnp.einsum("...ij,i->...", offset, lines)  # the head's row minus the food's
    cols = jnp.einsum("...ij,j->...", offset, lines)
    return -(jnp.abs(rows) + jnp.abs(cols)) / size


def shaped_reward(
    reward: Array, obs: Array, final_obs: Array, terminated: Array, gamma: float, weight: float
) -> Array:
    """reward + weight * (gamma * potential(s') - potential(s)), the potential 0 at a
    termination: each step towards the food is rewarded at once, and the optimal policy stays as
    it was (potential-based shaping, Ng et al. 1999)."""
    next_potential = food_potential(final_obs) * (1.0 - terminated)
    return reward + weight * (gamma * next_potential - food_potential(obs))


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


def ppo_loss(
    params: Params, minibatch: Batch, network: nn.Module, config: Config
) -> tuple[Array, Losses]:
    """policy loss - ent_coef * entropy + vf_coef * value loss on one minibatch."""
    logits, values = network.apply(params, minibatch.obs)
    log_probs = jax.nn.log_softmax(logits)
    entropy = -(jnp.exp(log_probs) * log_probs).sum(-1).mean()
    advantages = minibatch.advantage
    if config.norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    policy_loss_value, approx_kl, clip_frac = policy_loss(
        categorical_log_prob(logits, minibatch.action),
        minibatch.log_prob,
        advantages,
        config.clip_coef,
    )
    value_loss_value = value_loss(
        values, minibatch.value, minibatch.target, config.clip_coef, config.clip_vloss
    )
    loss = policy_loss_value - config.ent_coef * entropy + config.vf_coef * value_loss_value
    return loss, Losses(
        value_loss=value_loss_value,
        policy_loss=policy_loss_value,
        entropy=entropy,
        approx_kl=approx_kl,
        clip_frac=clip_frac,
    )


def rewind_points(
    ate: Array, rewinds: Array, restarts: Array, now: Any, last_meal: Any, meal_before: Any
) -> tuple[Any, Any, Any]:
    """One env after a step: where its game goes on (a rewinding death: after the meal before
    last), and its new points after its last two meals (both the reset at a restart)."""
    now = tree_where(rewinds, meal_before, now)
    meal_before = tree_where(restarts, now, tree_where(ate, last_meal, meal_before))
    last_meal = tree_where(restarts | ate | rewinds, now, last_meal)
    return now, last_meal, meal_before


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
    network = make_network(config, env.num_actions)
    num_envs = config.num_envs
    num_steps = config.num_steps
    batch_size = num_envs * num_steps
    updates_per_iteration = config.update_epochs * config.num_minibatches
    num_iterations = num_chunks * iterations_per_chunk
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def learning_rate(count: Array) -> Array:
        """Linear to 0 over training, constant within an iteration (CleanRL's annealing)."""
        fraction_left = 1.0 - (count // updates_per_iteration) / num_iterations
        return config.learning_rate * (fraction_left if config.anneal_lr else 1.0)

    # optax.flatten: the same maths on one vector of all parameters, in a few fused kernels
    # instead of a few per parameter array, which keeps the compile time down.
    optimizer = optax.flatten(
        optax.chain(
            optax.clip_by_global_norm(config.max_grad_norm),
            optax.adam(learning_rate, eps=1e-5),  # PPO's reference eps (Huang et al., detail 3)
        )
    )

    def init(key: PRNGKey) -> TrainState:
        """A fresh network, optimiser and envs."""
        key_params, key_envs, key_loop = jax.random.split(key, 3)
        reset_envs = jax.vmap(env.reset, in_axes=(0, None))
        obs, env_state = reset_envs(jax.random.split(key_envs, num_envs), env_params)
        params = network.init(key_params, obs[0])
        return TrainState(
            params=params,
            opt_state=optimizer.init(params),
            env_state=env_state,
            obs=obs,
            last_meal=(env_state, obs),
            meal_before=(env_state, obs),
            key=key_loop,
            env_steps=jnp.int32(0),
            updates=jnp.int32(0),
        )

    def rollout(state: TrainState, key: PRNGKey) -> tuple[TrainState, Transition]:
        """num_steps steps of every env with the current policy; a death may rewind its game."""
        key_actions, key_envs, key_rewinds = jax.random.split(key, 3)
        # All the rollout's randomness in draws before the scan: Gumbel noise samples the
        # actions (argmax(logits + Gumbel) ~ softmax(logits), as jax.random.categorical draws).
        gumbel = jax.random.gumbel(key_actions, (num_steps, num_envs, env.num_actions))
        env_keys = jax.random.split(key_envs, (num_steps, num_envs))
        rewind_draws = jax.random.uniform(key_rewinds, (num_steps, num_envs))

        def env_step(carry, draws):
            env_state, obs, last_meal, meal_before = carry
            noise, keys, rewind_draw = draws
            logits, value = network.apply(state.params, obs)
            action = jnp.argmax(logits + noise, axis=-1)
            next_obs, env_state, reward, terminated, truncated, info = step_envs(
                keys, env_state, action, env_params
            )
            # The step's outcome is recorded as it happened; only where the game goes on changes.
            ate = reward > 0  # the env's reward: +1 for food, -1 for a death
            died = terminated & ~info["won"]
            rewinds = died & (rewind_draw < config.rewind_prob)
            restarts = (terminated | truncated) & ~rewinds
            now, last_meal, meal_before = jax.vmap(rewind_points)(
                ate, rewinds, restarts, (env_state, next_obs), last_meal, meal_before
            )
            transition = Transition(
                obs=obs,
                action=action,
                log_prob=categorical_log_prob(logits, action),
                value=value,
                reward=reward,
                terminated=terminated,
                truncated=truncated,
                final_obs=info["final_observation"],
                episodes=EpisodeEnds(
                    ended=info["returned_episode"],
                    episode_return=info["episode_return"],
                    episode_length=info["episode_length"],
                    died=died,
                    won=info["won"],
                ),
            )
            return (*now, last_meal, meal_before), transition

        carry = (state.env_state, state.obs, state.last_meal, state.meal_before)
        draws = (gumbel, env_keys, rewind_draws)
        (env_state, obs, last_meal, meal_before), transitions = jax.lax.scan(env_step, carry, draws)
        chex.assert_shape(transitions.reward, (num_steps, num_envs))
        state = state.replace(env_state=env_state, obs=obs, env_steps=state.env_steps + batch_size)
        return state.replace(last_meal=last_meal, meal_before=meal_before), transitions

    def advantages(params: Params, transitions: Transition) -> Batch:
        """GAE on the shaped rewards, the critic bootstrapping from each step's final obs; the
        rollout flattened into one batch of samples."""
        _, next_values = network.apply(params, transitions.final_obs)
        rewards = shaped_reward(
            transitions.reward,
            transitions.obs,
            transitions.final_obs,
            transitions.terminated,
            config.gamma,
            config.food_shaping,
        )
        advantage, target = compute_gae(
            rewards,
            transitions.value,
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
            value=transitions.value,
            advantage=advantage,
            target=target,
        )
        return jax.tree.map(lambda x: x.reshape(batch_size, *x.shape[2:]), batch)

    def update_minibatch(state: TrainState, minibatch: Batch) -> tuple[TrainState, Losses]:
        """One gradient step on the PPO loss."""
        grads, losses = jax.grad(ppo_loss, has_aux=True)(state.params, minibatch, network, config)
        updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        state = state.replace(params=params, opt_state=opt_state, updates=state.updates + 1)
        return state, losses

    def update_networks(state: TrainState, batch: Batch, key: PRNGKey) -> tuple[TrainState, Losses]:
        """update_epochs passes over the batch, each in num_minibatches shuffled minibatches."""

        def update_epoch(state: TrainState, key: PRNGKey) -> tuple[TrainState, Losses]:
            permutation = jax.random.permutation(key, batch_size)
            minibatches = jax.tree.map(
                lambda x: x[permutation].reshape(config.num_minibatches, -1, *x.shape[1:]), batch
            )
            return jax.lax.scan(update_minibatch, state, minibatches)

        epoch_keys = jax.random.split(key, config.update_epochs)
        state, losses = jax.lax.scan(update_epoch, state, epoch_keys)
        return state, jax.tree.map(jnp.mean, losses)

    def iteration(state: TrainState, unused: None) -> tuple[TrainState, tuple[EpisodeEnds, Losses]]:
        """One PPO iteration: a rollout, its advantages, then the gradient steps on them."""
        key, key_rollout, key_update = jax.random.split(state.key, 3)

        # COLLECT TRAJECTORIES
        state, transitions = rollout(state, key_rollout)

        # CALCULATE ADVANTAGE
        batch = advantages(state.params, transitions)

        # UPDATE NETWORK
        state, losses = update_networks(state, batch, key_update)

        # Only the episodes' statistics leave the scan, not the observations.
        return state.replace(key=key), (transitions.episodes, losses)

    def run_chunk(state: TrainState, chunk: Array) -> tuple[TrainState, Metrics]:
        """iterations_per_chunk iterations in one scan. `chunk` is unused: the learning-rate
        schedule counts the optimiser's own steps."""
        state, (episodes, losses) = jax.lax.scan(
            iteration, state, None, length=iterations_per_chunk
        )
        ended = episodes.ended
        params = jax.tree.leaves(trained_params(config, state))
        metrics = Metrics(
            env_steps=state.env_steps,
            updates=state.updates,
            episode_return=masked_mean(episodes.episode_return, ended),
            episode_length=masked_mean(episodes.episode_length, ended),
            score=masked_mean(episodes.episode_return + episodes.died, ended),
            win_rate=masked_mean(episodes.won, ended),
            params_finite=jnp.all(jnp.array([jnp.isfinite(x).all() for x in params])),
            **vars(jax.tree.map(jnp.mean, losses)),  # value_loss ... clip_frac, chunk means
        )
        return state, metrics

    def train(key: PRNGKey) -> tuple[TrainState, Metrics]:
        return jax.lax.scan(run_chunk, init(key), jnp.arange(num_chunks))

    return init, run_chunk, train


# ---- evaluation ----

GIF_BOARDS = 4  # boards side by side in policy.gif
GIF_FRAMES = 200


def make_greedy_policy(config: Config):
    """(env, env_params, act(params, obs, shield) -> the most probable move, among the moves that
    lead into no dead end if shield)."""
    env, env_params = make_env(config)
    network = make_network(config, env.num_actions)

    def act(params: Params, obs: Array, shield: bool = config.shield) -> Array:
        logits, _ = network.apply(params, obs)
        if shield:  # at evaluation only: in training it cost 1.4x and learnt less (docs/ppo.md)
            logits = jnp.where(dead_end_mask(obs, env.num_actions), -jnp.inf, logits)
        return jnp.argmax(logits, axis=-1)

    return env, env_params, act


def make_evaluate(config: Config, num_episodes: int):
    """evaluate(params, key) -> {"episode_return", "score", "win", "episode_length"}, each
    [num_episodes], of the greedy policy; each episode played to its end (the hunger limit). With
    the shield, the same games without it too: "score_unshielded" and "win_unshielded"."""
    env, env_params, act = make_greedy_policy(config)
    full_board = config.env.grid_size**2

    def episode(params: Params, key: PRNGKey, shield: bool) -> dict[str, Array]:
        key_reset, key_steps = jax.random.split(key)

        def running(carry) -> Array:
            _, _, terminated, truncated = carry
            return ~(terminated | truncated)

        def step(carry):
            obs, env_state, _, _ = carry
            # The episode's length is unknown beforehand: each step's key folds in its time.
            step_key = jax.random.fold_in(key_steps, env_state.time)
            obs, env_state, _, terminated, _ = env.step_env(
                step_key, env_state, act(params, obs, shield), env_params
            )
            return obs, env_state, terminated, env.is_truncated(env_state, env_params)

        obs, env_state = env.reset(key_reset, env_params)
        carry = (obs, env_state, jnp.bool_(False), jnp.bool_(False))
        _, final, terminated, _ = jax.lax.while_loop(running, step, carry)
        score = final.length - 1
        won = final.length == full_board
        died = terminated & ~won
        return {
            "episode_return": (score - died).astype(jnp.float32),
            "score": score.astype(jnp.float32),
            "win": won.astype(jnp.float32),
            "episode_length": final.time.astype(jnp.float32),
        }

    def evaluate(params: Params, key: PRNGKey) -> dict[str, Array]:
        episode_keys = jax.random.split(key, num_episodes)
        played = jax.vmap(functools.partial(episode, params, shield=config.shield))(episode_keys)
        if config.shield:  # the same games with the policy's own moves: what it learnt alone
            unshielded = jax.vmap(functools.partial(episode, params, shield=False))(episode_keys)
            played |= {f"{name}_unshielded": unshielded[name] for name in ("score", "win")}
        return played

    return evaluate


def make_render(config: Config):
    """(render(params, key) -> uint8 frames [time, height, width, 3]: the greedy policy on
    GIF_BOARDS boards side by side for GIF_FRAMES steps, a board whose game ends starting a new
    one; seconds per frame). Not whole episodes: a good snake's are too long to keep."""
    env, env_params, act = make_greedy_policy(config)
    step_envs = jax.vmap(env.step, in_axes=(0, 0, 0, None))
    cell_pixels = max(4, 120 // config.env.grid_size)  # about 120 pixels a board, any size
    draw = functools.partial(env.render, params=env_params, cell_pixels=cell_pixels)

    def render(params: Params, key: PRNGKey) -> Array:
        key_reset, key_steps = jax.random.split(key)
        reset_keys = jax.random.split(key_reset, GIF_BOARDS)
        obs, env_state = jax.vmap(env.reset, in_axes=(0, None))(reset_keys, env_params)

        def step(carry, keys):
            obs, env_state = carry
            boards = jax.vmap(draw)(env_state)
            gap = jnp.full((boards.shape[1], cell_pixels, 3), 255, jnp.uint8)
            parts = [part for board in boards for part in (board, gap)][:-1]
            image = jnp.concatenate(parts, axis=1)  # the boards left to right
            obs, env_state, *_ = step_envs(keys, env_state, act(params, obs), env_params)
            return (obs, env_state), image

        step_keys = jax.random.split(key_steps, (GIF_FRAMES, GIF_BOARDS))
        return jax.lax.scan(step, (obs, env_state), step_keys)[1]

    return render, 0.1  # 10 moves a second


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
METRIC_COLUMNS = ("episode_return", "episode_length", "score", "win_rate", *LOSS_COLUMNS)
PROGRESS_COLUMNS = ("score", "win_rate", "value_loss", "entropy")  # on each progress line
EVAL_EPISODES = 100  # greedy episodes per run by default (a good snake's scores vary a lot)
CPU_CHUNK = {"xla_backend_optimization_level": 2}  # the chunk's XLA options on a CPU (usage.md)


def solved_return(config: Config) -> float:
    # A nearly full board, 93% of the food: 92 of 99 on 10x10 (the return counts -1 per death).
    return round(0.93 * (config.env.grid_size**2 - 1))


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
    for name in ("num_seeds", "num_envs", "total_timesteps", "num_steps", "num_minibatches"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("update_epochs", "hidden_size", "log_every"):
        require(getattr(config, name) >= 1, name, ">= 1", getattr(config, name))
    for name in ("learning_rate", "clip_coef", "max_grad_norm"):
        require(getattr(config, name) > 0, name, "> 0", getattr(config, name))
    for name in ("ent_coef", "vf_coef", "food_shaping"):
        require(getattr(config, name) >= 0, name, ">= 0", getattr(config, name))
    last_seed = 2**31 - config.num_seeds  # every run's seed fits in int32
    require(0 <= config.seed <= last_seed, "seed", f"in [0, {last_seed}]", config.seed)
    require(0 < config.gamma <= 1, "gamma", "in (0, 1]", config.gamma)
    require(0 <= config.gae_lambda <= 1, "gae_lambda", "in [0, 1]", config.gae_lambda)
    channels_ok = len(config.conv_channels) > 0 and min(config.conv_channels) >= 1
    require(channels_ok, "conv_channels", "one or more counts >= 1", config.conv_channels)
    sizes = f"in [{GRID_SIZES[0]}, {GRID_SIZES[-1]}]"
    require(config.env.grid_size in GRID_SIZES, "env.grid_size", sizes, config.env.grid_size)
    hunger_limit = config.env.max_steps_without_food
    hunger_ok = hunger_limit is None or hunger_limit >= 1
    require(hunger_ok, "env.max_steps_without_food", ">= 1 or None", hunger_limit)
    batch_size = config.num_envs * config.num_steps
    divides_ok = batch_size % config.num_minibatches == 0
    divides = f"a divisor of --num-envs * --num-steps = {batch_size}"
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
