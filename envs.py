"""Pure-JAX environments with a gymnax-compatible API. Docs: docs/envs.md

CartPole-v1, CartPoleContinuous, CartPoleSwingup, Pendulum-v1 and Snake, and Brax's tasks
through an adapter (`make("brax/inverted_double_pendulum")`, brax installed). Every function is
pure, jit- and vmap-able: state and params are `flax.struct.dataclass`es, randomness comes
from explicit keys, and there is no Python control flow on traced values.

    env, params = envs.make("Pendulum-v1")
    obs, state = env.reset(key, params)
    obs, state, reward, terminated, truncated, info = env.step(key, state, action, params)

`step` auto-resets a finished episode; `info["final_observation"]` keeps the observation the
episode ended on, for bootstrapping at a time limit. `reset_env` / `step_env` never reset.
"""

import contextlib
import functools
import io
from typing import Any

import chex
import jax
import jax.numpy as jnp
from flax import struct

# ---------------------------------------------------------------------------------------------
# spaces and the base class
# ---------------------------------------------------------------------------------------------


class Discrete:
    """Actions 0 .. num_categories - 1 (gymnax's `spaces.Discrete`)."""

    def __init__(self, num_categories: int):
        self.n = num_categories
        self.shape: tuple[int, ...] = ()
        self.dtype = jnp.int32

    def sample(self, key: chex.PRNGKey) -> chex.Array:
        return jax.random.randint(key, (), 0, self.n, dtype=self.dtype)

    def contains(self, x: chex.Array) -> chex.Array:
        return jnp.logical_and(x >= 0, x < self.n)


class Box:
    """A box in R^shape, bounds inclusive (gymnax's `spaces.Box`)."""

    def __init__(self, low: Any, high: Any, shape: tuple[int, ...], dtype: Any = jnp.float32):
        self.low = jnp.broadcast_to(jnp.asarray(low, dtype), shape)
        self.high = jnp.broadcast_to(jnp.asarray(high, dtype), shape)
        self.shape = shape
        self.dtype = dtype

    def sample(self, key: chex.PRNGKey) -> chex.Array:
        # Unbounded dimensions sample from a standard normal, bounded ones uniformly.
        finite = jnp.isfinite(self.low) & jnp.isfinite(self.high)
        unit = jax.random.uniform(key, self.shape, self.dtype, 0.0, 1.0)
        bounded = self.low + unit * (
            jnp.where(finite, self.high, 1.0) - jnp.where(finite, self.low, 0.0)
        )
        return jnp.where(finite, bounded, jax.random.normal(key, self.shape, self.dtype))

    def contains(self, x: chex.Array) -> chex.Array:
        return jnp.all((x >= self.low) & (x <= self.high))


class Environment:
    """gymnax-style base: subclasses define `default_params`, `reset_env`, `step_env`,
    `get_obs`, `is_truncated`, the spaces and `render`; this class adds the auto-reset."""

    # True when `step_env` uses no randomness on a step that ends the episode: then the reset
    # and the step never both use their draws, and `step` can give both the same key instead
    # of splitting it, which saves a threefry hash per env and step.
    step_and_reset_share_key: bool = False

    @property
    def default_params(self) -> Any:
        raise NotImplementedError

    def reset(self, key: chex.PRNGKey, params: Any = None) -> tuple[chex.Array, Any]:
        params = self.default_params if params is None else params
        return self.reset_env(key, params)

    def step(
        self, key: chex.PRNGKey, state: Any, action: chex.Array, params: Any = None
    ) -> tuple[chex.Array, Any, chex.Array, chex.Array, chex.Array, dict]:
        """One step with auto-reset: a finished episode's state is replaced by a fresh one."""
        params = self.default_params if params is None else params
        if self.step_and_reset_share_key:
            key_step = key_reset = key
        else:
            key_step, key_reset = jax.random.split(key)
        obs_step, state_step, reward, terminated, info = self.step_env(
            key_step, state, action, params
        )
        truncated = self.is_truncated(state_step, params)
        done = jnp.logical_or(terminated, truncated)
        _, state_reset = self.reset_env(key_reset, params)
        state = jax.tree.map(lambda new, old: jnp.where(done, new, old), state_reset, state_step)
        # The observation of the chosen state rather than a choice between two observations:
        # XLA then drops the reset's observation, and the step's too when the caller does not
        # read info["final_observation"].
        obs = self.get_obs(state, params)
        info = {**info, "final_observation": obs_step}
        return obs, state, reward, terminated, truncated, info

    def reset_env(self, key: chex.PRNGKey, params: Any) -> tuple[chex.Array, Any]:
        raise NotImplementedError

    def get_obs(self, state: Any, params: Any = None) -> chex.Array:
        raise NotImplementedError

    def step_env(
        self, key: chex.PRNGKey, state: Any, action: chex.Array, params: Any
    ) -> tuple[chex.Array, Any, chex.Array, chex.Array, dict]:
        raise NotImplementedError

    def is_truncated(self, state: Any, params: Any) -> chex.Array:
        """Time limit, as gymnasium's TimeLimit: reported even when the step also terminated."""
        return state.time >= params.max_steps_in_episode

    @property
    def name(self) -> str:
        return type(self).__name__

    @property
    def num_actions(self) -> int:
        raise NotImplementedError


def uniform(key: chex.PRNGKey, count: int, low: Any = 0.0, high: Any = 1.0) -> chex.Array:
    """float32[count], independent and uniform in [low, high), as `jax.random.uniform` draws
    them but with half the hashing: that spends one 64-bit threefry hash per 32-bit number
    (JAX's partitionable threefry XORs the hash's two words), while the words of a split key
    are that same hash's two outputs, each uniform. Resets run on every step (auto-reset
    computes them for every env), so this is a measurable part of a step."""
    words = jax.random.key_data(jax.random.split(key, -(-count // 2))).reshape(-1)[:count]
    # 23 random mantissa bits under the exponent of 1.0 give a float in [1, 2).
    unit = jax.lax.bitcast_convert_type((words >> 9) | jnp.uint32(0x3F800000), jnp.float32) - 1.0
    return jnp.asarray(low, jnp.float32) + (jnp.asarray(high, jnp.float32) - low) * unit


# ---------------------------------------------------------------------------------------------
# drawing helpers for the renderers (pure jnp, so renders are vmap-able)
# ---------------------------------------------------------------------------------------------


def _pixel_grid(height: int, width: int) -> tuple[chex.Array, chex.Array]:
    """Pixel-centre coordinates, rows going down and columns going right."""
    rows, cols = jnp.meshgrid(jnp.arange(height) + 0.5, jnp.arange(width) + 0.5, indexing="ij")
    return rows, cols


def _segment_mask(rows, cols, start, end, half_width) -> chex.Array:
    """Pixels within `half_width` of the segment start-end (points as (row, col))."""
    direction = end - start
    length_sq = jnp.maximum(jnp.sum(direction**2), 1e-6)
    t = ((rows - start[0]) * direction[0] + (cols - start[1]) * direction[1]) / length_sq
    t = jnp.clip(t, 0.0, 1.0)
    dist_sq = (rows - start[0] - t * direction[0]) ** 2 + (cols - start[1] - t * direction[1]) ** 2
    return dist_sq <= half_width**2


def _paint(image: chex.Array, mask: chex.Array, color: tuple[int, int, int]) -> chex.Array:
    return jnp.where(mask[..., None], jnp.asarray(color, jnp.uint8), image)


def _blank(height: int, width: int) -> chex.Array:
    return jnp.full((height, width, 3), 255, jnp.uint8)


# ---------------------------------------------------------------------------------------------
# CartPole-v1 (discrete), CartPoleContinuous and CartPoleSwingup
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class CartPoleState:
    x: chex.Array
    x_dot: chex.Array
    theta: chex.Array
    theta_dot: chex.Array
    time: chex.Array


@struct.dataclass
class CartPoleParams:
    """Constants of gymnasium's CartPoleEnv (classic_control/cartpole.py)."""

    gravity: float = 9.8
    masscart: float = 1.0
    masspole: float = 0.1
    length: float = 0.5  # half the pole's length
    force_mag: float = 10.0
    tau: float = 0.02  # seconds between state updates
    theta_threshold_radians: float = 12 * 2 * jnp.pi / 360
    x_threshold: float = 2.4
    max_steps_in_episode: int = 500


class CartPole(Environment):
    """Gymnasium's CartPole-v1 exactly: Euler integration, reward 1 per step (also on the
    terminating step), termination at |x| > 2.4 or |theta| > 12 degrees, truncation at 500."""

    step_and_reset_share_key = True  # the physics is deterministic

    @property
    def default_params(self) -> CartPoleParams:
        return CartPoleParams()

    def force(self, action: chex.Array, params: CartPoleParams) -> chex.Array:
        return jnp.where(action == 1, params.force_mag, -params.force_mag)

    def dynamics(
        self, state: CartPoleState, force: chex.Array, params: CartPoleParams
    ) -> CartPoleState:
        """One Euler step of the cart-pole equations (Barto, Sutton & Anderson 1983), written
        in gymnasium's order of operations so the float results match it."""
        total_mass = params.masspole + params.masscart
        polemass_length = params.masspole * params.length
        cos_theta, sin_theta = jnp.cos(state.theta), jnp.sin(state.theta)
        temp = (force + polemass_length * state.theta_dot**2 * sin_theta) / total_mass
        theta_acc = (params.gravity * sin_theta - cos_theta * temp) / (
            params.length * (4.0 / 3.0 - params.masspole * cos_theta**2 / total_mass)
        )
        x_acc = temp - polemass_length * theta_acc * cos_theta / total_mass
        return CartPoleState(
            x=state.x + params.tau * state.x_dot,
            x_dot=state.x_dot + params.tau * x_acc,
            theta=state.theta + params.tau * state.theta_dot,
            theta_dot=state.theta_dot + params.tau * theta_acc,
            time=state.time + 1,
        )

    def step_env(self, key, state, action, params):
        state = self.dynamics(state, self.force(action, params), params)
        terminated = self.is_terminal(state, params)
        reward = jnp.ones((), jnp.float32)
        return self.get_obs(state), state, reward, terminated, {}

    def is_terminal(self, state: CartPoleState, params: CartPoleParams) -> chex.Array:
        out_of_track = jnp.abs(state.x) > params.x_threshold
        fallen = jnp.abs(state.theta) > params.theta_threshold_radians
        return jnp.logical_or(out_of_track, fallen)

    def reset_env(self, key, params):
        x, x_dot, theta, theta_dot = uniform(key, 4, -0.05, 0.05)
        state = CartPoleState(x=x, x_dot=x_dot, theta=theta, theta_dot=theta_dot, time=jnp.int32(0))
        return self.get_obs(state), state

    def get_obs(self, state: CartPoleState, params: CartPoleParams | None = None) -> chex.Array:
        # jnp.array (a concatenate under vmap) rather than jnp.stack (a stack and a transpose).
        return jnp.array([state.x, state.x_dot, state.theta, state.theta_dot], jnp.float32)

    def observation_space(self, params: CartPoleParams) -> Box:
        high = jnp.array(
            [params.x_threshold * 2, jnp.inf, params.theta_threshold_radians * 2, jnp.inf]
        )
        return Box(-high, high, (4,))

    def action_space(self, params: CartPoleParams | None = None) -> Discrete:
        return Discrete(2)

    @property
    def num_actions(self) -> int:
        return 2

    @property
    def name(self) -> str:
        return "CartPole-v1"

    def render(
        self, state: CartPoleState, params: CartPoleParams, height: int = 200, width: int = 300
    ) -> chex.Array:
        """The cart on its track and the pole, as gymnasium draws it (uint8[height, width, 3])."""
        rows, cols = _pixel_grid(height, width)
        scale = width / (2 * params.x_threshold * 1.1)
        track_row = height * 0.7
        cart_col = width / 2 + state.x * scale
        cart_half_w, cart_half_h = 0.25 * scale, 0.15 * scale
        pole_tip = jnp.stack(
            [
                track_row - 2 * params.length * scale * jnp.cos(state.theta),
                cart_col + 2 * params.length * scale * jnp.sin(state.theta),
            ]
        )
        pivot = jnp.stack([track_row, cart_col])
        image = _blank(height, width)
        image = _paint(image, jnp.abs(rows - track_row) < 1, (0, 0, 0))
        cart = (jnp.abs(cols - cart_col) < cart_half_w) & (jnp.abs(rows - track_row) < cart_half_h)
        image = _paint(image, cart, (0, 0, 0))
        image = _paint(
            image, _segment_mask(rows, cols, pivot, pole_tip, 0.04 * scale), (202, 152, 101)
        )
        axle = (rows - track_row) ** 2 + (cols - cart_col) ** 2 < (0.03 * scale) ** 2
        return _paint(image, axle, (129, 132, 203))


class CartPoleContinuous(CartPole):
    """CartPole-v1's physics and termination with a continuous force: action in [-1, 1]
    (clipped; NaN counts as 0) times `force_mag`."""

    def force(self, action: chex.Array, params: CartPoleParams) -> chex.Array:
        action = jnp.nan_to_num(jnp.asarray(action, jnp.float32).reshape(()), nan=0.0)
        return jnp.clip(action, -1.0, 1.0) * params.force_mag

    def action_space(self, params: CartPoleParams | None = None) -> Box:
        return Box(-1.0, 1.0, (1,))

    @property
    def num_actions(self) -> int:
        return 1

    @property
    def name(self) -> str:
        return "CartPoleContinuous"


class CartPoleSwingup(CartPoleContinuous):
    """Swing-up: the pole starts hanging down, may turn freely, and the episode ends only at
    the track edges or after 500 steps. Reward in [0, 1]:
        upright * centred,  upright = (1 + cos theta) / 2,  centred = 1 - (x / x_threshold)^2 / 2
    Observation [x, x_dot, cos theta, sin theta, theta_dot]: the angle is unbounded here."""

    def reset_env(self, key, params):
        noise = uniform(key, 4, -0.05, 0.05)
        state = CartPoleState(
            x=noise[0],
            x_dot=noise[1],
            theta=jnp.pi + noise[2],
            theta_dot=noise[3],
            time=jnp.int32(0),
        )
        return self.get_obs(state), state

    def step_env(self, key, state, action, params):
        state = self.dynamics(state, self.force(action, params), params)
        upright = (1.0 + jnp.cos(state.theta)) / 2.0
        centred = 1.0 - 0.5 * jnp.minimum((state.x / params.x_threshold) ** 2, 1.0)
        reward = (upright * centred).astype(jnp.float32)
        return self.get_obs(state), state, reward, self.is_terminal(state, params), {}

    def is_terminal(self, state: CartPoleState, params: CartPoleParams) -> chex.Array:
        return jnp.abs(state.x) > params.x_threshold

    def get_obs(self, state: CartPoleState, params: CartPoleParams | None = None) -> chex.Array:
        return jnp.array(
            [state.x, state.x_dot, jnp.cos(state.theta), jnp.sin(state.theta), state.theta_dot],
            jnp.float32,
        )

    def observation_space(self, params: CartPoleParams) -> Box:
        high = jnp.array([params.x_threshold * 2, jnp.inf, 1.0, 1.0, jnp.inf])
        return Box(-high, high, (5,))

    @property
    def name(self) -> str:
        return "CartPoleSwingup"


# ---------------------------------------------------------------------------------------------
# Pendulum-v1
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class PendulumState:
    theta: chex.Array
    theta_dot: chex.Array
    last_u: chex.Array  # last torque applied, for the renderer
    time: chex.Array


@struct.dataclass
class PendulumParams:
    """Constants of gymnasium's PendulumEnv (classic_control/pendulum.py)."""

    max_speed: float = 8.0
    max_torque: float = 2.0
    dt: float = 0.05
    g: float = 10.0
    m: float = 1.0
    l: float = 1.0  # noqa: E741 (gymnasium's name)
    max_steps_in_episode: int = 200


def angle_normalize(theta: chex.Array) -> chex.Array:
    """Angle in [-pi, pi), as gymnasium's pendulum.angle_normalize."""
    return ((theta + jnp.pi) % (2 * jnp.pi)) - jnp.pi


class Pendulum(Environment):
    """Gymnasium's Pendulum-v1 exactly: theta_dot += (3g/(2l) sin theta + 3/(m l^2) u) dt,
    clipped to max_speed, then theta += theta_dot dt; reward -(theta^2 + 0.1 theta_dot^2 +
    0.001 u^2) with theta normalised; never terminates, truncated at 200 steps."""

    step_and_reset_share_key = True  # the physics is deterministic

    @property
    def default_params(self) -> PendulumParams:
        return PendulumParams()

    def step_env(self, key, state, action, params):
        action = jnp.nan_to_num(jnp.asarray(action, jnp.float32).reshape(()), nan=0.0)
        torque = jnp.clip(action, -params.max_torque, params.max_torque)
        cost = angle_normalize(state.theta) ** 2 + 0.1 * state.theta_dot**2 + 0.001 * torque**2
        theta_dot = (
            state.theta_dot
            + (
                3 * params.g / (2 * params.l) * jnp.sin(state.theta)
                + 3.0 / (params.m * params.l**2) * torque
            )
            * params.dt
        )
        theta_dot = jnp.clip(theta_dot, -params.max_speed, params.max_speed)
        theta = state.theta + theta_dot * params.dt
        state = PendulumState(theta=theta, theta_dot=theta_dot, last_u=torque, time=state.time + 1)
        reward = (-cost).astype(jnp.float32)
        return self.get_obs(state), state, reward, jnp.bool_(False), {}

    def reset_env(self, key, params):
        high = jnp.array([jnp.pi, 1.0])  # gymnasium's DEFAULT_X, DEFAULT_Y
        theta, theta_dot = uniform(key, 2, -high, high)
        state = PendulumState(
            theta=theta, theta_dot=theta_dot, last_u=jnp.float32(0.0), time=jnp.int32(0)
        )
        return self.get_obs(state), state

    def get_obs(self, state: PendulumState, params: PendulumParams | None = None) -> chex.Array:
        return jnp.array([jnp.cos(state.theta), jnp.sin(state.theta), state.theta_dot], jnp.float32)

    def observation_space(self, params: PendulumParams) -> Box:
        high = jnp.array([1.0, 1.0, params.max_speed])
        return Box(-high, high, (3,))

    def action_space(self, params: PendulumParams | None = None) -> Box:
        params = self.default_params if params is None else params
        return Box(-params.max_torque, params.max_torque, (1,))

    @property
    def num_actions(self) -> int:
        return 1

    @property
    def name(self) -> str:
        return "Pendulum-v1"

    def render(
        self, state: PendulumState, params: PendulumParams, height: int = 200, width: int = 200
    ) -> chex.Array:
        """The rod from the pivot and a bar showing the torque. As gymnasium draws it, theta = 0
        points up and positive theta and torque turn counter-clockwise (the bar grows left)."""
        rows, cols = _pixel_grid(height, width)
        centre = jnp.array([height / 2, width / 2])
        rod_length = 0.4 * min(height, width)
        tip = centre + rod_length * jnp.stack([-jnp.cos(state.theta), -jnp.sin(state.theta)])
        image = _blank(height, width)
        image = _paint(
            image, _segment_mask(rows, cols, centre, tip, 0.05 * rod_length), (204, 77, 77)
        )
        torque_end = centre + jnp.stack(
            [0.45 * height, -state.last_u / params.max_torque * 0.4 * width]
        )
        torque_start = centre + jnp.array([0.45 * height, 0.0])
        image = _paint(
            image, _segment_mask(rows, cols, torque_start, torque_end, 2.0), (60, 60, 200)
        )
        pivot = (rows - centre[0]) ** 2 + (cols - centre[1]) ** 2 < (0.04 * rod_length) ** 2
        return _paint(image, pivot, (0, 0, 0))


# ---------------------------------------------------------------------------------------------
# Snake
# ---------------------------------------------------------------------------------------------

# Absolute moves: 0 up, 1 right, 2 down, 3 left, as (row, col) offsets.
# Plain tuples: an array made at import would start JAX's backend, and a --distributed run must
# join its processes before that.
SNAKE_MOVES = ((-1, 0), (0, 1), (1, 0), (0, -1))


@struct.dataclass
class SnakeState:
    body: (
        chex.Array
    )  # int32[grid, grid]: steps until each cell is vacated: 0 free, tail 1, head = length
    head: chex.Array  # int32[2], (row, col)
    direction: chex.Array  # int32, the last move taken (0 before the first)
    food: chex.Array  # int32[2], (row, col)
    length: chex.Array  # int32
    steps_since_food: chex.Array  # int32
    time: chex.Array  # int32
    mirrored: chex.Array  # bool: this episode's egocentric view is mirrored left-right


@struct.dataclass
class SnakeParams:
    grid_size: int = struct.field(pytree_node=False, default=10)  # sets shapes, so static; >= 2
    max_steps_without_food: int = 100


def _cell_mask(size: int, cell: chex.Array) -> chex.Array:
    """bool[size, size], True at `cell` (row, col) only; all False when `cell` is off the grid.
    A comparison with iotas rather than a scatter: it vectorises and fuses under vmap."""
    rows = jnp.arange(size)[:, None]
    cols = jnp.arange(size)[None, :]
    return (rows == cell[0]) & (cols == cell[1])


def _cell_of_index(index: chex.Array, size: int) -> chex.Array:
    return jnp.stack([index // size, index % size]).astype(jnp.int32)


class Snake(Environment):
    """Snake on a square grid. Four absolute moves; a snake longer than one cannot turn back into
    its neck: that move keeps the current direction. Moving into the cell the tail is leaving is
    allowed. +1 per food (the snake grows by one), -1 on death; the episode ends on a wall or self
    collision, or on a full board (a win), all terminated; it is truncated after
    `max_steps_without_food` steps without eating. Food appears uniformly on a free cell.
    Observation float32[grid, grid, 3]: head, body recency (head 1 .. tail 1/length), food.

    `Snake(egocentric=True)`: the view turns with the snake. The board is rotated so that the
    heading points up and mirrored left-right in a random half of the episodes, and the three
    moves are relative to the heading: 0 left, 1 straight, 2 right, as seen in the view (in a
    mirrored episode the view's left is the board's right). Each episode starts with a uniform
    heading. A policy then learns each situation once, not once per rotation and reflection."""

    def __init__(self, egocentric: bool = False):
        self.egocentric = egocentric

    # The step draws food only when the snake eats, and eating never ends the episode except on
    # a win, where no food can be placed; so a reset and a food draw are never both used.
    step_and_reset_share_key = True

    @property
    def default_params(self) -> SnakeParams:
        return SnakeParams()

    def reset_env(self, key, params):
        """A snake of length 1 on a uniform cell, food uniform on another cell."""
        size = params.grid_size
        if size < 2:
            raise ValueError(f"Snake needs grid_size >= 2, got {size}")
        num_cells = size * size
        draws = uniform(key, 4 if self.egocentric else 2)
        head_draw, food_draw = draws[0], draws[1]
        direction, mirrored = jnp.int32(0), jnp.bool_(False)
        if self.egocentric:
            direction = jnp.floor(draws[2] * 4).astype(jnp.int32)
            mirrored = draws[3] < 0.5
        head_index = jnp.floor(head_draw * num_cells).astype(jnp.int32)
        food_index = jnp.floor(food_draw * (num_cells - 1)).astype(jnp.int32)
        food_index = food_index + (food_index >= head_index)  # skip the head's cell
        head = _cell_of_index(head_index, size)
        state = SnakeState(
            body=_cell_mask(size, head).astype(jnp.int32),
            head=head,
            direction=direction,
            food=_cell_of_index(food_index, size),
            length=jnp.int32(1),
            steps_since_food=jnp.int32(0),
            time=jnp.int32(0),
            mirrored=mirrored,
        )
        return self.get_obs(state, params), state

    def _place_food(self, key: chex.PRNGKey, free: chex.Array, num_free: chex.Array) -> chex.Array:
        """A uniform cell among the `num_free` True cells of `free`: the k-th in row-major order,
        k uniform in [0, num_free); exact also on an almost full board. Found by counting free
        cells per row, then within its row: two cumulative sums of `grid` numbers, not one of
        grid^2 (XLA computes a cumulative sum of n numbers with n^2 additions)."""
        k = jnp.floor(jax.random.uniform(key) * num_free).astype(jnp.int32)
        k = jnp.minimum(k, num_free - 1)
        free_per_row = jnp.sum(free, axis=1, dtype=jnp.int32)
        free_through_row = jnp.cumsum(free_per_row)
        row = jnp.argmax(free_through_row > k)
        k_in_row = k - (free_through_row[row] - free_per_row[row])
        free_in_row = jax.lax.dynamic_index_in_dim(free, row, keepdims=False).astype(jnp.int32)
        col = jnp.argmax(jnp.cumsum(free_in_row) > k_in_row)
        return jnp.stack([row, col]).astype(jnp.int32)

    def step_env(self, key, state, action, params):
        size = params.grid_size
        action = jnp.clip(jnp.asarray(action, jnp.int32).reshape(()), 0, self.num_actions - 1)
        if self.egocentric:  # a turn of -1 (left), 0 or +1 (right) quarters, clockwise
            turn = action - 1
            action = (state.direction + jnp.where(state.mirrored, -turn, turn)) % 4
        turns_back = ((action + 2) % 4 == state.direction) & (state.length > 1)
        direction = jnp.where(turns_back, state.direction, action)
        new_head = state.head + jnp.array(SNAKE_MOVES, jnp.int32)[direction]
        hits_wall = jnp.any((new_head < 0) | (new_head >= size))
        eats = jnp.all(new_head == state.food)
        entered = _cell_mask(size, new_head)
        # The tail leaves its cell this step unless the snake grows, so that cell may be entered
        # (a cell holding 1 is the tail; food is never on the body).
        inside = jnp.clip(new_head, 0, size - 1)
        hits_self = ~hits_wall & (state.body[inside[0], inside[1]] > 1)
        dies = hits_wall | hits_self
        length = state.length + eats.astype(jnp.int32)
        wins = length == size * size
        moved_body = jnp.where(eats, state.body, jnp.maximum(state.body - 1, 0))
        body = jnp.where(entered, length, moved_body)
        # On a win no cell is free: the food stays where it was eaten, under the head.
        free = (state.body == 0) & ~entered  # equal to body == 0 (an eaten cell held the food)
        food = jnp.where(
            eats & ~wins, self._place_food(key, free, size * size - length), state.food
        )
        # A dying snake does not move: the last frame shows it facing the wall or its body.
        state = SnakeState(
            body=jnp.where(dies, state.body, body),
            head=jnp.where(dies, state.head, new_head),
            direction=direction,
            food=food,
            length=length,
            steps_since_food=jnp.where(eats, 0, state.steps_since_food + 1),
            time=state.time + 1,
            mirrored=state.mirrored,
        )
        reward = eats.astype(jnp.float32) - dies.astype(jnp.float32)
        terminated = dies | wins
        return self.get_obs(state, params), state, reward, terminated, {"won": wins}

    def is_truncated(self, state: SnakeState, params: SnakeParams) -> chex.Array:
        return state.steps_since_food >= params.max_steps_without_food

    def get_obs(self, state: SnakeState, params: SnakeParams | None = None) -> chex.Array:
        """float32[grid, grid, 3]: head one-hot, body / length, food one-hot. Written as one
        elementwise expression over the channel axis (no stack, which costs a transpose)."""
        size = state.body.shape[0]
        channel = jnp.arange(3)
        marked = jnp.where(
            channel == 0, state.head[:, None], state.food[:, None]
        )  # [2, 3]: (row, col) per channel
        rows = jnp.arange(size)[:, None, None]
        cols = jnp.arange(size)[None, :, None]
        one_hot = ((rows == marked[0]) & (cols == marked[1])).astype(jnp.float32)
        recency = state.body[..., None].astype(jnp.float32) / state.length.astype(jnp.float32)
        obs = jnp.where(channel == 1, recency, one_hot)
        if self.egocentric:
            # A quarter turn anticlockwise per quarter the heading is clockwise of up.
            turned = jnp.stack([jnp.rot90(obs, quarters) for quarters in range(4)])[state.direction]
            obs = jnp.where(state.mirrored, turned[:, ::-1], turned)
        return obs

    def observation_space(self, params: SnakeParams) -> Box:
        return Box(0.0, 1.0, (params.grid_size, params.grid_size, 3))

    def action_space(self, params: SnakeParams | None = None) -> Discrete:
        return Discrete(self.num_actions)

    @property
    def num_actions(self) -> int:
        return 3 if self.egocentric else 4

    @property
    def name(self) -> str:
        return "Snake"

    def render(self, state: SnakeState, params: SnakeParams, cell_pixels: int = 16) -> chex.Array:
        """Body shaded from tail to head, head dark, food red, one gridline between cells."""
        size = state.body.shape[0]
        shade = state.body.astype(jnp.float32) / state.length.astype(jnp.float32)
        green = jnp.stack(
            [40 + 40 * (1 - shade), 120 + 100 * (1 - shade), 40 + 40 * (1 - shade)], -1
        )
        cells = jnp.where((state.body > 0)[..., None], green, 235.0)
        cells = jnp.where(
            _cell_mask(size, state.head)[..., None], jnp.array([20.0, 70.0, 20.0]), cells
        )
        food_visible = _cell_mask(size, state.food) & (state.body == 0)
        cells = jnp.where(food_visible[..., None], jnp.array([220.0, 40.0, 40.0]), cells)
        image = jnp.repeat(jnp.repeat(cells, cell_pixels, axis=0), cell_pixels, axis=1)
        pixel = jnp.arange(image.shape[0]) % cell_pixels == 0
        gridlines = pixel[:, None] | pixel[None, :]
        return jnp.where(gridlines[..., None], 200.0, image).astype(jnp.uint8)


# ---------------------------------------------------------------------------------------------
# Brax's tasks (optional: `pip install brax`), behind the same API
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class BraxState:
    brax_state: Any  # brax.envs.State: the physics, obs, reward and done of the last step
    time: chex.Array


@struct.dataclass
class BraxParams:
    max_steps_in_episode: int = 1000  # Brax's own episode length


@functools.cache
def _brax_env(task: str, backend: str) -> Any:
    with contextlib.redirect_stdout(io.StringIO()):  # mjx prints that its optional warp is absent
        from brax import envs as brax_envs  # imported only when a Brax task is made

    with jax.ensure_compile_time_eval():  # concrete arrays, also when first made under a jit
        return brax_envs.get_environment(task, backend=backend)


class Brax(Environment):
    """A Brax task (`envs.make("brax/inverted_double_pendulum")`) with this module's API: the
    1,000-step time limit is a truncation, not a termination, so `step` keeps the last
    observation in `info["final_observation"]` and the critic bootstraps there. Brax's own
    training wrappers end the episode there and drop that observation; here each episode also
    starts from a fresh random state, as in gymnasium, not from the env's first one. Actions are
    in [-1, 1] as Brax's trainers give them. No renderer (Brax draws with MuJoCo, off device).
    `backend`: Brax's physics pipeline, "generalized" (its default), "positional" or "spring"
    (the fastest on a CPU)."""

    def __init__(self, task: str, backend: str = "generalized"):
        self.task = task
        self.brax_env = _brax_env(task, backend)

    @property
    def default_params(self) -> BraxParams:
        return BraxParams()

    def reset_env(self, key, params):
        brax_state = self.brax_env.reset(key)
        return brax_state.obs, BraxState(brax_state, jnp.int32(0))

    def step_env(self, key, state, action, params):
        brax_state = self.brax_env.step(state.brax_state, action)
        terminated = brax_state.done > 0
        state = BraxState(brax_state, state.time + 1)
        return brax_state.obs, state, brax_state.reward, terminated, {}

    def get_obs(self, state: BraxState, params: BraxParams | None = None) -> chex.Array:
        return state.brax_state.obs

    def observation_space(self, params: BraxParams) -> Box:
        # The shape of a reset's observation, traced, not computed (Brax's observation_size is).
        shape = jax.eval_shape(self.brax_env.reset, jax.random.key(0)).obs.shape
        return Box(-jnp.inf, jnp.inf, shape)

    def action_space(self, params: BraxParams | None = None) -> Box:
        return Box(-1.0, 1.0, (self.brax_env.action_size,))

    @property
    def num_actions(self) -> int:
        return self.brax_env.action_size

    @property
    def name(self) -> str:
        return f"brax/{self.task}"


# ---------------------------------------------------------------------------------------------
# episode statistics, and make()
# ---------------------------------------------------------------------------------------------


@struct.dataclass
class EpisodeStatsState:
    env_state: Any
    episode_return: chex.Array  # of the episode in progress
    episode_length: chex.Array


class EpisodeStats(Environment):
    """Wraps an env to report completed episodes: `info["returned_episode"]` is True on the
    step an episode ends, and then `info["episode_return"]` / `info["episode_length"]` hold its
    totals (zeros otherwise, so average them with the mask)."""

    def __init__(self, env: Environment):
        self.env = env

    @property
    def default_params(self) -> Any:
        return self.env.default_params

    def reset(self, key, params=None):
        obs, env_state = self.env.reset(key, params)
        return obs, EpisodeStatsState(env_state, jnp.float32(0.0), jnp.int32(0))

    def step(self, key, state, action, params=None):
        obs, env_state, reward, terminated, truncated, info = self.env.step(
            key, state.env_state, action, params
        )
        done = jnp.logical_or(terminated, truncated)
        episode_return = state.episode_return + reward
        episode_length = state.episode_length + 1
        info = {
            **info,
            "returned_episode": done,
            "episode_return": jnp.where(done, episode_return, 0.0),
            "episode_length": jnp.where(done, episode_length, 0),
        }
        state = EpisodeStatsState(
            env_state,
            jnp.where(done, 0.0, episode_return),
            jnp.where(done, 0, episode_length),
        )
        return obs, state, reward, terminated, truncated, info

    def observation_space(self, params):
        return self.env.observation_space(params)

    def action_space(self, params=None):
        return self.env.action_space(params)

    def render(self, state: EpisodeStatsState, params: Any, *args, **kwargs) -> chex.Array:
        return self.env.render(state.env_state, params, *args, **kwargs)

    @property
    def num_actions(self) -> int:
        return self.env.num_actions

    @property
    def name(self) -> str:
        return self.env.name


REGISTRY: dict[str, type[Environment]] = {
    "CartPole-v1": CartPole,
    "CartPoleContinuous": CartPoleContinuous,
    "CartPoleSwingup": CartPoleSwingup,
    "Pendulum-v1": Pendulum,
    "Snake": Snake,
}


def make(name: str, **kwargs: Any) -> tuple[Environment, Any]:
    """(env, default params) for a registered env id, or "brax/<task>" for one of Brax's
    (`brax.envs.get_environment`'s names; kwargs: `backend`)."""
    if name.startswith("brax/"):
        env = Brax(name.removeprefix("brax/"), **kwargs)
    elif name in REGISTRY:
        env = REGISTRY[name](**kwargs)
    else:
        raise ValueError(f"unknown env {name!r}; choose one of {sorted(REGISTRY)} or brax/<task>")
    return env, env.default_params
