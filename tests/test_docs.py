"""The documentation keeps to the code: every relative link in the README, CONTRIBUTING.md and
docs/ resolves (the file, and the heading an anchor names), every command line they show parses
and passes the script's own checks, the README's Python snippet runs, and ruff is clean."""

import importlib
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", *(ROOT / "docs").rglob("*.md")])
SCRIPTS = ("sac_pendulum", "sac_cartpole", "ppo_cartpole", "ppo_snake")
SHELL_OPERATORS = {"&", "&&", "|", "||", ";", ">", "2>&1"}


def anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces as '-',
    a repeated heading numbered (-1, -2, ...)."""
    seen: dict[str, int] = {}
    found = set()
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # no headings in code
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    targets = re.findall(r"\]\(([^)\s]+)\)", text) + re.findall(r'src="([^"]+)"', text)
    return [target for target in targets if not re.match(r"[a-z]+:", target)]  # not http(s):


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_resolves(page):
    broken = []
    for target in links(page):
        path, _, anchor = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists() or anchor and anchor not in anchors(resolved):
            broken.append(target)
    assert not broken, broken


def test_the_link_check_can_fail(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# A title\n## Twice\n## Twice\n[a](page.md#a-title) [b](page.md#twice-1)\n")
    assert links(page) == ["page.md#a-title", "page.md#twice-1"]
    assert anchors(page) == {"a-title", "twice", "twice-1"}
    assert "missing" not in anchors(page) and not (tmp_path / "gone.md").exists()


def command_lines() -> list[tuple[str, str, list[str]]]:
    """(page, script, flags) of every `python <script>.py ...` line in a bash block."""
    found = []
    for page in PAGES:
        for block in re.findall(r"```bash\n(.*?)```", page.read_text(), flags=re.S):
            for line in block.replace("\\\n", " ").splitlines():
                words = shlex.split(line, comments=True)
                for script in SCRIPTS:
                    if f"{script}.py" in words and "--help" not in words:
                        flags = words[words.index(f"{script}.py") + 1 :]
                        ends = [i for i, word in enumerate(flags) if word in SHELL_OPERATORS]
                        flags = flags[: min(ends, default=len(flags))]
                        found.append((str(page.relative_to(ROOT)), script, flags))
    return found


@pytest.mark.parametrize("page, script, flags", command_lines())
def test_every_command_line_shown_parses_and_passes_the_scripts_checks(page, script, flags):
    module = importlib.import_module(script)
    config, options = module.parse_args(flags)
    module.validate(config)
    module.check_options(options)
    module.sweep_grid(config)


def test_the_readmes_python_snippet_runs():
    """The README's vmap snippet, shortened to 2 seeds of one chunk (4,000 env steps) each."""
    readme = (ROOT / "README.md").read_text()
    (snippet,) = [
        block
        for block in re.findall(r"```python\n(.*?)```", readme, flags=re.S)
        if "jax.vmap(train)" in block
    ]
    snippet = snippet.replace("Config()", "Config(total_timesteps=4_000)")
    snippet = snippet.replace("jax.random.key(0), 16)", "jax.random.key(0), 2)")
    result = subprocess.run(
        [sys.executable, "-c", snippet], cwd=ROOT, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "(2, 1)", result.stdout


def test_ruff_format_and_check_are_clean():
    ruff = [sys.executable, "-m", "ruff"]
    for command in (["format", "--check", "."], ["check", "."]):
        result = subprocess.run([*ruff, *command], cwd=ROOT, capture_output=True, text=True)
        assert result.returncode == 0, result.stdout + result.stderr
