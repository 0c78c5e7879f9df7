"""The pinned requirements cannot drift from their human-written lists: every direct dependency in
requirements*.in (floors) is pinned with == in the compiled requirements*.txt, within its floor;
the compiled files pin every package they install; requirements.txt and requirements-dev.txt
agree on every package they share; and the README's GPU line names the pinned jax."""

import re
from pathlib import Path

import pytest
from packaging.version import Version

REPO = Path(__file__).resolve().parents[1]
# The compiled file of each human-written list (docs/versions.md has the commands).
COMPILED = {"requirements.in": "requirements.txt", "requirements-dev.in": "requirements-dev.txt"}
FLOOR = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)\s*>=\s*([0-9]+(?:\.[0-9]+)*)$")
# An exact version, a pre- or post-release's too (wandb pulls certifi 2026.10.19.post1, betas)
PIN = re.compile(
    r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9]+(?:\.[0-9]+)*(?:(?:a|b|rc|\.post)[0-9]+)?)$"
)


def normalize(name: str) -> str:
    """A package name as pip compares it (PEP 503): Flax, flax and FLAX are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def lines(path: Path) -> list[str]:
    """The requirement lines of a requirements file, comments and blank lines dropped."""
    stripped = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in stripped if line]


def floors(path: Path) -> dict[str, tuple[int, ...]]:
    """The direct dependencies of a human-written .in file, the files it includes with -r too:
    name -> floor. Each must be `name>=version`, a floor only."""
    found: dict[str, tuple[int, ...]] = {}
    for line in lines(path):
        if line.startswith("-r "):
            found |= floors(path.parent / line[3:].strip())
            continue
        match = FLOOR.match(line)
        assert match, f"{path.name}: {line!r} is not a floor `name>=version`"
        found[normalize(match[1])] = tuple(int(part) for part in match[2].split("."))
    return found


def pins(path: Path) -> dict[str, str]:
    """The packages of a compiled file: name -> version. Every line must be `name==version`."""
    found: dict[str, str] = {}
    for line in lines(path):
        match = PIN.match(line)
        assert match, f"{path.name}: {line!r} is not an exact pin `name==version`"
        name = normalize(match[1])
        assert name not in found, f"{path.name}: {name} is pinned twice"
        found[name] = match[2]
    return found


def unpinned(source: Path, compiled: Path) -> list[str]:
    """The direct dependencies of `source` that `compiled` misses or pins below their floor."""
    pinned = pins(compiled)
    wrong = []
    for name, floor in floors(source).items():
        if name not in pinned:
            wrong.append(f"{name} is not pinned in {compiled.name}")
        elif Version(pinned[name]).release < floor:
            wrong.append(f"{name}=={pinned[name]} in {compiled.name} is below its floor")
    return wrong


@pytest.mark.parametrize("source", sorted(COMPILED))
def test_every_direct_dependency_is_pinned_in_its_compiled_file(source: str) -> None:
    assert unpinned(REPO / source, REPO / COMPILED[source]) == []


def test_the_run_time_dependencies_are_pinned_in_the_test_set_too() -> None:
    assert unpinned(REPO / "requirements.in", REPO / "requirements-dev.txt") == []


def test_the_test_set_holds_the_run_time_set_at_the_same_versions() -> None:
    run_time, test = pins(REPO / "requirements.txt"), pins(REPO / "requirements-dev.txt")
    assert {name: test.get(name) for name in run_time} == run_time


@pytest.mark.parametrize("source", sorted(COMPILED))
def test_each_compiled_file_says_how_to_regenerate_it(source: str) -> None:
    header = (REPO / COMPILED[source]).read_text().split("\n", 2)[:2]
    assert header[1].startswith("#    uv pip compile " + source), header


def test_the_readme_gpu_line_names_the_pinned_jax() -> None:
    jax = pins(REPO / "requirements.txt")["jax"]
    readme = (REPO / "README.md").read_text()
    extras = re.findall(r"jax\[cuda\d+\](?:==[0-9.]+)?", readme)
    assert extras, "the README names no jax[cudaNN] install"
    assert all(extra.endswith(f"]=={jax}") for extra in extras), (extras, jax)


def test_a_drifted_compiled_file_is_caught(tmp_path: Path) -> None:
    """The check can fail: a dependency missing from the compiled file, or pinned below its floor,
    or a range instead of a pin, is reported."""
    (tmp_path / "base.in").write_text("jax>=0.10.2  # why\n")
    (tmp_path / "dev.in").write_text("-r base.in\npytest>=9.0\n")
    (tmp_path / "dev.txt").write_text("jax==0.10.1\n    # via -r base.in\n")
    assert unpinned(tmp_path / "dev.in", tmp_path / "dev.txt") == [
        "jax==0.10.1 in dev.txt is below its floor",
        "pytest is not pinned in dev.txt",
    ]
    (tmp_path / "dev.txt").write_text("jax>=0.10.2\npytest==9.2.0\n")
    with pytest.raises(AssertionError, match="not an exact pin"):
        unpinned(tmp_path / "dev.in", tmp_path / "dev.txt")
