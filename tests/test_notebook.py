"""examples/walkthrough.ipynb runs top to bottom in a fresh kernel on this test's Python, as a
user's kernel runs it: XLA's default compile (not the suite's -O0, tests/conftest.py) and no
compile cache, so that its timings are a user's. `WALKTHROUGH_SAVE=1 pytest tests/test_notebook.py`
writes it back with its outputs: the committed notebook's figures and timings are that run's.
"""

import os
from pathlib import Path

import nbclient
import nbformat

NOTEBOOK = Path(__file__).parent.parent / "examples" / "walkthrough.ipynb"
SAVE = os.environ.get("WALKTHROUGH_SAVE") == "1"


def images(cell) -> int:
    return sum(
        "image/png" in out.get("data", {}) or "image/gif" in out.get("data", {})
        for out in cell.outputs
    )


def test_walkthrough_runs_top_to_bottom_in_a_fresh_kernel(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    environment = dict(os.environ)
    environment.pop("JAX_COMPILATION_CACHE_DIR", None)
    flags = environment.get("XLA_FLAGS", "").split()
    environment["XLA_FLAGS"] = " ".join(flag for flag in flags if "optimization_level" not in flag)
    environment["XDG_CACHE_HOME"] = str(tmp_path)  # the CLI run's own cache, not the user's
    client = nbclient.NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",  # jupyter_client starts it with this process's sys.executable
        resources={"metadata": {"path": str(NOTEBOOK.parent)}},  # as Jupyter opens it
    )
    client.execute(env=environment)  # raises CellExecutionError on any cell's error
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(cell.outputs for cell in code)  # every cell shows something
    assert sum(images(cell) for cell in code) == 5  # 4 plots and the GIF
    if SAVE:
        nbformat.write(notebook, NOTEBOOK)


def test_committed_notebook_has_its_outputs():
    """The notebook reads on a repository host without running it: every code cell was run, in
    order, and shows its output."""
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert [cell.execution_count for cell in code] == list(range(1, len(code) + 1))
    assert all(cell.outputs for cell in code)
    assert not [out for cell in code for out in cell.outputs if out.output_type == "error"]
    assert sum(images(cell) for cell in code) == 5
