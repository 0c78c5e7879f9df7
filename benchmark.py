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
    python benchmark.py peers             # PureJaxRL's PPO and rejax's SAC (--peers-path DIR)
    python benchmark.py gpu               # the GPU list of docs/benchmarks.md (a CPU: tiny)
Rows merge into --output by ROW_KEY (runs/benchmark__<time>/; --write-docs: docs/), PNGs beside.
"""

import argparse
import collections
import csv
import dataclasses
import datetime
import functools
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
SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
LAUNCH_SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole"]  # ppo_snake's run: minutes
SCRIPT_FLAGS = ["--no-capture-gif", "--no-plot", "--no-save-model"]
TINY_FLAGS = ["--total-timesteps", "4096", "--log-every", "1024", "--eval-episodes", "1"]
HEADLINE = ["steps_per_second", "env_steps_per_second", "updates_per_second", "ratio_to_reference"]
HEADLINE += ["ratio_to_one_seed", "cold_launch_to_solved_runs", "first_crossing_seconds", "speedup"]
STEPS_PER_ENV = {"sac": 64, "ppo": 512}  # per timed chunk, ~1 s of CPU work (--quick: a 4th)
# On a GPU this process takes JAX's default 75% up front (a 64-seed ppo_snake chunk needs one
# 36 GB block); the runs it launches (scripts, peers) share the rest, allocating as they go.
CHILD_MEMORY = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
# A command's prefix: no --distributed worker outlives a killed benchmark.py (setpriv, Linux).
DIE_WITH_PARENT = ["setpriv", "--pdeathsig", "TERM"] if shutil.which("setpriv") else []
SPLIT_HOOK = os.path.join(REPO, "docs", "compile_split")  # its sitecustomize.py: compile split


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


# ---- env throughput: ours and gymnax's, one API: reset(key, params), step(key, state, ...) ----
def vector_env(env, params, num_envs: int) -> tuple:
    """init(key) and rollout(carry, key, num_steps) of `num_envs` auto-resetting envs, random
    actions; the final carry and the reward sum keep every step's work live."""
    space = env.action_space(params)

    def init(key):
        return jax.vmap(env.reset, in_axes=(0, None))(jax.random.split(key, num_envs), params)

    def rollout(carry, key, num_steps: int):
        key_actions, key_envs = jax.random.split(key)
        shape = (num_steps, num_envs)
        if hasattr(space, "n"):  # bits modulo n (exact for a power of two): half randint's hashing
            actions = (jax.random.bits(key_actions, shape) % space.n).astype(jnp.int32)
        else:
            size = shape + space.shape
            actions = jax.random.uniform(key_actions, size, minval=space.low, maxval=space.high)

        def body(loop, inputs):
            step_all = jax.vmap(env.step, in_axes=(0, 0, 0, None))
            obs, state, reward, _, _, _ = step_all(inputs[1], loop[0][1], inputs[0], params)
            return ((obs, state), loop[1] + jnp.sum(reward)), None

        inputs = (actions, jax.random.split(key_envs, shape))
        return jax.lax.scan(body, (carry, jnp.float32(0.0)), inputs)[0]

    return init, rollout


def time_side_by_side(libraries: dict, num_envs: int, num_steps: int, repeats: int) -> list[dict]:
    """Rows of `repeats` rollouts of each library's (init, rollout), interleaved; ours first,
    with its ratio to the others."""
    rollouts, carries, rows = [], [], []
    key_init, key_run = jax.random.split(jax.random.key(0))
    for library, (init, rollout) in libraries.items():
        carries.append(jax.block_until_ready(jax.jit(init)(key_init)))
        start = time.perf_counter()
        rollout = jax.jit(rollout, static_argnums=2, donate_argnums=0)
        rollouts.append(rollout.lower(carries[-1], key_run, num_steps).compile())
        rows.append(dict(library=library, compile_seconds=round(time.perf_counter() - start, 3)))
    seconds = [[] for _ in libraries]
    keys = jax.random.split(jax.random.key(1), repeats + 1)
    for repeat in range(repeats + 1):  # the first round is a warm-up
        for index, rollout in enumerate(rollouts):
            start = time.perf_counter()
            carries[index], _ = jax.block_until_ready(rollout(carries[index], keys[repeat]))
            if repeat > 0:
                seconds[index].append(time.perf_counter() - start)
    for row, runs in zip(rows, seconds, strict=True):
        row["steps_per_second"] = round(num_envs * num_steps / statistics.median(runs))
        row["steps_per_second_runs"] = [round(num_envs * num_steps / run) for run in runs]
    for reference, reference_runs in zip(rows[1:], seconds[1:], strict=True):
        paired = [theirs / ours for ours, theirs in zip(seconds[0], reference_runs, strict=True)]
        rows[0]["reference"] = reference["library"]
        rows[0]["ratio_to_reference"] = round(statistics.median(paired), 3)
        rows[0]["ratio_runs"] = [round(ratio, 3) for ratio in paired]
    return rows


def run_envs(args: argparse.Namespace) -> list[dict]:
    """Env steps/s of every env; gymnax's version beside ours where it has the env and imports."""
    rows = []
    for num_envs, name in itertools.product(args.num_envs or [1, 256, 4096, 65536], args.envs):
        budget = 2**19 if args.quick else 2**22  # env steps per timed run: one env runs ms too
        num_steps = max(16, min(budget // num_envs, 512 if args.quick else 4096))
        libraries = {"ours": vector_env(*envs.make(name), num_envs)}
        if name in GYMNAX_NAMES and not args.no_reference and util.find_spec("gymnax"):
            import gymnax

            libraries["gymnax"] = vector_env(*gymnax.make(name), num_envs)
        for row in time_side_by_side(libraries, num_envs, num_steps, args.repeats or 5):
            version = "envs.py" if row["library"] == "ours" else metadata.version(row["library"])
            row = dict(benchmark="env_steps", env=name, num_envs=num_envs, **row)
            row.update(num_steps=num_steps, repeats=args.repeats or 5, library_version=version)
            rows.append(report(row))
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
        if script == "ppo_snake" and jax.default_backend() == "cpu":  # a CPU chunk: seconds
            counts = [] if args.quick else args.seeds or [1, 4, 16]
        sizes[script] = [(import_module(script).Config().num_envs, count) for count in counts]
    rows = measure_chunks(args, "seed_scaling", sizes)
    one_seed = {row["library"]: row["chunk_seconds"] for row in rows if row["num_seeds"] == 1}
    for row in [row for row in rows if row["library"] in one_seed]:
        row["ratio_to_one_seed"] = round(row["chunk_seconds"] / one_seed[row["library"]], 3)
    labels = ("vmapped seeds", "wall time per chunk / 1 seed's", "seed scaling (flat = free)")
    return save(args, rows, ("benchmark_seeds.png", "num_seeds", "ratio_to_one_seed", *labels))


# ---- the scripts' command lines, in fresh processes ----
def run_script(script, cache_dir, flags, tree=REPO, processes=1, environment=None) -> dict:
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
        split = Path(temporary, "compile_split.json")  # seconds per program and phase
        environment.update(CHILD_MEMORY, PYTHONUNBUFFERED="1", PYTHONPATH=SPLIT_HOOK)
        environment["COMPILE_SPLIT"] = str(split)
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
        run["compile_split"] = json.loads(split.read_text()) if split.exists() else None
    return run | dict(seconds=seconds, first_progress_seconds=first_progress)


def figures(prefix: str, runs: list[dict]) -> dict:
    """`prefix`_seconds (to exit), ...: medians; _runs: each run's; _compile_split: the first's."""
    row = {}
    for name in ("seconds", "first_progress_seconds", "compile_seconds", "train_seconds"):
        row[f"{prefix}_{name}"] = round(statistics.median(run[name] for run in runs), 2)
    row[f"{prefix}_runs"] = [round(run["seconds"], 2) for run in runs]
    row[f"{prefix}_first_progress_runs"] = [round(run["first_progress_seconds"], 2) for run in runs]
    row[f"{prefix}_compile_split"] = runs[0]["compile_split"]  # the first run's, per program
    return row


def first_crossing_seconds(metrics: list[dict], bar: float) -> float | None:
    """Wall seconds at the first metrics.csv row whose training return reached `bar`."""
    crossings = (row for row in metrics if float(row["episode_return"]) >= bar)  # nan: False
    return next((float(row["wall_seconds"]) for row in crossings), None)


def launch_to_solved(run: dict, bar: float) -> float | None:
    """Seconds from launch to the first row at `bar`: the first progress line prints row 1."""
    crossing = first_crossing_seconds(run["metrics"], bar)
    start = run["first_progress_seconds"] - float(run["metrics"][0]["wall_seconds"])
    return None if crossing is None else round(start + crossing, 2)


def cold_then_warm(script: str, flags: list[str], sides=("cold", "warm"), tree=REPO) -> dict:
    """A run per side, all from one compile cache: empty for the first (cold), then as filled."""
    with tempfile.TemporaryDirectory() as cache:
        return {side: run_script(script, cache, flags, tree) for side in sides}


def run_launch(args: argparse.Namespace, sides: tuple = ("cold", "warm")) -> list[dict]:
    """Each default run in fresh processes, seeds 1, 2, ... (--runs): launch to first progress
    line, to the solved bar and to exit; cold (an empty compile cache), then warm (it filled)."""
    rows = []
    scripts = args.scripts or (LAUNCH_SCRIPTS if "warm" in sides else SCRIPTS)
    for script in [name for name in scripts if not (args.quick and name == "ppo_snake")]:
        module = import_module(script)
        runs = collections.defaultdict(list)  # side -> its runs, seed after seed
        for index in range(1 if args.quick else args.runs):  # the default seed first
            flags = [*SCRIPT_FLAGS, "--seed", str(module.Config().seed + index), *args.flags]
            for side, run in cold_then_warm(script, flags, sides).items():
                runs[side].append(run)
        benchmark = "launch" if "warm" in sides else "time_to_solve"
        bar = runs["cold"][0]["solved_return"]  # the run's own bar: its flags may change it
        row = dict(benchmark=benchmark, library=script, env=shlex.join([script, *args.flags]))
        row.update(num_seeds=1, solved_bar=bar)
        row.update(num_envs=runs["cold"][0].get("num_envs"), runs=len(runs["cold"]))
        for side, done in runs.items():
            row.update(figures(side, done))
            row[f"{side}_launch_to_solved_runs"] = [launch_to_solved(run, bar) for run in done]
            row[f"{side}_final_returns"] = [round(run["final_return_mean"], 2) for run in done]
        row["env_steps"] = int(runs["cold"][0]["metrics"][-1]["env_steps"])
        for name in ("env_steps_per_second", "updates_per_second"):
            row[name] = round(statistics.median(run[name] for run in runs["cold"]))
        row["solved_runs"] = sum(run["final_return_mean"] >= bar for run in runs["cold"])
        for name, values in runs["cold"][0].items():  # the script's other figures (Snake)
            if name.startswith("final_") and isinstance(values, list) and "return" not in name:
                row[name + "s"] = [round(statistics.mean(run[name]), 3) for run in runs["cold"]]
        rows.append(report(row | dict(extra_flags=args.flags)))
    return save(args, rows)


def run_versus(args: argparse.Namespace) -> list[dict]:
    """This checkout against another (e.g. a git worktree), side by side, round after round."""
    trees = {"baseline": os.path.abspath(args.baseline), "this": REPO}
    scripts = args.scripts or LAUNCH_SCRIPTS
    sizes = {script: args.num_envs or train_sizes(script, quick=True) for script in scripts}
    speeds = collections.defaultdict(list)  # (tree, script, num_envs) -> env steps/s per round
    launches = {(name, script): [] for name in trees for script in scripts}
    with tempfile.TemporaryDirectory() as temporary:
        for _ in range(args.runs):
            for name, script in launches:
                output = Path(temporary, f"{name}-{script}.json")  # the tree's own benchmark
                command = [*DIE_WITH_PARENT, sys.executable, "benchmark.py", "train"]
                command += [f"--output={output}", "--scripts", script, "--repeats=5", "--num-envs"]
                subprocess.run([*command, *map(str, sizes[script])], check=True, cwd=trees[name])
                for row in json.loads(output.read_text())["rows"]:
                    speeds[name, script, row["num_envs"]].append(row["steps_per_second"])
                launches[name, script].append(cold_then_warm(script, args.flags, tree=trees[name]))
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
    """A --sweep grid x seeds as one process against one process per grid point (its seeds)."""
    seeds_per_point = args.num_seeds or 2
    with tempfile.TemporaryDirectory() as cache:
        flags = ["--sweep", *args.sweep, "--num-seeds", str(seeds_per_point)]
        sweep = run_script(args.script, cache, [*flags, *SCRIPT_FLAGS, *args.flags])
    grid = []
    for entry in args.sweep:  # NAME=V1,V2 -> --NAME=V1, --NAME=V2
        name, values = entry.split("=", 1)
        grid.append([f"--{name}={value}" for value in values.split(",")])
    singles = []
    with tempfile.TemporaryDirectory() as cache:  # shared: the first single run compiles
        for point in itertools.product(*grid):
            flags = [*point, "--num-seeds", str(seeds_per_point), *SCRIPT_FLAGS, *args.flags]
            singles.append(run_script(args.script, cache, flags))
    single_seconds = sum(run["seconds"] for run in singles)
    num_seeds = seeds_per_point * len(singles)
    row = dict(benchmark="sweep", library=args.script, env=args.script, num_seeds=num_seeds)
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
                    run = run_script(script, cache, flags, REPO, processes, environment)
                sides[side].append(run)
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


def run_peers(args: argparse.Namespace) -> list[dict]:
    """PureJaxRL's PPO and rejax's SAC (docs/peers/), each a process with their own packages
    (--peers-path DIR: DIR/site on PYTHONPATH, PureJaxRL's files in DIR/purejaxrl)."""
    site = [os.path.join(args.peers_path, "site"), os.environ.get("PYTHONPATH", "")]
    environment = {**os.environ, **CHILD_MEMORY, "PYTHONPATH": os.pathsep.join(site)}
    rows = []
    for peer in ("purejaxrl_ppo", "rejax_sac"):  # each its own config (--quick: a few steps)
        command = [*DIE_WITH_PARENT, sys.executable, f"docs/peers/{peer}.py", args.peers_path]
        command += ["--quick"] if args.quick else []
        done = subprocess.run(command, cwd=REPO, env=environment, capture_output=True, text=True)
        if done.returncode != 0:  # not our dependency: a peer that cannot run is skipped
            error = (done.stderr.strip().splitlines() or ["no output"])[-1]
            print(f"  {peer} skipped ({error}): see docs/benchmarks.md, --peers-path", flush=True)
            continue
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        row = dict(benchmark="peer", library=peer, env=peer, num_envs=figures.get("num_envs"))
        rows.append(report(row | figures))
    return save(args, rows)


# ---- the lists: `all` and `gpu`; on a CPU, `gpu` runs its list tiny (a test's run) ----
GPU_ENV_SIZES = [2**10, 2**14, 2**18, 2**20, 2**22]
PPO_2048_ENVS = "--num-envs 2048 --total-timesteps 2621440 --log-every 131072"  # 20 iterations
GPU_LIST = [  # (benchmark, options): docs/benchmarks.md's GPU list; 466 s on one H200
    ("envs", dict(envs=["CartPole-v1", "Pendulum-v1", "Snake"], num_envs=GPU_ENV_SIZES)),
    ("seeds", dict(scripts=["sac_cartpole"], seeds=[1, 8, 64])),
    ("seeds", dict(scripts=["ppo_cartpole"], seeds=[1, 64, 1024])),
    ("seeds", dict(scripts=["sac_pendulum", "ppo_snake"], seeds=[1, 64])),
    ("launch", dict(scripts=["sac_cartpole"], runs=1, flags=["--num-envs", "1024"])),
    ("solve", dict(scripts=["sac_pendulum", "ppo_cartpole"], runs=1)),
    ("solve", dict(scripts=["ppo_cartpole"], runs=1, flags=PPO_2048_ENVS.split())),
    ("peers", {}),
    ("sweep", dict(sweep=["q-lr=3e-4,5e-4,1e-3,2e-3,3e-3,5e-3,1e-2,2e-2"], num_seeds=8)),
]
ALL_LIST = ["envs", "train", "seeds", "solve", "launch"]
TINY = dict(quick=True, num_envs=[16, 64], seeds=[1], sweep=["q-lr=3e-3"], num_seeds=1)


def run_plan(args: argparse.Namespace) -> None:
    """`all` or `gpu`: its benchmarks with their options; then all their rows as one table."""
    plan = GPU_LIST if args.command == "gpu" else [(name, {}) for name in ALL_LIST]
    rows, failed = [], []
    for name, options in plan:
        if args.command == "gpu" and jax.default_backend() == "cpu":  # 1/128 of the envs
            given = options.get("flags", [])
            flags = [str(int(word) // 128) if word.isdigit() else word for word in given]
            options = options | TINY | dict(flags=[*flags, *TINY_FLAGS])
        try:  # one benchmark's failure does not cost the others their (GPU) time
            rows += RUNS[name](argparse.Namespace(**vars(args) | options))
        except Exception as error:  # said now, and by the exit status at the end
            print(f"{name} {options} failed: {error!r}", flush=True)
            failed.append(name)
    columns = ["benchmark", "library", "env", "num_envs", "num_seeds", *HEADLINE]
    for row in [dict(zip(columns, columns, strict=True)), dict.fromkeys(columns, "---"), *rows]:
        print("| " + " | ".join(str(row.get(column, "")) for column in columns) + " |")
    sys.exit(f"failed: {', '.join(failed)}" if failed else 0)


# ---- command line: `benchmark.py envs` calls run_envs(args) ----
RUNS = {run.__name__[4:]: run for run in (run_envs, run_train, run_seeds, run_launch, run_versus)}
RUNS |= {run.__name__[4:]: run for run in (run_sweep, run_distributed, run_peers)}
RUNS |= {"all": run_plan, "gpu": run_plan, "solve": functools.partial(run_launch, sides=("cold",))}


def main() -> None:
    """One parser: each option's help names its subcommands; old names (--solve-flags) work."""
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("command", choices=RUNS, help="the benchmark (above)")
    parser.add_argument("baseline", nargs="?", help="versus: the other checkout")
    mine = f"runs/benchmark__{int(time.time())}/benchmarks.json"  # a folder of its own, as a run's
    parser.add_argument("--output", default=mine, help="the JSON file of rows, its PNGs beside it")
    docs = os.path.join(REPO, "docs", "benchmarks.json")  # the published rows and plots
    parser.add_argument("--write-docs", dest="output", action="store_const", const=docs, help=docs)
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
    parser.add_argument("--no-reference", action="store_true", help="envs: no gymnax")
    parser.add_argument("--steps-per-env", type=int, help="SAC 64, PPO 512 (--quick: / 4)")
    parser.add_argument("--seeds", type=int, nargs="+", help="seeds: counts (1 4 16 64)")
    parser.add_argument("--script", default="sac_pendulum", choices=SCRIPTS, help="sweep's script")
    grid = ["q-lr=1e-3,3e-3", "tau=0.02,0.05"]
    parser.add_argument("--sweep", nargs="+", default=grid, help="sweep: the script's --sweep")
    parser.add_argument("--num-seeds", type=int, help="sweep: per point (2); distributed (8)")
    parser.add_argument("--processes", type=int, default=2, help="distributed: at least 2")
    parser.add_argument("--peers-path", default=".peers", help="peers: DIR/site, DIR/purejaxrl")
    args = parser.parse_intermixed_args()
    if (args.command == "versus") != (args.baseline is not None):
        parser.error("only versus takes a checkout: benchmark.py versus BASELINE")
    RUNS[args.command](args)


if __name__ == "__main__":
    main()
