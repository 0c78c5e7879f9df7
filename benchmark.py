"""Throughput benchmarks; the method of each: docs/benchmarks.md

    python benchmark.py envs              # env steps/s of every env, 1 .. 65536 envs
    python benchmark.py train             # each script's env steps/s and updates/s across num-envs
    python benchmark.py seeds             # wall time of 1, 4, 16, 64 vmapped seeds per script
    python benchmark.py solve             # each script's default run: seconds to the solved bar
    python benchmark.py launch            # launch to first progress line and to exit, cold, warm
    python benchmark.py versus ../before  # against another checkout: train speed and launch
    python benchmark.py sweep             # a --sweep grid in one process vs one process per run
    python benchmark.py distributed       # the same runs in one process vs two (--distributed)
    python benchmark.py all --quick       # envs, train, seeds, solve and launch, short
Rows merge into --output (docs/benchmarks.json) by ROW_KEY; envs, train, seeds draw a PNG too.
"""

import argparse
import collections
import csv
import dataclasses
import datetime
import itertools
import json
import os
import shlex
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from importlib import import_module, metadata, util
from pathlib import Path

import jax
import jax.numpy as jnp
from matplotlib.figure import Figure

import envs

REPO = os.path.dirname(os.path.abspath(__file__))
ROW_KEY = ("benchmark", "library", "env", "num_envs", "num_seeds", "device")
ENV_NAMES = ["CartPole-v1", "CartPoleContinuous", "CartPoleSwingup", "Pendulum-v1", "Snake"]
GYMNAX_NAMES = {"CartPole-v1", "Pendulum-v1"}  # the gymnax envs ours reproduce exactly
JUMANJI_SNAKE_GRID = 12  # jumanji's Snake-v1 board is 12 x 12; ours runs at that size next to it
SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
LAUNCH_SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole"]  # ppo_snake's run: minutes
SCRIPT_FLAGS = ["--no-capture-gif", "--no-plot", "--no-save-model"]
STEPS_PER_ENV = {"sac": 64, "ppo": 512}  # per timed chunk, ~1 s of CPU work (--quick: a 4th)
# A command's prefix: no --distributed worker outlives a killed benchmark.py (setpriv, Linux).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []


def device_label() -> str:
    if jax.default_backend() == "cpu":
        return f"{os.cpu_count()}-core CPU"
    return f"{len(jax.devices())}x {jax.devices()[0].device_kind}"


def report(row: dict) -> dict:
    """Print the row's figures (not its lists) on one progress line; return the row."""
    shown = [f"{name} {value}" for name, value in row.items() if not isinstance(value, list)]
    print("  " + ", ".join(shown), flush=True)
    return row


def save(args: argparse.Namespace, rows: list[dict], plot: tuple = ()) -> list[dict]:
    """Stamp `rows`, merge them into --output by ROW_KEY, and draw `plot` from the file's rows."""
    date = datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    for row in rows:
        row.update(device=device_label(), jax_version=jax.__version__, date=date)
    if args.no_save or not rows:
        return rows
    output = Path(args.output)
    kept = json.loads(output.read_text())["rows"] if output.exists() else []
    new_keys = {tuple(row.get(field) for field in ROW_KEY) for row in rows}
    kept = [row for row in kept if tuple(row.get(field) for field in ROW_KEY) not in new_keys]
    # One row per line, so that a diff shows which measurements changed.
    text = '{"description": "Benchmark rows; see docs/benchmarks.md for the method of each '
    text += 'benchmark.", "rows": [\n' + ",\n".join(json.dumps(row) for row in kept + rows)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.with_suffix(".tmp").write_text(text + "\n]}\n")
    output.with_suffix(".tmp").replace(output)
    print(f"wrote {len(rows)} rows to {output}")
    if plot:
        plotted = [row for row in kept + rows if row["benchmark"] == rows[0]["benchmark"]]
        plotted = [row for row in plotted if row.get("device") == device_label()]
        plot_rows(output.parent / plot[0], plotted, *plot[1:])
    return rows


def plot_rows(path: Path, rows: list[dict], x: str, y: str, *labels: str) -> None:
    """Log-log, one colour per env or script; a reference library's line dashed."""
    figure = Figure(figsize=(7, 4.5), layout="tight")
    axes = figure.subplots()
    env_names = sorted({row["env"] for row in rows})
    for env, library in sorted({(row["env"], row["library"]) for row in rows}):
        line = [row for row in rows if (row["env"], row["library"]) == (env, library)]
        points = sorted((row[x], row[y]) for row in line if row.get(y) is not None)
        style = "-o" if library in ("ours", env) else "--s"
        label = env if library == env else f"{env} ({library})"
        color = f"C{env_names.index(env) % 10}"
        axes.plot(*zip(*points, strict=True), style, color=color, label=label)
    title = f"{labels[2]}, {device_label()}"
    axes.set(xscale="log", yscale="log", xlabel=labels[0], ylabel=labels[1], title=title)
    axes.grid(True, which="major", alpha=0.3)
    axes.legend(fontsize=7)
    figure.savefig(path, dpi=120)
    print(f"wrote {path}")


# ---- env throughput: one protocol for every library ----
@dataclasses.dataclass(frozen=True)
class VectorEnv:
    """`num_envs` envs of one library: init(key), draw(key, num_steps), step(carry, inputs)."""

    library: str
    env: str
    num_envs: int
    init: object
    draw: object
    step: object

    def rollout(self, carry, key, num_steps: int):
        """Auto-resetting steps; the final carry and the reward sum keep every step's work live."""

        def body(loop, step_inputs):
            carry, rewards = self.step(loop[0], step_inputs)
            return (carry, loop[1] + jnp.sum(rewards)), None

        return jax.lax.scan(body, (carry, jnp.float32(0.0)), self.draw(key, num_steps))[0]


def gymnax_style(library: str, label: str, env, params, num_envs: int) -> VectorEnv:
    """envs.py and gymnax share the API: reset(key, params), step(key, state, action, params)."""
    space = env.action_space(params)

    def init(key):
        return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)

    def draw(key, num_steps):
        key_actions, key_envs = jax.random.split(key)
        shape = (num_steps, num_envs)
        if hasattr(space, "n"):  # bits modulo n (exact for a power of two): half randint's hashing
            actions = (jax.random.bits(key_actions, shape) % space.n).astype(jnp.int32)
        else:
            size = shape + space.shape
            actions = jax.random.uniform(key_actions, size, minval=space.low, maxval=space.high)
        return actions, jax.random.split(key_envs, shape)

    def step(carry, inputs):
        step_all = jax.vmap(env.step, in_axes=(0, 0, 0, None))
        obs, state, reward, _, _, _ = step_all(inputs[1], carry[1], inputs[0], params)
        return (obs, state), reward

    return VectorEnv(library, label, num_envs, init, draw, step)


def jumanji_snake(label: str, num_envs: int) -> VectorEnv:
    """jumanji's Snake-v1, auto-reset by its own wrapper; its envs keep their keys in state."""
    import jumanji.wrappers

    env = jumanji.wrappers.AutoResetWrapper(jumanji.make("Snake-v1"))

    def init(key):
        state, timestep = jax.vmap(env.reset)(jax.random.split(key, num_envs))
        return timestep.observation, state

    def draw(key, num_steps):
        return (jax.random.bits(key, (num_steps, num_envs)) % 4).astype(jnp.int32)

    def step(carry, actions):
        state, timestep = jax.vmap(env.step)(carry[1], actions)
        return (timestep.observation, state), timestep.reward

    return VectorEnv("jumanji", label, num_envs, init, draw, step)


def time_side_by_side(vector_envs: list[VectorEnv], num_steps: int, repeats: int) -> list[dict]:
    """Rows of `repeats` rollouts of each, interleaved; ours first, with its ratio to the others."""
    rollouts = []
    carries = []
    rows = []
    key_init, key_run = jax.random.split(jax.random.key(0))
    for vector_env in vector_envs:
        carries.append(jax.block_until_ready(jax.jit(vector_env.init)(key_init)))
        start = time.perf_counter()
        rollout = jax.jit(vector_env.rollout, static_argnums=2, donate_argnums=0)
        rollouts.append(rollout.lower(carries[-1], key_run, num_steps).compile())
        row = dict(library=vector_env.library, env=vector_env.env, num_envs=vector_env.num_envs)
        rows.append(row | dict(compile_seconds=round(time.perf_counter() - start, 3)))
    seconds = [[] for _ in vector_envs]
    keys = jax.random.split(jax.random.key(1), repeats + 1)
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for index, rollout in enumerate(rollouts):
            start = time.perf_counter()
            carries[index], _ = jax.block_until_ready(rollout(carries[index], keys[repeat]))
            if repeat > 0:
                seconds[index].append(time.perf_counter() - start)
    for row, runs in zip(rows, seconds, strict=True):
        env_steps = row["num_envs"] * num_steps
        row["steps_per_second"] = round(env_steps / statistics.median(runs))
        row["steps_per_second_runs"] = [round(env_steps / run) for run in runs]
        row["num_steps"] = num_steps
    for reference, reference_runs in zip(rows[1:], seconds[1:], strict=True):
        paired = [theirs / ours for ours, theirs in zip(seconds[0], reference_runs, strict=True)]
        rows[0]["reference"] = reference["library"]
        rows[0]["ratio_to_reference"] = round(statistics.median(paired), 3)
        rows[0]["ratio_runs"] = [round(ratio, 3) for ratio in paired]
    return rows


def run_envs(args: argparse.Namespace) -> list[dict]:
    """Env steps/s of every env; gymnax's and jumanji's versions beside ours when importable."""
    gpu_sizes = [2**20] if jax.default_backend() != "cpu" else []
    rows = []
    for num_envs in args.num_envs or [1, 256, 4096, 65536, *gpu_sizes]:
        budget = 2**19 if args.quick else 2**22  # env steps per timed run: one env runs ms too
        num_steps = max(16, min(budget // num_envs, 512 if args.quick else 4096))
        groups = []
        for name in args.envs:
            groups.append([gymnax_style("ours", name, *envs.make(name), num_envs)])
            if name in GYMNAX_NAMES and not args.no_reference and util.find_spec("gymnax"):
                import gymnax

                groups[-1].append(gymnax_style("gymnax", name, *gymnax.make(name), num_envs))
        if "Snake" in args.envs and not args.no_reference and util.find_spec("jumanji"):
            label = f"Snake {JUMANJI_SNAKE_GRID}x{JUMANJI_SNAKE_GRID}"  # ours on jumanji's board
            params = envs.SnakeParams(grid_size=JUMANJI_SNAKE_GRID)
            ours = gymnax_style("ours", label, envs.Snake(), params, num_envs)
            groups.append([ours, jumanji_snake(label, num_envs)])
        for group in groups:
            for row in time_side_by_side(group, num_steps, args.repeats or 5):
                library = row["library"]
                version = "envs.py" if library == "ours" else metadata.version(library)
                row = dict(benchmark="env_steps", **row, repeats=args.repeats or 5)
                rows.append(report(row | dict(library_version=version)))
    labels = ("parallel envs", "env steps per second", "env throughput")
    return save(args, rows, ("benchmark_envs.png", "num_envs", "steps_per_second", *labels))


# ---- training throughput and seed scaling: the scripts' own make_train ----
def time_chunks(script: str, num_envs: int, num_seeds: int, steps_per_env: int, repeats: int):
    """Timing of `script`'s run_chunk as its CLI calls it, after its first gradient update."""
    module = import_module(script)
    chunk_steps = num_envs * steps_per_env
    sizes = dict(num_envs=num_envs, num_seeds=num_seeds, log_every=chunk_steps)
    config = dataclasses.replace(module.Config(), **sizes, total_timesteps=chunk_steps * 1000)
    module.validate(config)  # a size the script itself would refuse is a usage error here too
    init, run_chunk, _ = module.make_train(config)
    keys = jax.vmap(jax.random.key)(jnp.arange(num_seeds))
    state = jax.block_until_ready(jax.jit(jax.vmap(init))(keys))
    start = time.perf_counter()
    chunk_function = jax.jit(jax.vmap(run_chunk, in_axes=(0, None)), donate_argnums=0)
    compiled = chunk_function.lower(state, jnp.int32(0)).compile()
    compile_seconds = time.perf_counter() - start
    chunk = 0
    updates = 0  # of seed 0, so far
    while updates == 0:  # SAC's random-action phase does no update
        state, metrics = compiled(state, jnp.int32(chunk))
        updates = int(jax.device_get(metrics.updates)[0])
        chunk += 1
    state, metrics = compiled(state, jnp.int32(chunk))
    metrics = jax.device_get(metrics)
    steps = int(metrics.env_steps[0]) // (chunk + 1)  # per chunk and seed
    chunk_updates = int(metrics.updates[0]) - updates
    seconds = []
    for timed_chunk in range(chunk + 1, chunk + 1 + repeats):
        start = time.perf_counter()
        state, metrics = compiled(state, jnp.int32(timed_chunk))
        jax.block_until_ready((state, jax.device_get(metrics)))
        seconds.append(time.perf_counter() - start)
    median = statistics.median(seconds)
    return dict(
        chunk_seconds=round(median, 5),
        steps_per_second=round(steps * num_seeds / median),
        updates_per_second=round(chunk_updates * num_seeds / median),
        steps_per_second_runs=[round(steps * num_seeds / run) for run in seconds],
        compile_seconds=round(compile_seconds, 3),
        chunk_steps=steps,
        chunk_updates=chunk_updates,
    )


def train_sizes(script: str, quick: bool) -> list[int]:
    """train's envs per seed (on a GPU, --quick changes nothing)."""
    sac = script.startswith("sac")
    if jax.default_backend() != "cpu":
        return [16, 64, 256, 1024, 4096] if sac else [4, 64, 1024, 16384, 65536]
    if quick:
        return [16, 256] if sac else [4, 64]
    return [16, 64, 256, 1024] if sac else [4, 16, 64, 256, 1024]


def measure_chunks(args: argparse.Namespace, benchmark: str, sizes: dict) -> list[dict]:
    """A row per script and (num_envs, num_seeds) in `sizes[script]`; per second: all seeds."""
    repeats = min(args.repeats or 5, 3) if args.quick else args.repeats or 5
    rows = []
    for script, script_sizes in sizes.items():
        steps_per_env = args.steps_per_env or STEPS_PER_ENV[script[:3]] // (4 if args.quick else 1)
        for num_envs, num_seeds in script_sizes:
            row = dict(benchmark=benchmark, library=script, env=script, num_envs=num_envs)
            row.update(num_seeds=num_seeds, repeats=repeats)
            row.update(time_chunks(script, num_envs, num_seeds, steps_per_env, repeats))
            rows.append(report(row))
    return rows


def run_train(args: argparse.Namespace) -> list[dict]:
    """Training env steps/s and updates/s of every script across num-envs, one seed."""
    sizes = {}
    for script in args.scripts or SCRIPTS:
        sizes[script] = [(size, 1) for size in args.num_envs or train_sizes(script, args.quick)]
    rows = measure_chunks(args, "train_throughput", sizes)
    labels = ("envs per seed", "env steps per second (1 seed)", "training throughput")
    return save(args, rows, ("benchmark_train.png", "num_envs", "steps_per_second", *labels))


def run_seeds(args: argparse.Namespace) -> list[dict]:
    """Wall time per chunk of 1, 4, 16, 64 vmapped seeds of every script."""
    sizes = {}
    for script in args.scripts or SCRIPTS:
        counts = args.seeds or ([1, 4, 16] if args.quick else [1, 4, 16, 64])
        if script == "ppo_snake" and jax.default_backend() == "cpu" and not args.seeds:
            counts = counts[:-1]  # its CPU chunk at 16 seeds is minutes long
        sizes[script] = [(import_module(script).Config().num_envs, count) for count in counts]
    rows = measure_chunks(args, "seed_scaling", sizes)
    one_seed = {row["library"]: row["chunk_seconds"] for row in rows if row["num_seeds"] == 1}
    for row in [row for row in rows if row["library"] in one_seed]:
        row["ratio_to_one_seed"] = round(row["chunk_seconds"] / one_seed[row["library"]], 3)
    labels = ("vmapped seeds", "wall time per chunk / 1 seed's", "seed scaling (flat = free)")
    return save(args, rows, ("benchmark_seeds.png", "num_seeds", "ratio_to_one_seed", *labels))


# ---- the scripts' command lines, in fresh processes ----
def run_script(script, cache_dir, flags, processes=1, environment=None, tree=REPO) -> dict:
    """summary.json, metrics.csv rows, seconds to the first progress line and to exit of a run."""
    with tempfile.TemporaryDirectory() as temporary, tempfile.TemporaryFile("w+") as workers:
        out = Path(temporary, "run")  # a new folder: the scripts refuse a non-empty one
        command = [sys.executable, f"{script}.py", "--output-dir", str(out), *flags]
        commands = [[*DIE_WITH_PARENT, *command]]
        if processes > 1:
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                address = f"127.0.0.1:{probe.getsockname()[1]}"
            cluster = [*commands[0], "--distributed", "--coordinator-address", address]
            cluster += ["--num-processes", str(processes)]
            commands = [[*cluster, "--process-id", str(index)] for index in range(processes)]
        environment = {**os.environ, "JAX_COMPILATION_CACHE_DIR": cache_dir, **(environment or {})}
        environment["PYTHONUNBUFFERED"] = "1"
        options = dict(stderr=subprocess.STDOUT, text=True, env=environment, cwd=tree)
        start = time.perf_counter()
        running = [subprocess.Popen(commands[0], stdout=subprocess.PIPE, **options)]
        for command in commands[1:]:  # to a file: a pipe nobody reads could fill and block them
            running.append(subprocess.Popen(command, stdout=workers, **options))
        first_progress = None
        printed = []
        for line in running[0].stdout:
            printed.append(line)
            if first_progress is None and line.startswith("steps "):
                first_progress = time.perf_counter() - start
        for process in running:
            if process.wait() != 0:
                workers.seek(0)
                output = "".join(printed) + workers.read()
                raise RuntimeError(f"{shlex.join(process.args)} failed:\n{output[-5000:]}")
        seconds = time.perf_counter() - start
        if first_progress is None:
            raise RuntimeError(f"{script}.py printed no line starting with 'steps ': {printed}")
        run = json.loads((out / "summary.json").read_text())
        run["metrics"] = list(csv.DictReader((out / "metrics.csv").read_text().splitlines()))
    return run | dict(seconds=seconds, first_progress_seconds=first_progress)


def figures(prefix: str, runs: list[dict]) -> dict:
    """`prefix`_seconds (to exit), _first_progress_seconds, ...: medians; _runs: each run's."""
    row = {}
    for name in ("seconds", "first_progress_seconds", "compile_seconds", "train_seconds"):
        row[f"{prefix}_{name}"] = round(statistics.median(run[name] for run in runs), 2)
    row[f"{prefix}_runs"] = [round(run["seconds"], 2) for run in runs]
    row[f"{prefix}_first_progress_runs"] = [round(run["first_progress_seconds"], 2) for run in runs]
    return row


def first_crossing_seconds(metrics: list[dict], bar: float) -> float | None:
    """Wall seconds at the first metrics.csv row whose training return reached `bar`."""
    crossings = (row for row in metrics if float(row["episode_return"]) >= bar)  # nan: False
    return next((float(row["wall_seconds"]) for row in crossings), None)


def run_solve(args: argparse.Namespace) -> list[dict]:
    """Each script's default run, its seconds to the solved bar, from an empty compile cache."""
    rows = []
    scripts = args.scripts or SCRIPTS
    for script in [name for name in scripts if not (args.quick and name == "ppo_snake")]:
        module = import_module(script)
        bar = module.solved_return(module.Config())  # the script's own bar
        runs = []
        for index in range(1 if args.quick else args.runs):  # the default seed first
            flags = [*SCRIPT_FLAGS, "--seed", str(module.Config().seed + index), *args.flags]
            with tempfile.TemporaryDirectory() as cache:
                runs.append(run_script(script, cache, flags))
        medians = figures("run", runs)
        crossings = [first_crossing_seconds(run["metrics"], bar) for run in runs]
        crossings = [seconds for seconds in crossings if seconds is not None]
        first_crossing = round(statistics.median(crossings), 2) if crossings else None
        row = dict(benchmark="time_to_solve", library=script, env=script, num_seeds=1)
        row.update(num_envs=runs[0].get("num_envs"), runs=len(runs), solved_bar=bar)
        row["train_seconds"] = medians["run_train_seconds"]
        row["compile_seconds"] = medians["run_compile_seconds"]
        row["process_seconds"] = medians["run_seconds"]
        row["env_steps"] = int(runs[0]["metrics"][-1]["env_steps"])
        row["final_returns"] = [round(run["final_return_mean"], 2) for run in runs]
        row["first_crossing_seconds"] = first_crossing
        row["solved_runs"] = sum(run["final_return_mean"] >= bar for run in runs)
        row["extra_flags"] = args.flags
        for name, values in runs[0].items():  # the script's other evaluation figures (Snake)
            if name.startswith("final_") and isinstance(values, list) and name != "final_returns":
                row[name + "s"] = [round(statistics.mean(run[name]), 3) for run in runs]
        rows.append(report(row))
    return save(args, rows)


def cold_and_warm(script: str, warm_cache: str, flags: list[str], tree: str = REPO) -> dict:
    """One run from an empty compilation cache, then one from `warm_cache`."""
    with tempfile.TemporaryDirectory() as cold_cache:
        cold = run_script(script, cold_cache, flags, tree=tree)
    return {"cold": cold, "warm": run_script(script, warm_cache, flags, tree=tree)}


def run_launch(args: argparse.Namespace) -> list[dict]:
    """Each default run's launch to first progress line and to exit, cache cold and warm."""
    runs = 1 if args.quick else args.runs
    rows = []
    for script in args.scripts or LAUNCH_SCRIPTS:
        with tempfile.TemporaryDirectory() as warm_cache:
            run_script(script, warm_cache, args.flags)  # fills the warm cache
            pairs = [cold_and_warm(script, warm_cache, args.flags) for _ in range(runs)]
        row = dict(benchmark="launch", library=script, env=script, num_seeds=1, runs=runs)
        row["num_envs"] = pairs[0]["cold"].get("num_envs")
        for side in ("cold", "warm"):
            row.update(figures(side, [pair[side] for pair in pairs]))
        first_progress = row["cold_first_progress_seconds"] / row["warm_first_progress_seconds"]
        row["first_progress_cold_to_warm"] = round(first_progress, 2)
        row["cold_to_warm"] = round(row["cold_seconds"] / row["warm_seconds"], 2)
        returns = [pair[side]["final_return_mean"] for side in ("cold", "warm") for pair in pairs]
        row["final_returns"] = [round(value, 2) for value in returns]
        row["extra_flags"] = args.flags
        rows.append(report(row))
    return save(args, rows)


def run_versus(args: argparse.Namespace) -> list[dict]:
    """This checkout against another (e.g. a git worktree), side by side, round after round."""
    trees = {"baseline": os.path.abspath(args.baseline), "this": REPO}
    scripts = args.scripts or LAUNCH_SCRIPTS
    sizes = {script: args.num_envs or train_sizes(script, quick=True) for script in scripts}
    speeds = collections.defaultdict(list)  # (tree, script, num_envs) -> env steps/s per round
    launches = {(name, script): [] for name in trees for script in scripts}
    with tempfile.TemporaryDirectory() as temporary:
        for name, script in launches:  # fill each tree's warm cache of each script
            run_script(script, os.path.join(temporary, name, script), args.flags, tree=trees[name])
        for _ in range(args.runs):
            for name, script in launches:
                output = Path(temporary, f"{name}-{script}.json")  # the tree's own benchmark
                command = [*DIE_WITH_PARENT, sys.executable, "benchmark.py", "train"]
                command += ["--output", str(output), "--scripts", script, "--repeats", "5"]
                command += ["--num-envs"]
                subprocess.run([*command, *map(str, sizes[script])], check=True, cwd=trees[name])
                for row in json.loads(output.read_text())["rows"]:
                    speeds[name, script, row["num_envs"]].append(row["steps_per_second"])
                warm_cache = os.path.join(temporary, name, script)
                pair = cold_and_warm(script, warm_cache, args.flags, trees[name])
                launches[name, script].append(pair)
    rows = []
    for script, num_envs in [(name, size) for name in scripts for size in sizes[name]]:
        row = dict(benchmark="versus_train", library=script, env=script, num_envs=num_envs)
        row.update(num_seeds=1, rounds=args.runs)
        baseline = statistics.median(speeds["baseline", script, num_envs])
        this = statistics.median(speeds["this", script, num_envs])
        row.update(baseline_steps_per_second=round(baseline), steps_per_second=round(this))
        row["ratio_to_baseline"] = round(this / baseline, 3)
        rows.append(report(row))
    for script in scripts:
        row = dict(benchmark="versus_launch", library=script, env=script, num_envs=None)
        row.update(num_seeds=1, rounds=args.runs, extra_flags=args.flags)
        for side, name in itertools.product(("cold", "warm"), trees):
            prefix = f"baseline_{side}" if name == "baseline" else side
            row.update(figures(prefix, [pair[side] for pair in launches[name, script]]))
        for side, measure in itertools.product(("cold", "warm"), ("first_progress_", "")):
            ratio = row[f"{side}_{measure}seconds"] / row[f"baseline_{side}_{measure}seconds"]
            row[f"{side}_{measure}ratio"] = round(ratio, 3)
        rows.append(report(row))
    return save(args, rows)


def run_sweep(args: argparse.Namespace) -> list[dict]:
    """A --sweep grid x seeds as one process against one process per run, one after another."""
    seeds_per_point = args.num_seeds or 2
    with tempfile.TemporaryDirectory() as cache:
        flags = ["--sweep", *args.sweep, "--num-seeds", str(seeds_per_point)]
        sweep = run_script(args.script, cache, [*flags, *SCRIPT_FLAGS, *args.flags])
    seed = import_module(args.script).Config().seed
    grid = []
    for entry in args.sweep:  # NAME=V1,V2 -> --NAME=V1, --NAME=V2
        name, values = entry.split("=", 1)
        grid.append([f"--{name}={value}" for value in values.split(",")])
    singles = []
    with tempfile.TemporaryDirectory() as cache:  # shared: the first single run compiles
        for point, index in itertools.product(itertools.product(*grid), range(seeds_per_point)):
            flags = [*point, "--seed", str(seed + index), *SCRIPT_FLAGS, *args.flags]
            singles.append(run_script(args.script, cache, flags))
    single_seconds = sum(run["seconds"] for run in singles)
    row = dict(benchmark="sweep", library=args.script, env=args.script, num_seeds=len(singles))
    row.update(num_envs=sweep.get("num_envs"), sweep=args.sweep, extra_flags=args.flags)
    row.update(seeds_per_point=seeds_per_point, **figures("sweep", [sweep]))
    row["single_runs_seconds"] = round(single_seconds, 2)
    row["speedup"] = round(single_seconds / sweep["seconds"], 2)
    row["sweep_final_returns"] = [round(value, 2) for value in sweep["final_returns"]]
    returns = [value for run in singles for value in run["final_returns"]]
    row["single_final_returns"] = [round(value, 2) for value in returns]
    # Recorded, not compared: RL amplifies the last bits (tests/test_sweeps.py compares short runs)
    pairs = zip(sweep["final_returns"], returns, strict=True)
    row["median_return_difference"] = round(statistics.median(abs(a - b) for a, b in pairs), 3)
    return save(args, [report(row)])


def run_distributed(args: argparse.Namespace) -> list[dict]:
    """The same runs as one process and as several (--distributed on this machine's CPU)."""
    if args.processes < 2:
        raise SystemExit("benchmark.py distributed: --processes must be >= 2")
    num_seeds = args.num_seeds or 8
    flags = [*SCRIPT_FLAGS, "--num-seeds", str(num_seeds), *args.flags]
    rows = []
    for script in args.scripts or ["sac_pendulum", "ppo_cartpole"]:
        sides = {"one_process": [], "distributed": []}
        for _ in range(args.repeats or 3):
            for side, processes in (("one_process", 1), ("distributed", args.processes)):
                # One CPU device per process, as many in all on both sides.
                xla_flags = f"--xla_force_host_platform_device_count={args.processes // processes}"
                environment = {"JAX_PLATFORMS": "cpu", "XLA_FLAGS": xla_flags}
                with tempfile.TemporaryDirectory() as cache:
                    sides[side].append(run_script(script, cache, flags, processes, environment))
        row = dict(benchmark="distributed", library=script, env=script, num_seeds=num_seeds)
        row.update(num_envs=sides["one_process"][0].get("num_envs"), processes=args.processes)
        row.update(devices=args.processes, repeats=args.repeats or 3, extra_flags=args.flags)
        for side, runs in sides.items():
            row.update(figures(side, runs))
        row["ratio"] = round(row["distributed_seconds"] / row["one_process_seconds"], 3)
        pairs = zip(*[runs[0]["final_returns"] for runs in sides.values()], strict=True)
        row["median_return_difference"] = round(statistics.median(abs(a - b) for a, b in pairs), 3)
        rows.append(report(row))
    return save(args, rows)


def run_all(args: argparse.Namespace) -> list[dict]:
    """envs, train, seeds, solve and launch with their own defaults."""
    rows = run_envs(args) + run_train(args) + run_seeds(args)
    return rows + run_solve(args) + run_launch(args)


# ---- command line: `benchmark.py envs` calls run_envs(args) ----
RUNS = {run.__name__[4:]: run for run in (run_envs, run_train, run_seeds, run_solve, run_launch)}
RUNS |= {run.__name__[4:]: run for run in (run_versus, run_sweep, run_distributed, run_all)}


def main() -> None:
    """One parser: each option's help names its subcommands; old names (--solve-flags) work."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=RUNS, help="the benchmark (above)")
    parser.add_argument("baseline", nargs="?", help="versus: the other checkout")
    parser.add_argument("--output", default="docs/benchmarks.json", help="the JSON file of rows")
    parser.add_argument("--no-save", action="store_true", help="print only, write no file")
    parser.add_argument("--quick", action="store_true", help="fewer sizes, runs and steps")
    parser.add_argument("--repeats", type=int, help="timed runs (5; train, seeds --quick: 3)")
    scripts = ["--scripts", "--solve-scripts", "--launch-scripts"]
    parser.add_argument(*scripts, nargs="+", choices=SCRIPTS, help="default: per subcommand")
    runs = ["--runs", "--solve-runs", "--launch-runs", "--rounds"]
    parser.add_argument(*runs, type=int, default=3, help="solve, launch, versus (--quick: 1)")
    flags = ["--flags", "--solve-flags", "--launch-flags", "--sweep-flags", "--run-flags"]
    parser.add_argument(*flags, type=shlex.split, default=[], help="for every run of a script")
    parser.add_argument("--num-envs", type=int, nargs="+", help="envs, train, versus: sizes")
    parser.add_argument("--envs", nargs="+", default=ENV_NAMES, choices=ENV_NAMES, help="envs")
    parser.add_argument("--no-reference", action="store_true", help="envs: no gymnax, jumanji")
    parser.add_argument("--steps-per-env", type=int, help="SAC 64, PPO 512 (--quick: / 4)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds: counts (1 4 16 64)")
    parser.add_argument("--script", default="sac_pendulum", choices=SCRIPTS, help="sweep's script")
    grid = ["q-lr=1e-3,3e-3", "tau=0.02,0.05"]
    parser.add_argument("--sweep", nargs="+", default=grid, help="sweep: the script's --sweep")
    parser.add_argument("--num-seeds", type=int, help="sweep: per point (2); distributed (8)")
    parser.add_argument("--processes", type=int, default=2, help="distributed: at least 2")
    args = parser.parse_intermixed_args()
    if (args.command == "versus") != (args.baseline is not None):
        parser.error("only versus takes a checkout: benchmark.py versus BASELINE")
    RUNS[args.command](args)


if __name__ == "__main__":
    main()
