"""Throughput benchmarks. Docs: docs/benchmarks.md

    python benchmark.py envs              # env steps/s of every env, 1 .. 65536 envs
    python benchmark.py envs --quick --num-envs 1 4096
    python benchmark.py train             # each script's env steps/s and updates/s across num-envs
    python benchmark.py seeds             # wall time of 1, 4, 16, 64 vmapped seeds per script
    python benchmark.py solve             # each script's default run: seconds to the solved bar
    python benchmark.py launch            # launch to exit, compilation cache cold and warm
    python benchmark.py versus ../before  # against another checkout: train speed, cold launch
    python benchmark.py sweep             # a --sweep grid in one process vs one process per run
    python benchmark.py distributed       # the same runs in one process vs two (--distributed)
    python benchmark.py all --quick       # envs, train, seeds, solve and launch, short

`envs` steps every env of envs.py with random actions drawn on device and auto-reset on, as a
jitted `lax.scan` over a batch of `num_envs` envs. When gymnax (CartPole-v1, Pendulum-v1) or
jumanji (Snake-v1) is importable, their envs run in the same process under the same protocol,
interleaved with ours, and the table shows the ratio ours / theirs. gymnax and jumanji are
optional: they are not in requirements*.txt.

Results are merged into docs/benchmarks.json: one row per measurement, keyed by
(benchmark, library, env, num_envs, device), so other benchmarks add their own rows; `envs`
also draws docs/benchmark_envs.png.
"""

import argparse
import dataclasses
import datetime
import importlib
import importlib.metadata
import importlib.util
import json
import os
import shlex
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

import envs

RESULTS_PATH = "docs/benchmarks.json"
ENV_NAMES = ["CartPole-v1", "CartPoleContinuous", "CartPoleSwingup", "Pendulum-v1", "Snake"]
GYMNAX_NAMES = {"CartPole-v1", "Pendulum-v1"}  # the gymnax envs ours reproduce exactly
JUMANJI_SNAKE_GRID = 12  # jumanji's Snake-v1 board is 12 x 12; ours runs at that size next to it
JUMANJI_SNAKE_LABEL = f"Snake {JUMANJI_SNAKE_GRID}x{JUMANJI_SNAKE_GRID}"


# ---------------------------------------------------------------------------------------------
# results file and devices
# ---------------------------------------------------------------------------------------------


def device_label() -> str:
    """A short, human name for the device the benchmark ran on."""
    device = jax.devices()[0]
    if device.platform == "cpu":
        return f"{os.cpu_count()}-core CPU"
    return f"{len(jax.devices())}x {device.device_kind}"


def merge_rows(path: str, rows: list[dict], key_fields: tuple[str, ...]) -> None:
    """Write `rows` into the JSON file at `path`, replacing earlier rows with the same key."""
    existing: list[dict] = []
    if os.path.exists(path):
        with open(path) as file:
            existing = json.load(file)["rows"]
    new_keys = {tuple(row.get(field) for field in key_fields) for row in rows}
    kept = [
        row for row in existing if tuple(row.get(field) for field in key_fields) not in new_keys
    ]
    description = "Benchmark rows; see docs/benchmarks.md for the method of each benchmark."
    # One row per line, so that a diff shows which measurements changed.
    text = f'{{"description": {json.dumps(description)}, "rows": [\n'
    text += ",\n".join(json.dumps(row) for row in kept + rows) + "\n]}\n"
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    temporary = path + ".tmp"
    with open(temporary, "w") as file:
        file.write(text)
    os.replace(temporary, path)


def library_version(name: str) -> str:
    return "envs.py" if name == "ours" else importlib.metadata.version(name)


# ---------------------------------------------------------------------------------------------
# env throughput: one protocol for every library
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class VectorEnv:
    """A batch of `num_envs` envs of one library, reduced to what the timing loop needs:
    `init(key) -> carry`; `draw(key, num_steps) -> inputs`, the random inputs of every step
    (uniform actions, and per-env keys where the API takes them) with a leading step axis;
    `step(carry, inputs_of_one_step) -> (carry, rewards)`, one auto-resetting step of every env.
    The carry holds the latest observations, so no observation work is dead code."""

    library: str
    env: str
    num_envs: int
    init: Callable[[jax.Array], Any]
    draw: Callable[[jax.Array, int], Any]
    step: Callable[[Any, Any], tuple[Any, jax.Array]]


def random_actions(key: jax.Array, action_space: Any, shape: tuple[int, ...]) -> jax.Array:
    """Uniform actions of the given batch shape, for envs.py's and gymnax's spaces alike.
    Discrete ones as random bits modulo n (exact for n a power of two, within n / 2^32
    otherwise), which hashes half as much as `jax.random.randint`."""
    if hasattr(action_space, "n"):
        return (jax.random.bits(key, shape) % action_space.n).astype(jnp.int32)
    return jax.random.uniform(
        key, shape + action_space.shape, jnp.float32, action_space.low, action_space.high
    )


def gymnax_style_vector_env(
    library: str, label: str, env: Any, params: Any, num_envs: int
) -> VectorEnv:
    """envs.py and gymnax share the API: reset(key, params), step(key, state, action, params)."""
    action_space = env.action_space(params)
    reset = jax.vmap(env.reset, in_axes=(0, None))
    step = jax.vmap(env.step, in_axes=(0, 0, 0, None))

    def init(key):
        obs, state = reset(jax.random.split(key, num_envs), params)
        return obs, state

    def draw(key, num_steps):
        key_actions, key_envs = jax.random.split(key)
        actions = random_actions(key_actions, action_space, (num_steps, num_envs))
        return actions, jax.random.split(key_envs, (num_steps, num_envs))

    def step_all(carry, inputs):
        _, state = carry
        actions, keys = inputs
        obs, state, reward, _, _, _ = step(keys, state, actions, params)
        return (obs, state), reward

    return VectorEnv(library, label, num_envs, init, draw, step_all)


def ours(name: str, num_envs: int) -> VectorEnv:
    env, params = envs.make(name)
    return gymnax_style_vector_env("ours", name, env, params, num_envs)


def ours_snake_as_jumanji(num_envs: int) -> VectorEnv:
    """Our Snake on jumanji's board size, so that the two do the same work per step."""
    env = envs.Snake()
    params = envs.SnakeParams(grid_size=JUMANJI_SNAKE_GRID)
    return gymnax_style_vector_env("ours", JUMANJI_SNAKE_LABEL, env, params, num_envs)


def gymnax_env(name: str, num_envs: int) -> VectorEnv:
    import gymnax

    env, params = gymnax.make(name)
    return gymnax_style_vector_env("gymnax", name, env, params, num_envs)


def jumanji_snake(num_envs: int) -> VectorEnv:
    """jumanji's Snake-v1 under its own auto-reset wrapper; its envs keep their keys in their
    states, so only the actions are drawn."""
    import jumanji
    from jumanji.wrappers import AutoResetWrapper

    env = AutoResetWrapper(jumanji.make("Snake-v1"))
    assert env.unwrapped.num_rows == env.unwrapped.num_cols == JUMANJI_SNAKE_GRID
    reset, step = jax.vmap(env.reset), jax.vmap(env.step)

    def init(key):
        state, timestep = reset(jax.random.split(key, num_envs))
        return timestep.observation, state

    def draw(key, num_steps):
        return (jax.random.bits(key, (num_steps, num_envs)) % 4).astype(jnp.int32)

    def step_all(carry, actions):
        _, state = carry
        state, timestep = step(state, actions)
        return (timestep.observation, state), timestep.reward

    return VectorEnv("jumanji", JUMANJI_SNAKE_LABEL, num_envs, init, draw, step_all)


def compile_rollout(vector_env: VectorEnv, num_steps: int) -> tuple[Callable, Any, float]:
    """The jitted `num_steps`-step rollout, its first carry, and the compile time in seconds.
    The rollout draws every step's random inputs in one go (on device), scans the steps, and
    returns the final carry and the sum of all rewards, so no step is dead code."""

    def rollout(carry, key):
        def body(loop, step_inputs):
            carry, reward_sum = loop
            carry, rewards = vector_env.step(carry, step_inputs)
            return (carry, reward_sum + jnp.sum(rewards)), None

        inputs = vector_env.draw(key, num_steps)
        (carry, reward_sum), _ = jax.lax.scan(body, (carry, jnp.float32(0.0)), inputs)
        return carry, reward_sum

    key_init, key_run = jax.random.split(jax.random.key(0))
    carry = jax.block_until_ready(jax.jit(vector_env.init)(key_init))
    start = time.perf_counter()
    compiled = jax.jit(rollout, donate_argnums=0).lower(carry, key_run).compile()
    compile_seconds = time.perf_counter() - start
    return compiled, carry, compile_seconds


def steps_per_rollout(num_envs: int, quick: bool) -> int:
    """Scan steps per timed run: ~4M env steps (0.5M with --quick), between 16 and 4096 steps,
    so that even one env runs long enough (a few ms) to time."""
    budget = 2**19 if quick else 2**22
    return max(16, min(budget // num_envs, 512 if quick else 4096))


def time_side_by_side(vector_envs: list[VectorEnv], num_steps: int, repeats: int) -> list[dict]:
    """Compile each, warm up, then time `repeats` rollouts of each, interleaved so that load from
    other processes hits all libraries alike. Reports the median steps/s of each, and for the
    first (ours) its speed ratio to each other, as the median over the repeats of the ratio
    within a repeat (runs seconds apart share the machine's load)."""
    compiled = [compile_rollout(vector_env, num_steps) for vector_env in vector_envs]
    carries = [carry for _, carry, _ in compiled]
    seconds: list[list[float]] = [[] for _ in vector_envs]
    keys = jax.random.split(jax.random.key(1), repeats + 1)
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for index, (rollout, _, _) in enumerate(compiled):
            start = time.perf_counter()
            carries[index], reward_sum = rollout(carries[index], keys[repeat])
            jax.block_until_ready((carries[index], reward_sum))
            if repeat > 0:
                seconds[index].append(time.perf_counter() - start)
    rows = []
    for vector_env, (_, _, compile_seconds), runs in zip(
        vector_envs, compiled, seconds, strict=True
    ):
        env_steps = vector_env.num_envs * num_steps
        row = {
            "library": vector_env.library,
            "env": vector_env.env,
            "num_envs": vector_env.num_envs,
            "steps_per_second": round(env_steps / statistics.median(runs)),
            "steps_per_second_runs": [round(env_steps / run) for run in runs],
            "compile_seconds": round(compile_seconds, 3),
            "num_steps": num_steps,
        }
        rows.append(row)
    for reference, reference_runs in zip(rows[1:], seconds[1:], strict=True):
        paired = [theirs / ours for ours, theirs in zip(seconds[0], reference_runs, strict=True)]
        rows[0]["reference"] = reference["library"]
        rows[0]["ratio_to_reference"] = round(statistics.median(paired), 3)
        rows[0]["ratio_runs"] = [round(ratio, 3) for ratio in paired]
    return rows


def env_groups(names: list[str], num_envs: int, with_references: bool) -> list[list[VectorEnv]]:
    """Groups timed together: each env of ours alone or next to the reference library's version
    when that is importable (Snake: ours on jumanji's board size as well)."""
    has_gymnax = with_references and importlib.util.find_spec("gymnax") is not None
    has_jumanji = with_references and importlib.util.find_spec("jumanji") is not None
    groups = []
    for name in names:
        if name in GYMNAX_NAMES and has_gymnax:
            groups.append([ours(name, num_envs), gymnax_env(name, num_envs)])
        else:
            groups.append([ours(name, num_envs)])
        if name == "Snake" and has_jumanji:
            groups.append([ours_snake_as_jumanji(num_envs), jumanji_snake(num_envs)])
    return groups


def env_table(rows: list[dict]) -> str:
    """Ours next to the reference, one line per env and size."""
    by_key = {(row["library"], row["env"], row["num_envs"]): row for row in rows}
    lines = [
        f"{'env':<20}{'num_envs':>9}{'ours steps/s':>15}{'reference':>10}{'ref steps/s':>15}"
        f"{'ours/ref':>9}"
    ]
    for row in rows:
        if row["library"] != "ours":
            continue
        reference = by_key.get((row.get("reference"), row["env"], row["num_envs"]))
        line = f"{row['env']:<20}{row['num_envs']:>9}{row['steps_per_second']:>15,}"
        if reference is not None:
            line += f"{reference['library']:>10}{reference['steps_per_second']:>15,}"
            line += f"{row['ratio_to_reference']:>9.2f}"
        lines.append(line)
    return "\n".join(lines)


def plot_env_rows(rows: list[dict], path: str, device: str) -> None:
    """Steps per second against the number of envs: one colour per env, ours solid, the
    reference library's dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    env_names = sorted({row["env"] for row in rows})
    for library, env in sorted(
        {(row["library"], row["env"]) for row in rows}, key=lambda pair: (pair[1], pair[0])
    ):
        points = sorted(
            (row["num_envs"], row["steps_per_second"])
            for row in rows
            if (row["library"], row["env"]) == (library, env)
        )
        style = "-o" if library == "ours" else "--s"
        color = f"C{env_names.index(env) % 10}"
        axes.plot(*zip(*points, strict=True), style, color=color, label=f"{env} ({library})")
    axes.set(
        xscale="log",
        yscale="log",
        xlabel="parallel envs",
        ylabel="env steps per second",
        title=f"env throughput, {device}",
    )
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=7)
    figure.tight_layout()
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)


def add_envs_arguments(parser: argparse.ArgumentParser) -> None:
    gpu = jax.devices()[0].platform != "cpu"
    parser.add_argument(
        "--num-envs",
        type=int,
        nargs="+",
        default=[1, 256, 4096, 65536] + ([2**20] if gpu else []),
        help="batch sizes to measure (default 1 256 4096 65536, and 2^20 on a GPU)",
    )
    parser.add_argument(
        "--envs", nargs="+", default=ENV_NAMES, choices=ENV_NAMES, help="which envs (default: all)"
    )
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per measurement; the median is reported"
    )
    parser.add_argument("--quick", action="store_true", help="8x fewer env steps per timed run")
    parser.add_argument(
        "--no-reference", action="store_true", help="skip gymnax and jumanji even when importable"
    )


def run_envs(args: argparse.Namespace) -> list[dict]:
    if args.repeats < 1 or min(args.num_envs) < 1:
        raise SystemExit("--repeats and every --num-envs must be >= 1")
    device = device_label()
    print(f"env steps per second on {device}, jax {jax.__version__}, median of {args.repeats} runs")
    rows = []
    for num_envs in args.num_envs:
        num_steps = steps_per_rollout(num_envs, args.quick)
        for group in env_groups(args.envs, num_envs, not args.no_reference):
            measured = time_side_by_side(group, num_steps, args.repeats)
            for row in measured:
                ratio = (
                    f", {row['ratio_to_reference']:.2f}x {row['reference']}"
                    if "reference" in row
                    else ""
                )
                print(
                    f"  {row['library']:>8} {row['env']:<20}{num_envs:>8} envs: "
                    f"{row['steps_per_second']:>14,} steps/s"
                    f" (compile {row['compile_seconds']:.2f} s{ratio})",
                    flush=True,
                )
            rows += measured
    print("\n" + env_table(rows))
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for row in rows:
        row.update(
            benchmark="env_steps",
            repeats=args.repeats,
            device=device,
            jax_version=jax.__version__,
            library_version=library_version(row["library"]),
            date=date,
        )
    if not args.no_save:
        plot_path = os.path.join(os.path.dirname(args.output) or ".", "benchmark_envs.png")
        plot_env_rows(rows, plot_path, device)
        print(f"wrote {plot_path}")
    return rows


# ---------------------------------------------------------------------------------------------
# training throughput, seed scaling and time to solve: the scripts' own make_train and CLI
# ---------------------------------------------------------------------------------------------

SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
SCRIPT_FLAGS = ["--no-capture-gif", "--no-plot", "--no-save-model"]


@dataclass(frozen=True)
class ChunkRunner:
    """A script's jitted, vmapped run_chunk with its first state, called as the script's CLI
    calls it (state donated), after the warm-up chunks (the chunks before the first gradient
    update, then one more). `steps` env steps and `updates` gradient updates per chunk and
    seed, read from the chunks' own metrics."""

    run: Callable[[Any, int], tuple[Any, Any]]
    state: Any
    first_chunk: int
    steps: int
    updates: int
    compile_seconds: float


def chunk_runner(script: str, num_envs: int, steps_per_env: int, num_seeds: int) -> ChunkRunner:
    """Build `script`'s make_train on its default config with `num_envs` envs per seed and
    chunks of `steps_per_env` steps of every env (whole iterations: rounded down, at least one),
    through the names every script has: Config, validate, chunk_sizes, make_train."""
    module = importlib.import_module(script)
    config = dataclasses.replace(
        module.Config(),
        num_envs=num_envs,
        num_seeds=num_seeds,
        log_every=num_envs * steps_per_env,
        total_timesteps=num_envs * steps_per_env * 1000,  # far more chunks than are timed
    )
    module.validate(config)  # a size the script itself would refuse is a usage error here too
    init, run_chunk, _ = module.make_train(config)
    keys = jax.vmap(jax.random.key)(jnp.arange(num_seeds))
    state = jax.block_until_ready(jax.jit(jax.vmap(init))(keys))
    start = time.perf_counter()
    chunk_function = jax.jit(jax.vmap(run_chunk, in_axes=(0, None)), donate_argnums=0)
    compiled = chunk_function.lower(state, jnp.int32(0)).compile()
    compile_seconds = time.perf_counter() - start

    def run(state: Any, chunk: int) -> tuple[Any, Any]:
        return compiled(state, jnp.int32(chunk))

    # Warm-up: the chunks until the first gradient update (SAC's random-action phase), then one.
    chunk = 0
    updates = 0
    while updates == 0:
        state, metrics = run(state, chunk)
        updates = int(jax.device_get(metrics.updates)[0])
        chunk += 1
    state, metrics = run(state, chunk)
    metrics = jax.device_get(metrics)
    steps_per_chunk = int(metrics.env_steps[0]) // (chunk + 1)
    updates_per_chunk = int(metrics.updates[0]) - updates
    return ChunkRunner(run, state, chunk + 1, steps_per_chunk, updates_per_chunk, compile_seconds)


def time_chunks(runner: ChunkRunner, repeats: int) -> list[float]:
    """Seconds of each of `repeats` chunks after the warm-up. The state a chunk returns is the
    next chunk's input and its metrics are fetched, so XLA can drop none of the work."""
    state = runner.state
    seconds = []
    for chunk in range(runner.first_chunk, runner.first_chunk + repeats):
        start = time.perf_counter()
        state, metrics = runner.run(state, chunk)
        jax.block_until_ready((state, jax.device_get(metrics)))
        seconds.append(time.perf_counter() - start)
    return seconds


def train_sizes(script: str, quick: bool, gpu: bool) -> list[int]:
    if script.startswith("sac"):
        return [16, 64, 256, 1024, 4096] if gpu else [16, 256] if quick else [16, 64, 256, 1024]
    if gpu:
        return [4, 64, 1024, 16384, 65536]
    return [4, 64] if quick else [4, 16, 64, 256, 1024]


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scripts",
        nargs="+",
        default=SCRIPTS,
        choices=SCRIPTS,
        help="which scripts (default: all)",
    )
    parser.add_argument(
        "--num-envs",
        type=int,
        nargs="+",
        help="envs per seed (default: per script and device; GPU: SAC 16 .. 4096, PPO 4 .. 65536)",
    )
    parser.add_argument("--steps-per-env", type=int, default=None, help=STEPS_PER_ENV_HELP)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed chunks per measurement; the median is reported",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer sizes, shorter chunks, 3 repeats"
    )


# Steps of every env in a timed chunk, (default, --quick), about a second of CPU work each:
# 64 SAC iterations, 8 PPO rollouts of 64 steps, 4 ppo_snake rollouts of 128 (a board-sized
# network costs ~20x a CartPole one).
STEPS_PER_ENV = {
    "sac_pendulum": (64, 16),
    "sac_cartpole": (64, 16),
    "ppo_cartpole": (512, 128),
    "ppo_snake": (512, 128),
}
STEPS_PER_ENV_HELP = "steps of every env per timed chunk, rounded down to whole iterations "
STEPS_PER_ENV_HELP += f"(default, with --quick: {STEPS_PER_ENV})"


def steps_per_env_for(script: str, args: argparse.Namespace) -> int:
    if args.steps_per_env is not None:
        return args.steps_per_env
    default, quick = STEPS_PER_ENV[script]
    return quick if args.quick else default


def repeats_for(args: argparse.Namespace) -> int:
    return min(args.repeats, 3) if args.quick else args.repeats


def run_train(args: argparse.Namespace) -> list[dict]:
    repeats, gpu = repeats_for(args), jax.devices()[0].platform != "cpu"
    print(
        f"training throughput on {device_label()}, jax {jax.__version__}, "
        f"median of {repeats} chunks, 1 seed"
    )
    rows = []
    for script in args.scripts:
        steps_per_env = steps_per_env_for(script, args)
        for num_envs in args.num_envs or train_sizes(script, args.quick, gpu):
            runner = chunk_runner(script, num_envs, steps_per_env, num_seeds=1)
            seconds = time_chunks(runner, repeats)
            median = statistics.median(seconds)
            row = dict(
                benchmark="train_throughput",
                library=script,
                env=script,
                num_envs=num_envs,
                steps_per_second=round(runner.steps / median),
                updates_per_second=round(runner.updates / median),
                steps_per_second_runs=[round(runner.steps / run) for run in seconds],
                compile_seconds=round(runner.compile_seconds, 3),
                chunk_steps=runner.steps,
                chunk_updates=runner.updates,
                num_seeds=1,
                repeats=repeats,
            )
            print(
                f"  {script:<13}{num_envs:>7} envs: {row['steps_per_second']:>12,} env steps/s "
                f"{row['updates_per_second']:>9,} updates/s "
                f"(compile {runner.compile_seconds:.1f} s)",
                flush=True,
            )
            rows.append(row)
    plot_script_rows(
        rows,
        "num_envs",
        "steps_per_second",
        "envs per seed",
        "env steps per second (1 seed)",
        "training throughput",
        args,
        "benchmark_train.png",
    )
    return stamp(rows)


SEEDS_HELP = (
    "vmapped seed counts (default 1 4 16 64; --quick 1 4 16; ppo_snake on CPU: one count fewer)"
)


def add_seeds_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scripts",
        nargs="+",
        default=SCRIPTS,
        choices=SCRIPTS,
        help="which scripts (default: all)",
    )
    parser.add_argument("--seeds", type=int, nargs="+", help=SEEDS_HELP)
    parser.add_argument("--steps-per-env", type=int, default=None, help=STEPS_PER_ENV_HELP)
    parser.add_argument(
        "--repeats",
        type=int,
        default=5,
        help="timed chunks per measurement; the median is reported",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer seed counts, shorter chunks, 3 repeats"
    )


def seed_counts(script: str, args: argparse.Namespace, gpu: bool) -> list[int]:
    if args.seeds:
        return args.seeds
    counts = [1, 4, 16] if args.quick else [1, 4, 16, 64]
    # ppo_snake's CPU chunk at 16 seeds is minutes long: on a CPU its counts stop one earlier.
    return counts[:-1] if script == "ppo_snake" and not gpu else counts


def run_seeds(args: argparse.Namespace) -> list[dict]:
    repeats, gpu = repeats_for(args), jax.devices()[0].platform != "cpu"
    print(
        f"seed scaling on {device_label()}, jax {jax.__version__}, "
        f"median of {repeats} chunks, default num_envs"
    )
    rows = []
    for script in args.scripts:
        steps_per_env = steps_per_env_for(script, args)
        one_seed = None
        for num_seeds in seed_counts(script, args, gpu):
            num_envs = (
                importlib.import_module(script).Config().num_envs
            )  # the script's default, per seed
            runner = chunk_runner(script, num_envs, steps_per_env, num_seeds)
            median = statistics.median(time_chunks(runner, repeats))
            one_seed = one_seed or (median if num_seeds == 1 else None)
            row = dict(
                benchmark="seed_scaling",
                library=script,
                env=script,
                num_envs=num_envs,
                num_seeds=num_seeds,
                chunk_seconds=round(median, 5),
                ratio_to_one_seed=round(median / one_seed, 3) if one_seed else None,
                steps_per_second=round(runner.steps * num_seeds / median),
                compile_seconds=round(runner.compile_seconds, 3),
                chunk_steps=runner.steps,
                repeats=repeats,
            )
            ratio = f"{row['ratio_to_one_seed']:.2f}x" if one_seed else "-"
            print(
                f"  {script:<13}{num_seeds:>4} seeds: {median * 1e3:>9.1f} ms per chunk, "
                f"{ratio} of 1 seed, {row['steps_per_second']:,} env steps/s in all "
                f"(compile {runner.compile_seconds:.1f} s)",
                flush=True,
            )
            rows.append(row)
    plot_script_rows(
        rows,
        "num_seeds",
        "ratio_to_one_seed",
        "vmapped seeds",
        "wall time per chunk / 1 seed's",
        "seed scaling (flat = free seeds)",
        args,
        "benchmark_seeds.png",
    )
    return stamp(rows)


def first_crossing_seconds(metrics_csv: str, bar: float) -> float | None:
    """Wall seconds (compile excluded) at the first chunk whose mean training-episode return
    reached `bar`, from the script's metrics.csv (first seed); None if none did."""
    with open(metrics_csv) as file:
        header, *lines = [line.strip().split(",") for line in file if line.strip()]
    for values in lines:
        row = dict(zip(header, values, strict=True))
        if float(row["episode_return"]) >= bar:  # "nan" (no episode ended) compares False
            return float(row["wall_seconds"])
    return None


def add_solve_command_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--quick", action="store_true", help="one run per script, ppo_snake left out"
    )
    add_solve_arguments(parser)


def add_solve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--solve-scripts",
        nargs="+",
        default=SCRIPTS,
        choices=SCRIPTS,
        help="scripts to run with their defaults (ppo_snake only without --quick)",
    )
    parser.add_argument(
        "--solve-runs", type=int, default=3, help="default runs per script (1 with --quick)"
    )
    parser.add_argument(
        "--solve-flags",
        type=shlex.split,
        default=[],
        help="extra flags for every script, e.g. --solve-flags='--total-timesteps 4096' (smoke)",
    )


def run_solve(args: argparse.Namespace) -> list[dict]:
    """Each script's CLI with its default flags in a fresh process (so compile and JAX start-up
    are what a user sees); its summary.json and metrics.csv give the figures."""
    import subprocess
    import sys
    import tempfile

    runs = 1 if args.quick else args.solve_runs
    scripts = [s for s in args.solve_scripts if not (args.quick and s == "ppo_snake")]
    print(
        f"time to solve on {device_label()}, jax {jax.__version__}, median of {runs} default run(s)"
    )
    rows = []
    for script in scripts:
        results = []
        for run in range(runs):
            with tempfile.TemporaryDirectory() as out:
                seed = (
                    importlib.import_module(script).Config().seed + run
                )  # the first run is the default one
                command = [
                    sys.executable,
                    f"{script}.py",
                    *SCRIPT_FLAGS,
                    "--output-dir",
                    out,
                    "--seed",
                    str(seed),
                    *args.solve_flags,
                ]
                start = time.perf_counter()
                subprocess.run(
                    command,
                    check=True,
                    capture_output=True,
                    text=True,
                    cwd=os.path.dirname(os.path.abspath(__file__)),
                )
                process_seconds = time.perf_counter() - start
                with open(os.path.join(out, "summary.json")) as file:
                    summary = json.load(file)
                bar = importlib.import_module(script).SOLVED_RETURN  # the script's own bar
                crossing = first_crossing_seconds(os.path.join(out, "metrics.csv"), bar)
                results.append((summary, process_seconds, crossing))
        summaries = [summary for summary, _, _ in results]
        crossings = [c for _, _, c in results if c is not None]
        row = dict(
            benchmark="time_to_solve",
            library=script,
            env=script,
            num_envs=summaries[0]["num_envs"],
            num_seeds=1,
            runs=runs,
            solved_bar=bar,
            train_seconds=round(statistics.median(s["train_seconds"] for s in summaries), 2),
            compile_seconds=round(statistics.median(s["compile_seconds"] for s in summaries), 2),
            process_seconds=round(statistics.median(p for _, p, _ in results), 2),
            env_steps=summaries[0]["env_steps"],
            final_returns=[round(s["final_return_mean"], 2) for s in summaries],
            first_crossing_seconds=round(statistics.median(crossings), 2) if crossings else None,
            extra_flags=args.solve_flags,
        )
        row["solved_runs"] = sum(s["final_return_mean"] >= bar for s in summaries)
        for name in summaries[0]:  # the script's other evaluation figures (Snake: score, win)
            if name.startswith("final_") and name.endswith("_mean") and name != "final_return_mean":
                row[name.removesuffix("_mean") + "s"] = [round(s[name], 3) for s in summaries]
        outcome = f"{row['solved_runs']}/{runs} solved (bar {bar:g})"
        print(
            f"  {script:<13} train {row['train_seconds']:.1f} s + "
            f"compile {row['compile_seconds']:.1f} s, "
            f"first training return past the bar at {row['first_crossing_seconds']} s, final eval "
            f"{row['final_returns']}: {outcome}",
            flush=True,
        )
        rows.append(row)
    return stamp(rows)


# ppo_snake's default run takes minutes on a CPU: measured when named, not by default.
LAUNCH_SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole"]


def add_launch_command_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="one cold and one warm run a script")
    add_launch_arguments(parser)


def add_launch_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launch-scripts",
        nargs="+",
        default=LAUNCH_SCRIPTS,
        choices=SCRIPTS,
        help=f"scripts whose default run is timed (default {' '.join(LAUNCH_SCRIPTS)})",
    )
    parser.add_argument(
        "--launch-runs", type=int, default=3, help="cold and warm runs per script (1 with --quick)"
    )
    parser.add_argument(
        "--launch-flags",
        type=shlex.split,
        default=[],
        help="extra flags for every run, e.g. --launch-flags='--total-timesteps 4096' (smoke)",
    )


def timed_default_run(
    script: str,
    cache_dir: str,
    flags: list[str],
    processes: int = 1,
    environment: dict[str, str] | None = None,
) -> tuple[float, dict]:
    """(seconds from launch to exit, summary.json) of `python script.py` in a fresh process, with
    every output it writes by default, and JAX's compilation cache in `cache_dir`. With
    `processes` > 1, that many processes on this machine run it --distributed (127.0.0.1), and
    the seconds last until the last one exits."""
    import socket
    import subprocess
    import sys
    import tempfile

    with tempfile.TemporaryDirectory() as out:
        commands = [[sys.executable, f"{script}.py", "--output-dir", out, *flags]]
        if processes > 1:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                address = f"127.0.0.1:{probe.getsockname()[1]}"
            cluster = ["--distributed", "--coordinator-address", address]
            cluster += ["--num-processes", str(processes)]
            commands = [
                [*commands[0], *cluster, "--process-id", str(index)] for index in range(processes)
            ]
        environment = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, **(environment or {})}
        errors = [tempfile.TemporaryFile() for _ in commands]  # files: a full pipe would block
        start = time.perf_counter()
        running = [
            subprocess.Popen(
                command,
                stdout=subprocess.DEVNULL,
                stderr=error,
                env=environment,
                cwd=os.path.dirname(os.path.abspath(__file__)),
            )
            for command, error in zip(commands, errors, strict=True)
        ]
        for process, error in zip(running, errors, strict=True):
            if process.wait() != 0:
                error.seek(0)
                raise RuntimeError(f"{process.args} failed:\n{error.read().decode()}")
        seconds = time.perf_counter() - start
        for error in errors:
            error.close()
        with open(os.path.join(out, "summary.json")) as file:
            return seconds, json.load(file)


def run_launch(args: argparse.Namespace) -> list[dict]:
    """Launch to exit of each script's default run with a cold compilation cache (an empty
    directory) and a warm one (filled by one earlier run of the same command), interleaved."""
    import tempfile

    runs = 1 if args.quick else args.launch_runs
    print(f"launch to exit on {device_label()}, jax {jax.__version__}, median of {runs} run(s)")
    rows = []
    for script in args.launch_scripts:
        cold = []
        warm = []
        with tempfile.TemporaryDirectory() as warm_cache:
            timed_default_run(script, warm_cache, args.launch_flags)  # fills the warm cache
            for _ in range(runs):
                with tempfile.TemporaryDirectory() as cold_cache:
                    cold.append(timed_default_run(script, cold_cache, args.launch_flags))
                warm.append(timed_default_run(script, warm_cache, args.launch_flags))
        cold_seconds = statistics.median(seconds for seconds, _ in cold)
        warm_seconds = statistics.median(seconds for seconds, _ in warm)
        row = dict(
            benchmark="launch",
            library=script,
            env=script,
            num_envs=cold[0][1]["num_envs"],
            num_seeds=1,
            runs=runs,
            cold_seconds=round(cold_seconds, 2),
            warm_seconds=round(warm_seconds, 2),
            cold_to_warm=round(cold_seconds / warm_seconds, 2),
            cold_runs=[round(seconds, 2) for seconds, _ in cold],
            warm_runs=[round(seconds, 2) for seconds, _ in warm],
            cold_compile_seconds=round(statistics.median(s["compile_seconds"] for _, s in cold), 2),
            warm_compile_seconds=round(statistics.median(s["compile_seconds"] for _, s in warm), 2),
            final_returns=[round(s["final_return_mean"], 2) for _, s in cold + warm],
            extra_flags=args.launch_flags,
        )
        print(
            f"  {script:<13} cold {cold_seconds:.1f} s "
            f"(compile {row['cold_compile_seconds']:.1f} s), "
            f"warm {warm_seconds:.1f} s (compile {row['warm_compile_seconds']:.1f} s): "
            f"{row['cold_to_warm']:.2f}x",
            flush=True,
        )
        rows.append(row)
    return stamp(rows)


def add_versus_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "baseline", help="another checkout, e.g. a `git worktree` of an earlier commit"
    )
    parser.add_argument(
        "--scripts", nargs="+", default=LAUNCH_SCRIPTS, choices=SCRIPTS, help="scripts to compare"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds; medians reported"
    )


def run_versus(args: argparse.Namespace) -> list[dict]:
    """This checkout against `baseline`, side by side in one run, round after round (baseline,
    then this): each tree's own `benchmark.py train` at --quick's sizes with default chunks (env
    steps/s), and each script's default run launched cold (an empty compilation cache) to exit."""
    import subprocess
    import sys
    import tempfile

    gpu = jax.devices()[0].platform != "cpu"
    trees = {"baseline": os.path.abspath(args.baseline), "this": os.path.dirname(__file__) or "."}
    trees["this"] = os.path.abspath(trees["this"])
    train = {name: [] for name in trees}
    launch = {(name, script): [] for name in trees for script in args.scripts}
    for _ in range(args.rounds):
        for name, tree in trees.items():
            # Each script at --quick's sizes, with the default (longer) chunks: a --quick chunk
            # of SAC at 16 envs lasts ~6 ms, and its fixed costs dominate the median of 3.
            rows_of_round = []
            for script in args.scripts:
                with tempfile.TemporaryDirectory() as out:
                    output = os.path.join(out, "rows.json")
                    sizes = [str(size) for size in train_sizes(script, quick=True, gpu=gpu)]
                    command = [sys.executable, "benchmark.py", "--output", output, "train"]
                    command += ["--scripts", script, "--num-envs", *sizes, "--repeats", "5"]
                    subprocess.run(command, check=True, capture_output=True, cwd=tree)
                    with open(output) as file:
                        rows_of_round += json.load(file)["rows"]
            train[name].append(rows_of_round)
            for script in args.scripts:
                with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as out:
                    command = [sys.executable, f"{script}.py", "--output-dir", out]
                    environment = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache}
                    start = time.perf_counter()
                    subprocess.run(
                        command, check=True, capture_output=True, env=environment, cwd=tree
                    )
                    launch[name, script].append(time.perf_counter() - start)
    rows = []
    print(f"{trees['this']} against {trees['baseline']} on {device_label()}, {args.rounds} rounds")
    for baseline_row in train["baseline"][0]:
        key = (baseline_row["library"], baseline_row["num_envs"])
        speeds = {
            name: statistics.median(
                row["steps_per_second"]
                for rows_of_round in train[name]
                for row in rows_of_round
                if (row["library"], row["num_envs"]) == key
            )
            for name in trees
        }
        rows.append(
            dict(
                benchmark="versus_train",
                library=key[0],
                env=key[0],
                num_envs=key[1],
                num_seeds=1,
                baseline_steps_per_second=round(speeds["baseline"]),
                steps_per_second=round(speeds["this"]),
                ratio_to_baseline=round(speeds["this"] / speeds["baseline"], 3),
                rounds=args.rounds,
            )
        )
    for script in args.scripts:
        seconds = {name: statistics.median(launch[name, script]) for name in trees}
        rows.append(
            dict(
                benchmark="versus_cold_launch",
                library=script,
                env=script,
                num_envs=None,
                num_seeds=1,
                baseline_seconds=round(seconds["baseline"], 2),
                seconds=round(seconds["this"], 2),
                ratio_to_baseline=round(seconds["this"] / seconds["baseline"], 3),
                baseline_runs=[round(value, 2) for value in launch["baseline", script]],
                runs=[round(value, 2) for value in launch["this", script]],
            )
        )
    for row in rows:
        measure = (
            f"{row['baseline_steps_per_second']:,} -> {row['steps_per_second']:,} env steps/s "
            f"at {row['num_envs']} envs"
            if row["benchmark"] == "versus_train"
            else f"cold launch to exit {row['baseline_seconds']} -> {row['seconds']} s"
        )
        print(f"  {row['library']:<13} {measure}: {row['ratio_to_baseline']:.2f}x", flush=True)
    return stamp(rows)


def add_sweep_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--script", default="sac_pendulum", choices=SCRIPTS, help="script to sweep")
    parser.add_argument(
        "--sweep",
        nargs="+",
        default=["learning-rate=1e-3,3e-3", "tau=0.02,0.05"],
        help="the grid, as the script's --sweep takes it",
    )
    parser.add_argument("--num-seeds", type=int, default=2, help="seeds per grid point")
    parser.add_argument(
        "--sweep-flags",
        type=shlex.split,
        default=[],
        help="extra flags for every run, e.g. --sweep-flags='--total-timesteps 8000'",
    )


def run_sweep(args: argparse.Namespace) -> list[dict]:
    """Wall time of a grid x seeds as one process (`--sweep`, one vmapped program) against the
    same runs as one process each, one after another (what a launcher looping over the grid
    does). Each side starts from an empty compilation cache (the single runs share theirs, so
    from the second run on they load the program instead of compiling it). The final returns of
    both are recorded side by side."""
    import itertools
    import tempfile

    quiet = ["--no-capture-gif", "--no-plot", "--no-save-model", *args.sweep_flags]
    with tempfile.TemporaryDirectory() as cache:
        sweep_flags = ["--sweep", *args.sweep, "--num-seeds", str(args.num_seeds), *quiet]
        sweep_seconds, summary = timed_default_run(args.script, cache, sweep_flags)
    seed = importlib.import_module(args.script).Config().seed
    names_and_values = [entry.split("=") for entry in args.sweep]
    grid = itertools.product(*[values.split(",") for _, values in names_and_values])
    single_seconds, single_returns = 0.0, []
    with tempfile.TemporaryDirectory() as cache:
        for point in grid:
            point_flags = []
            for (name, _), value in zip(names_and_values, point, strict=True):
                point_flags += [f"--{name}", value]
            for index in range(args.num_seeds):
                flags = [*point_flags, "--seed", str(seed + index), *quiet]
                seconds, single = timed_default_run(args.script, cache, flags)
                single_seconds += seconds
                single_returns += single["final_returns"]
    runs = len(single_returns)
    # Equal programs up to the last bits; over thousands of updates RL amplifies those bits, as it
    # does for a seed of --num-seeds against its solo run, so the returns are recorded, not
    # compared (tests/test_sweeps.py checks the equality on a short run).
    differences = [
        abs(a - b) for a, b in zip(summary["final_returns"], single_returns, strict=True)
    ]
    row = dict(
        benchmark="sweep",
        library=args.script,
        env=args.script,
        num_envs=summary["num_envs"],
        num_seeds=runs,
        sweep=args.sweep,
        seeds_per_point=args.num_seeds,
        extra_flags=args.sweep_flags,
        sweep_seconds=round(sweep_seconds, 2),
        single_runs_seconds=round(single_seconds, 2),
        speedup=round(single_seconds / sweep_seconds, 2),
        sweep_compile_seconds=round(summary["compile_seconds"], 2),
        sweep_train_seconds=round(summary["train_seconds"], 2),
        sweep_final_returns=[round(value, 2) for value in summary["final_returns"]],
        single_final_returns=[round(value, 2) for value in single_returns],
        median_return_difference=round(statistics.median(differences), 3),
    )
    print(
        f"{args.script}: {runs} runs (--sweep {' '.join(args.sweep)} x {args.num_seeds} "
        f"seed(s)) on {device_label()}: one process {sweep_seconds:.1f} s, {runs} processes one "
        f"after another {single_seconds:.1f} s: {row['speedup']:.1f}x; final returns: median "
        f"difference {row['median_return_difference']:g}"
    )
    return stamp([row])


def add_distributed_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--scripts", nargs="+", default=["sac_pendulum", "ppo_cartpole"], choices=SCRIPTS
    )
    parser.add_argument("--num-seeds", type=int, default=8, help="runs, the same on both sides")
    parser.add_argument("--processes", type=int, default=2, help="processes of the distributed run")
    parser.add_argument(
        "--devices-per-process", type=int, default=1, help="CPU devices of each process"
    )
    parser.add_argument("--repeats", type=int, default=3, help="runs per side (median reported)")
    parser.add_argument(
        "--run-flags",
        type=shlex.split,
        default=[],
        help="extra flags for every run, e.g. --run-flags='--total-timesteps 8000'",
    )


def run_distributed(args: argparse.Namespace) -> list[dict]:
    """Launch to exit of the same runs (--num-seeds) as one process with every CPU device, and as
    --processes processes on this machine (--distributed over 127.0.0.1) with the devices split
    between them, interleaved, each from an empty compilation cache. On CPU only: a CPU device
    count is what XLA can split; several GPU processes need a GPU each."""
    import tempfile

    if args.processes < 2:
        raise SystemExit("benchmark.py distributed: --processes must be >= 2")
    devices = args.processes * args.devices_per_process
    quiet = ["--no-capture-gif", "--no-plot", "--no-save-model", "--num-seeds", str(args.num_seeds)]
    rows = []
    for script in args.scripts:
        sides: dict[int, list[tuple[float, dict]]] = {1: [], args.processes: []}
        for _ in range(args.repeats):
            for processes in sides:
                flags = f"--xla_force_host_platform_device_count={devices // processes}"
                environment = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": flags}
                with tempfile.TemporaryDirectory() as cache:
                    sides[processes].append(
                        timed_default_run(
                            script, cache, [*quiet, *args.run_flags], processes, environment
                        )
                    )
        one, many = (
            {
                "seconds": statistics.median(seconds for seconds, _ in runs),
                "compile": statistics.median(summary["compile_seconds"] for _, summary in runs),
                "train": statistics.median(summary["train_seconds"] for _, summary in runs),
                "returns": runs[0][1]["final_returns"],
            }
            for runs in sides.values()
        )
        differences = [abs(a - b) for a, b in zip(one["returns"], many["returns"], strict=True)]
        row = dict(
            benchmark="distributed",
            library=script,
            env=script,
            num_envs=sides[1][0][1]["num_envs"],
            num_seeds=args.num_seeds,
            processes=args.processes,
            devices=devices,
            repeats=args.repeats,
            extra_flags=args.run_flags,
            one_process_seconds=round(one["seconds"], 2),
            distributed_seconds=round(many["seconds"], 2),
            ratio=round(many["seconds"] / one["seconds"], 3),
            one_process_compile_seconds=round(one["compile"], 2),
            distributed_compile_seconds=round(many["compile"], 2),
            one_process_train_seconds=round(one["train"], 2),
            distributed_train_seconds=round(many["train"], 2),
            median_return_difference=round(statistics.median(differences), 3),
        )
        rows.append(row)
        print(
            f"{script}: {args.num_seeds} runs on {devices} CPU devices, median of {args.repeats}: "
            f"one process {one['seconds']:.1f} s (compile {one['compile']:.1f}, train "
            f"{one['train']:.1f}), {args.processes} processes {many['seconds']:.1f} s (compile "
            f"{many['compile']:.1f}, train {many['train']:.1f}): {row['ratio']:.2f}x; final "
            f"returns: median difference {row['median_return_difference']:g}",
            flush=True,
        )
    return stamp(rows)


def stamp(rows: list[dict]) -> list[dict]:
    """Device, JAX version and date on every row."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for row in rows:
        row.update(device=device_label(), jax_version=jax.__version__, date=date)
    return rows


def plot_script_rows(
    rows: list[dict],
    x: str,
    y: str,
    xlabel: str,
    ylabel: str,
    title: str,
    args: argparse.Namespace,
    filename: str,
) -> None:
    """One line per script of `y` against `x`, next to the JSON file (skipped with --no-save). The
    other scripts' rows of this benchmark and device come from the JSON, so that measuring some
    scripts again keeps the rest of the plot."""
    if args.no_save or not rows:
        return
    if os.path.exists(args.output):
        with open(args.output) as file:
            measured = {row["library"] for row in rows}
            rows = [
                row
                for row in json.load(file)["rows"]
                if row["benchmark"] == rows[0]["benchmark"]
                and row.get("device") == device_label()
                and row["library"] not in measured
            ] + rows
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    for script in [script for script in SCRIPTS if any(row["library"] == script for row in rows)]:
        points = sorted(
            (row[x], row[y]) for row in rows if row["library"] == script and row[y] is not None
        )
        axes.plot(*zip(*points, strict=True), "-o", label=script)
    axes.set(
        xscale="log", yscale="log", xlabel=xlabel, ylabel=ylabel, title=f"{title}, {device_label()}"
    )
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=8)
    figure.tight_layout()
    path = os.path.join(os.path.dirname(args.output) or ".", filename)
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    print(f"wrote {path}")


def add_all_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="the short version of every benchmark")
    parser.add_argument(
        "--repeats", type=int, default=5, help="timed runs per measurement; the median is reported"
    )
    parser.add_argument(
        "--scripts", nargs="+", default=SCRIPTS, choices=SCRIPTS, help="scripts for train and seeds"
    )
    parser.add_argument("--seeds", type=int, nargs="+", help=SEEDS_HELP)
    parser.add_argument("--steps-per-env", type=int, default=None, help=STEPS_PER_ENV_HELP)
    add_solve_arguments(parser)
    add_launch_arguments(parser)


def run_all(args: argparse.Namespace) -> list[dict]:
    """envs, train, seeds, solve and launch with their own defaults."""
    gpu = jax.devices()[0].platform != "cpu"
    envs_args = argparse.Namespace(
        **vars(args),
        num_envs=[1, 256, 4096, 65536] + ([2**20] if gpu else []),
        envs=ENV_NAMES,
        no_reference=False,
    )
    rows = run_envs(envs_args)
    rows += run_train(argparse.Namespace(**vars(args), num_envs=None))
    rows += run_seeds(args)
    return rows + run_solve(args) + run_launch(args)


# ---------------------------------------------------------------------------------------------
# command line
# ---------------------------------------------------------------------------------------------

# name -> (help, add_arguments, run). A subcommand's run returns the rows it measured.
SUBCOMMANDS: dict[
    str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], list]]
] = {
    "envs": (
        "env steps per second of every env, next to gymnax / jumanji",
        add_envs_arguments,
        run_envs,
    ),
    "train": (
        "training env steps/s and updates/s of every script across num-envs",
        add_train_arguments,
        run_train,
    ),
    "seeds": (
        "wall time of 1, 4, 16, 64 vmapped seeds of every script",
        add_seeds_arguments,
        run_seeds,
    ),
    "solve": (
        "each script's default run: wall seconds to the solved bar",
        add_solve_command_arguments,
        run_solve,
    ),
    "launch": (
        "each script's default run from launch to exit, compilation cache cold and warm",
        add_launch_command_arguments,
        run_launch,
    ),
    "versus": (
        "this checkout's train speed and cold launch against another checkout's, interleaved",
        add_versus_arguments,
        run_versus,
    ),
    "sweep": (
        "a --sweep grid as one process against its runs as one process each",
        add_sweep_arguments,
        run_sweep,
    ),
    "distributed": (
        "the same runs as one process and as several (--distributed on this machine's CPU)",
        add_distributed_arguments,
        run_distributed,
    ),
    "all": ("envs, train, seeds, solve and launch", add_all_arguments, run_all),
}
ROW_KEY = ("benchmark", "library", "env", "num_envs", "num_seeds", "device")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--output", default=RESULTS_PATH, help=f"JSON the rows merge into (default {RESULTS_PATH})"
    )
    parser.add_argument("--no-save", action="store_true", help="print only, write no file")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(commands.add_parser(name, help=help_text))
    args = parser.parse_args()
    rows = SUBCOMMANDS[args.command][2](args)
    if not args.no_save:
        merge_rows(args.output, rows, ROW_KEY)
        print(f"\nwrote {len(rows)} rows to {args.output}")


if __name__ == "__main__":
    main()
