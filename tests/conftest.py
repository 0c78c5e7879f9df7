"""One JAX compilation cache for the whole test session, as a user's runs share theirs.

Many tests compile the same small programs: in-process, in the scripts they start as
subprocesses, and on each pytest-xdist worker. With one persistent cache (a fresh folder per
session, removed at its end; `JAX_COMPILATION_CACHE_DIR` set beforehand is used instead and kept)
a program compiled once is loaded everywhere else. The thresholds are 0 so that small CPU
programs are stored too. The cache has no size bound: with one, JAX locks the folder for every
read and write and, on every write, reads the size and last use of every entry to choose what to
drop (at the 2,000 entries a suite leaves, 154 ms a write, every process waiting on the lock).
Without it an entry is written unlocked; a process that reads one half-written gets a read error
that JAX catches, and compiles the program itself. Tests of the cache itself give their own folder.
"""

import atexit
import contextlib
import io
import os
import shutil
import subprocess
import sys
import tempfile
import traceback

import pytest

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:  # the controller's, inherited by its workers
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="jax-cache-tests-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
# LLVM at -O0 for the suite (XLA's default: -O3): the same programs (the same HLO) compile in
# about 40% less CPU time; tiny programs run about as fast, long ones 2-3x slower, so the learning
# tests compile with XLA's own setting (XLA_DEFAULT, below), as their bars were measured.
# Subprocesses inherit the flag, so runs that tests compare bit for bit are compiled alike. (XLA's
# older fusion emitters would compile quicker still, but break the bit-for-bit equality of an env's
# step compiled in two programs, which tests check.)
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (
        f"{os.environ.get('XLA_FLAGS', '')} --xla_backend_optimization_level=0"
    )
XLA_DEFAULT = {"xla_backend_optimization_level": 3}  # jax.jit's compiler_options, XLA's own -O3


def forced_cpu_devices(count: int) -> dict:
    """The environment for a subprocess on `count` CPU devices, compiled as the suite compiles."""
    return {
        "XLA_FLAGS": f"{os.environ['XLA_FLAGS']} --xla_force_host_platform_device_count={count}"
    }


def in_process(module, *flags: str) -> tuple[int, str, str]:
    """`python <script>.py flags` in this process up to its exit, with nothing compiled on the way
    (jax.jit unset): for --help and the flags that are refused. The status, stdout and stderr. The
    compile cache is left off, so that this process's jax.config stays as the suite set it."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(module.jax, "jit", None)
        patch.setattr(module, "enable_compile_cache", lambda options: "off (in process)")
        result = run_script(module, *flags)
    return result.returncode, result.stdout, result.stderr


def run_script(module, *flags: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python <script>.py flags` to its exit: the status, stdout and stderr. In this process, as
    the scripts' own main (about 2 s of a new process's start-up saved per run), unless `env`
    changes the environment (devices, a cache folder), which only a new process reads. In process
    the run compiles as the suite does and its cache is the suite's, as a subprocess's would be."""
    command = [sys.executable, module.__file__, *flags]
    if env is not None:
        environment = {**os.environ, **env}
        return subprocess.run(command, capture_output=True, text=True, timeout=300, env=environment)
    out, err, status = io.StringIO(), io.StringIO(), None
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            module.main(*module.parse_args(list(flags)))
        except SystemExit as exit_:
            status = exit_.code
        except Exception:  # a crash: its traceback on stderr and status 1, as Python ends a process
            traceback.print_exc()
            status = 1
        finally:  # a new process would start without the last run's compiled renderer
            module.jitted_render.cache_clear()
        if isinstance(status, str):  # sys.exit("message"): Python prints it, and the status is 1
            print(status, file=sys.stderr)
            status = 1
    return subprocess.CompletedProcess(command, status or 0, out.getvalue(), err.getvalue())
