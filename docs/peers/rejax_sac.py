"""Peer baseline: rejax's SAC on gymnax Pendulum-v1 with rejax's own tuned config, timed.

Runs rejax 0.1.3 (PyPI wheel; its rejax/ sources are identical to github.com/keraJLi/rejax
at commit d7510951b7a89ca8463cb2a6d18e21750ec454ff) unmodified, with gymnax 0.0.9:

    python docs/peers/rejax_sac.py [PEERS] [--num-seeds N] [--bar -200] [--quick]

Hyperparameters: rejax's configs/gymnax/pendulum.yaml, key ``sac:``, at that commit
(copied below); only total_timesteps may be overridden, for tiny smoke tests. Seeds are
vmapped the way rejax documents: ``jax.jit(jax.vmap(algo.train))(keys)`` with
``keys = jax.random.split(jax.random.PRNGKey(0), N)``, compiled ahead of time with
``.lower(keys).compile()`` so that compilation and training are timed apart.

rejax imports distrax 0.1.5, whose tensorflow-probability 0.25.0 reads
``jax.interpreters.xla.pytype_aval_mappings`` at import, which newer jax (0.10, 0.11) no
longer has; the only shim here puts jax's own ``jax._src.core.pytype_aval_mappings`` under
that name before rejax is imported. Nothing in the algorithm is changed.

Times are seconds since the first line of this file ran (``time.perf_counter()`` before
any import): import_seconds (launch to imports done), compile_seconds (duration of
SAC.create + lower + compile), train_seconds (duration of the compiled run, to
``jax.block_until_ready``), process_seconds (launch to end of run).

Returns: rejax's train returns (train_state, (lengths, returns)), each shaped (seeds,
1 + ceil(total_timesteps / eval_freq), 128): an evaluation of 128 episodes before
training and after every ceil(eval_freq / num_envs) * num_envs env steps (rejax's default
eval_callback). The curve is the mean over seeds and episodes per eval point. The first
eval point whose value is >= --bar gives first_crossing_env_steps and
first_crossing_seconds (compile end + train_seconds x its env steps / the last eval's env
steps, an estimate since launch). final_return is the last eval point's value.
"""

import time

T0 = time.perf_counter()

import argparse
import contextlib
import json
import math
import sys
from importlib.metadata import version

import numpy as np

REJAX_COMMIT = "d7510951b7a89ca8463cb2a6d18e21750ec454ff"

# rejax's tuned config: configs/gymnax/pendulum.yaml, key `sac:`, at REJAX_COMMIT
# (yaml's `null` is None).
CONFIG = {
    "env": "Pendulum-v1",
    "agent_kwargs": {"activation": "swish"},
    "num_envs": 1,
    "buffer_size": 10_000,
    "fill_buffer": 256,
    "batch_size": 256,
    "learning_rate": 0.01,
    "num_epochs": 1,
    "total_timesteps": 10_000,
    "eval_freq": 100,
    "gamma": 0.99,
    "polyak": 0.98,
    "target_entropy_ratio": None,
    "normalize_observations": True,
}


def num(x):
    """A float for JSON: None for NaN."""
    x = float(x)
    return None if np.isnan(x) else x


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("peers_path", nargs="?", help="unused: rejax is on PYTHONPATH already")
    p.add_argument("--num-seeds", type=int, default=1)
    p.add_argument("--bar", type=float, default=-200.0, help="sac_pendulum.py's solved_return")
    p.add_argument("--total-timesteps", type=int, default=None, help="smoke tests only")
    p.add_argument("--quick", action="store_true", help="a smoke test: 5000 steps")
    args = p.parse_args()
    if args.quick:
        args.total_timesteps = 5000

    import jax
    import jax._src.core
    import jax.interpreters.xla

    if not hasattr(jax.interpreters.xla, "pytype_aval_mappings"):
        # TFP 0.25.0 (via distrax) reads this at import; newer jax keeps it in core only.
        jax.interpreters.xla.pytype_aval_mappings = jax._src.core.pytype_aval_mappings
    with contextlib.redirect_stdout(sys.stderr):  # keep stdout for the JSON line
        from rejax import SAC

    t_import = time.perf_counter() - T0

    config = dict(CONFIG, agent_kwargs=dict(CONFIG["agent_kwargs"]))
    if args.total_timesteps is not None:
        config["total_timesteps"] = args.total_timesteps
    algo = SAC.create(**config)
    train = jax.jit(jax.vmap(algo.train))
    keys = jax.random.split(jax.random.PRNGKey(0), args.num_seeds)
    compiled = train.lower(keys).compile()
    t_compiled = time.perf_counter() - T0

    train_state, (lengths, returns) = compiled(keys)
    jax.block_until_ready((train_state, lengths, returns))
    t_done = time.perf_counter() - T0

    returns = np.asarray(returns, dtype=np.float64)
    n_evals = math.ceil(algo.total_timesteps / algo.eval_freq)
    steps_per_eval = math.ceil(algo.eval_freq / algo.num_envs) * algo.num_envs
    assert not algo.skip_initial_evaluation
    assert returns.shape[:2] == (args.num_seeds, n_evals + 1), returns.shape
    eval_steps = steps_per_eval * np.arange(n_evals + 1)
    final_steps = int(np.asarray(train_state.global_step).reshape(-1)[0])
    assert final_steps == eval_steps[-1], (final_steps, eval_steps[-1])
    train_seconds = t_done - t_compiled

    curve = returns.mean(axis=(0, 2))
    hits = np.flatnonzero(curve >= args.bar)
    steps = secs = None
    if hits.size:
        steps = int(eval_steps[hits[0]])
        secs = round(t_compiled + train_seconds * steps / final_steps, 3)
    dev = jax.devices()[0]
    print(
        json.dumps(
            {
                "peer": "rejax_sac",
                "commit": REJAX_COMMIT,
                "num_seeds": args.num_seeds,
                "num_envs": algo.num_envs,
                "env_steps_per_seed": final_steps,
                "import_seconds": round(t_import, 3),
                "compile_seconds": round(t_compiled - t_import, 3),
                "train_seconds": round(train_seconds, 3),
                "process_seconds": round(t_done, 3),
                "final_return": num(curve[-1]),
                "first_crossing_env_steps": steps,
                "first_crossing_seconds": secs,
                "bar": args.bar,
                "num_eval_points": int(curve.size),
                "eval_episodes": int(returns.shape[2]),
                "rejax_version": version("rejax"),
                "gymnax_version": version("gymnax"),
                "jax_version": jax.__version__,
                "device": f"{dev.platform}:{dev.device_kind}",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
