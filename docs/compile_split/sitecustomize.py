"""Where a run's compile seconds go: `benchmark.py launch` puts this folder first on a launched
script's PYTHONPATH, so Python imports this file before the script. It records JAX's monitoring
events (trace, lower to MLIR, XLA's compile) by program, in the order the programs were traced,
and at exit writes them as JSON to $COMPILE_SPLIT: {"run_chunks": {"jaxpr_trace": 0.31, ...}}.
A name traced again is numbered ("every_structure 2": sac_pendulum's evaluation, after init)."""

import atexit
import json
import os

programs: dict[str, dict[str, float]] = {}


def record(event: str, seconds: float, fun_name: str | None = None, **_: object) -> None:
    phase = event.rsplit("/", 1)[-1].removesuffix("_duration")
    if fun_name is None:  # the cache's own events
        return
    if phase == "jaxpr_trace" or not programs:  # a program starts with its trace
        count = sum(name.split(" ")[0] == fun_name for name in programs)
        programs[f"{fun_name} {count + 1}" if count else fun_name] = {}
    last = programs[next(reversed(programs))]
    last[phase] = round(last.get(phase, 0.0) + seconds, 3)


def write() -> None:
    """Whole or not at all: the processes of a --distributed run all write it as they exit (two
    writing one file at once left one's tail after the other's JSON: a CI run's failure)."""
    temporary = f"{os.environ['COMPILE_SPLIT']}.{os.getpid()}"
    with open(temporary, "w") as file:
        json.dump(programs, file)
    os.replace(temporary, os.environ["COMPILE_SPLIT"])


if os.environ.get("COMPILE_SPLIT"):
    from jax import monitoring

    monitoring.register_event_duration_secs_listener(record)
    atexit.register(write)
