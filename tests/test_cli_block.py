"""What the four training scripts share: the command-line block below the banner is one block
(what differs is the script's constants and validation rules), and it behaves the same."""

import itertools
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ["sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake"]
BANNER = "# ---- command line: nothing below changes what is learned ----"
BUDGET = 550  # lines from the banner to the end


def shared_block(script: str) -> str:
    """The block below the banner without what each script has of its own: its constants (the
    metric columns, the evaluation episodes, the solved bar), its validate(), and sac_cartpole's
    parse_args() (the defaults of the --env-id task)."""
    text = (ROOT / f"{script}.py").read_text()
    assert text.count(BANNER) == 1
    block = text.split(BANNER)[1]
    block = re.sub(r"^LOSS_COLUMNS = .*?(?=^# ---- options)", "", block, flags=re.S | re.M)
    return re.sub(r"^def (validate|parse_args)\(.*?(?=^\S)", "", block, flags=re.S | re.M)


def test_each_block_is_within_its_line_budget():
    """SCRIPT_CONTRACT.md section 9: the block below the banner is one a reader skims."""
    for script in SCRIPTS:
        text = (ROOT / f"{script}.py").read_text()
        assert len(text.split(BANNER)[1].splitlines()) <= BUDGET, script


@pytest.mark.parametrize("first, second", list(itertools.combinations(SCRIPTS, 2)))
def test_the_command_line_block_is_one_block(first, second):
    """A fix made in one script's block has to reach the others."""
    assert shared_block(first) == shared_block(second)


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_into_a_pipe_that_closes_early_ends_quietly(script):
    result = subprocess.run(
        f'"{sys.executable}" "{ROOT / script}.py" --help | head -1',
        shell=True,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.stdout.startswith("usage:")
    assert "Traceback" not in result.stderr, result.stderr
