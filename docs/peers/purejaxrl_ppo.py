"""Peer baseline: PureJaxRL's PPO on gymnax CartPole-v1, timed from launch.

Runs PureJaxRL (github.com/luchris429/purejaxrl, commit
31756b197773a52db763fdbe6d635e4b46522a73; purejaxrl/ppo.py and purejaxrl/wrappers.py
last changed in 5343613b07b3bc543c49695df601fc40f5ec3062), unmodified, from a directory
holding its ppo.py and wrappers.py (PEERS/purejaxrl; `benchmark.py peers` runs this):

    python docs/peers/purejaxrl_ppo.py PEERS [--num-seeds N] [--bar 475] [--quick]

The config is the one in ppo.py's ``__main__`` block (copied below) but for DEBUG, which is
off here: ppo.py's DEBUG prints each finished episode from a host callback, a cost our
scripts do not pay, so turning it off favours PureJaxRL. Only TOTAL_TIMESTEPS may be
overridden, for tiny smoke tests (--quick). As PureJaxRL's README does for
many seeds, it runs ``jax.jit(jax.vmap(make_train(config)))(jax.random.split(
jax.random.PRNGKey(30), N))`` (vmapped for N == 1 too), compiled ahead of time with
``.lower(keys).compile()`` so that compilation and training are timed apart.

ppo.py needs gymnax 0.0.9 (its step returns five values) and distrax 0.1.5 with
tensorflow-probability 0.25.0. That TFP release reads ``jax.interpreters.xla.
pytype_aval_mappings`` at import, which newer jax (0.10, 0.11) no longer has; the only
shim here puts jax's own ``jax._src.core.pytype_aval_mappings`` under that name before
ppo.py is imported. wrappers.py also imports brax and navix at module level, though
CartPole's PPO never uses them; where they are not installed, empty stand-in modules are
registered so that the import succeeds (listed under "stubbed_modules" in the output).
Nothing in the algorithm is changed.

Anything printed while importing goes to stderr, so stdout holds one JSON line only.

Times are seconds since the first line of this file ran (``time.perf_counter()`` before
any import): import_seconds (launch to imports done), compile_seconds (duration of
make_train + lower + compile), train_seconds (duration of the compiled run, to
``jax.block_until_ready``), process_seconds (launch to end of run).

Training return per update: for each seed, the mean of ``returned_episode_returns`` over
the (step, env) entries of that update where ``returned_episode`` is true; an update in
which a seed finished no episode carries that seed's previous value forward (as
LogWrapper itself does). The curve is the mean of that over seeds. The first update whose
value is >= --bar gives first_crossing_env_steps (updates x NUM_STEPS x NUM_ENVS) and
first_crossing_seconds (compile end + train_seconds x updates / NUM_UPDATES, an estimate
since launch). final_return is the curve's last value. The *_purejaxrl_mean keys give the
same from PureJaxRL's notebook metric, the unmasked
``out["metrics"]["returned_episode_returns"].mean(-1)``, averaged over steps and seeds.
"""

import time

T0 = time.perf_counter()

import argparse
import contextlib
import json
import os
import sys

import numpy as np

PUREJAXRL_COMMIT = "31756b197773a52db763fdbe6d635e4b46522a73"

# Copied from purejaxrl/ppo.py's `__main__` block at PUREJAXRL_COMMIT.
CONFIG = {
    "LR": 2.5e-4,
    "NUM_ENVS": 4,
    "NUM_STEPS": 128,
    "TOTAL_TIMESTEPS": 5e5,
    "UPDATE_EPOCHS": 4,
    "NUM_MINIBATCHES": 4,
    "GAMMA": 0.99,
    "GAE_LAMBDA": 0.95,
    "CLIP_EPS": 0.2,
    "ENT_COEF": 0.01,
    "VF_COEF": 0.5,
    "MAX_GRAD_NORM": 0.5,
    "ACTIVATION": "tanh",
    "ENV_NAME": "CartPole-v1",
    "ANNEAL_LR": True,
    "DEBUG": False,  # ppo.py's True prints every episode from a host callback: off, in its favour
}


def stub_missing_env_libraries():
    """Stand-ins for brax and navix when they are not installed; returns their names.

    PureJaxRL's wrappers.py imports brax and navix at module level, but uses them only
    inside BraxGymnaxWrapper and NavixGymnaxWrapper, which CartPole's ppo.py never builds.
    """
    import importlib.util
    import types

    def unavailable(*args, **kwargs):
        raise ImportError("brax is not installed (stubbed by purejaxrl_ppo.py)")

    stubbed = []
    if importlib.util.find_spec("brax") is None:
        names = ["brax", "brax.envs", "brax.envs.wrappers", "brax.envs.wrappers.training"]
        mods = [types.ModuleType(n) for n in names]
        for parent, child in zip(mods, mods[1:], strict=False):
            setattr(parent, child.__name__.rsplit(".", 1)[1], child)
        mods[-1].EpisodeWrapper = mods[-1].AutoResetWrapper = unavailable
        sys.modules.update(zip(names, mods, strict=True))
        stubbed.append("brax")
    if importlib.util.find_spec("navix") is None:
        sys.modules["navix"] = types.ModuleType("navix")
        stubbed.append("navix")
    return stubbed


def masked_curve(returns, done):
    """Per-update mean over seeds of the returns of the episodes that ended in that update.

    returns, done: arrays shaped (seeds, updates, steps, envs).
    """
    done = done.astype(bool)
    count = done.sum(axis=(2, 3))
    total = np.where(done, returns, 0.0).sum(axis=(2, 3))
    per_seed = np.full(count.shape, np.nan)
    last = np.full(count.shape[0], np.nan)
    for u in range(count.shape[1]):
        have = count[:, u] > 0
        last = np.where(have, total[:, u] / np.maximum(count[:, u], 1), last)
        per_seed[:, u] = last
    return per_seed.mean(axis=0)


def num(x):
    """A float for JSON: None for NaN."""
    x = float(x)
    return None if np.isnan(x) else x


def first_crossing(curve, bar):
    hits = np.flatnonzero(curve >= bar)
    return int(hits[0]) if hits.size else None


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "peers_path", help="PEERS: PureJaxRL's ppo.py and wrappers.py in PEERS/purejaxrl"
    )
    p.add_argument("--num-seeds", type=int, default=1)
    p.add_argument("--bar", type=float, default=475.0, help="CartPole-v1's solved return")
    p.add_argument(
        "--total-timesteps",
        type=float,
        default=None,
        help="override TOTAL_TIMESTEPS (smoke tests only); a float, like ppo.py's 5e5",
    )
    p.add_argument("--quick", action="store_true", help="a smoke test: 20480 steps")
    args = p.parse_args()
    if args.quick:
        args.total_timesteps = 20480.0

    sys.path.insert(0, os.path.join(args.peers_path, "purejaxrl"))
    import jax
    import jax._src.core
    import jax.interpreters.xla

    if not hasattr(jax.interpreters.xla, "pytype_aval_mappings"):
        # TFP 0.25.0 (via distrax) reads this at import; newer jax keeps it in core only.
        jax.interpreters.xla.pytype_aval_mappings = jax._src.core.pytype_aval_mappings
    stubbed = stub_missing_env_libraries()
    with contextlib.redirect_stdout(sys.stderr):  # a real brax prints import notes to stdout
        from ppo import make_train

    t_import = time.perf_counter() - T0

    config = dict(CONFIG)
    if args.total_timesteps is not None:
        config["TOTAL_TIMESTEPS"] = args.total_timesteps
    train = jax.jit(jax.vmap(make_train(config)))
    keys = jax.random.split(jax.random.PRNGKey(30), args.num_seeds)
    compiled = train.lower(keys).compile()
    t_compiled = time.perf_counter() - T0

    with contextlib.redirect_stdout(sys.stderr):  # ppo.py's DEBUG episode prints
        out = compiled(keys)
        jax.block_until_ready(out)
        jax.effects_barrier()
    t_done = time.perf_counter() - T0

    metrics = out["metrics"]
    returns = np.asarray(metrics["returned_episode_returns"], dtype=np.float64)
    done = np.asarray(metrics["returned_episode"])
    num_updates = int(config["NUM_UPDATES"])
    steps_per_update = config["NUM_STEPS"] * config["NUM_ENVS"]
    train_seconds = t_done - t_compiled

    def crossing(curve):
        u = first_crossing(curve, args.bar)
        if u is None:
            return None, None
        n = u + 1
        return n * steps_per_update, round(t_compiled + train_seconds * n / num_updates, 3)

    curve = masked_curve(returns, done)
    curve_pjr = returns.mean(axis=(2, 3)).mean(axis=0)
    steps, secs = crossing(curve)
    steps_pjr, secs_pjr = crossing(curve_pjr)
    dev = jax.devices()[0]
    print(
        json.dumps(
            {
                "peer": "purejaxrl_ppo",
                "commit": PUREJAXRL_COMMIT,
                "num_seeds": args.num_seeds,
                "num_envs": config["NUM_ENVS"],
                "env_steps_per_seed": num_updates * steps_per_update,
                "import_seconds": round(t_import, 3),
                "compile_seconds": round(t_compiled - t_import, 3),
                "train_seconds": round(train_seconds, 3),
                "process_seconds": round(t_done, 3),
                "final_return": num(curve[-1]),
                "first_crossing_env_steps": steps,
                "first_crossing_seconds": secs,
                "final_return_purejaxrl_mean": num(curve_pjr[-1]),
                "first_crossing_env_steps_purejaxrl_mean": steps_pjr,
                "first_crossing_seconds_purejaxrl_mean": secs_pjr,
                "bar": args.bar,
                "stubbed_modules": stubbed,
                "jax_version": jax.__version__,
                "device": f"{dev.platform}:{dev.device_kind}",
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
