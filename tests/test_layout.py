"""The package layout: imports run downward only, and core stays pure.

cli -> stream -> state -> index -> tar -> {io, core} -> errors: a module may import its
own package and any package to its right, never one to its left; ``io`` and ``core``
stand side by side, and neither imports the other (docs/architecture.md).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "wds_pad"
ORDER = ["cli", "stream", "state", "index", "tar", "io", "core", "errors"]
#: packages that stand side by side in ORDER: neither may import the other
PEERS = [frozenset({"io", "core"})]


def _layer(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != "wds_pad" or len(parts) < 2:
        return None
    return parts[1] if parts[1] in ORDER else None


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every wds_pad module ``path`` imports (top level or inside functions), absolute."""
    rel = path.relative_to(ROOT).with_suffix("")
    here = list(rel.parts)
    if here[-1] == "__init__":
        here = here[:-1]
    package = here if path.name == "__init__.py" else here[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            names = [target] + [f"{target}.{a.name}" for a in node.names]
            out += [(node.lineno, n) for n in names if n.startswith("wds_pad")]
        elif isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name.startswith("wds_pad")]
    return out


MODULES = sorted(p for p in PACKAGE.rglob("*.py") if p.parent != PACKAGE or p.name == "errors.py")


@pytest.mark.parametrize("path", MODULES, ids=[str(p.relative_to(PACKAGE)) for p in MODULES])
def test_imports_run_downward_only(path: Path) -> None:
    mine = _layer("wds_pad." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    assert mine is not None, f"{path} is not in a stage package"
    for line, target in _imports(path):
        theirs = _layer(target)
        if theirs is None or theirs == mine:
            continue
        assert frozenset({mine, theirs}) not in PEERS, (
            f"{path.relative_to(ROOT)}:{line} imports {target} ({theirs} and {mine} are peers: neither imports the other)")
        assert ORDER.index(theirs) > ORDER.index(mine), (
            f"{path.relative_to(ROOT)}:{line} imports {target} ({theirs} stands above {mine})")


def test_the_top_level_holds_only_the_api_errors_and_the_version() -> None:
    # __main__.py: `python -m wds_pad` (and `torchrun -m wds_pad index ...`) runs the CLI
    assert sorted(p.name for p in PACKAGE.glob("*.py")) == [
        "__init__.py", "__main__.py", "errors.py", "version.py"]


@pytest.mark.parametrize("name", ["errors.py", "version.py"])
def test_errors_and_version_import_nothing_of_ours(name: str) -> None:
    assert _imports(PACKAGE / name) == []


#: the most lines a module holds: past it, it holds two responsibilities
MAX_LINES = 450
EVERY = sorted(PACKAGE.rglob("*.py"))


@pytest.mark.parametrize("path", EVERY, ids=[str(p.relative_to(PACKAGE)) for p in EVERY])
def test_no_module_is_over_450_lines(path: Path) -> None:
    rel = path.relative_to(PACKAGE).as_posix()
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{rel} has {lines} lines: split it by responsibility (at most {MAX_LINES})"


#: packages already held to the project's 400 lines a module (the rest to MAX_LINES, meanwhile)
AT_400 = ("io", "index", "core")
HELD = sorted(p for name in AT_400 for p in (PACKAGE / name).rglob("*.py"))


@pytest.mark.parametrize("path", HELD, ids=[str(p.relative_to(PACKAGE)) for p in HELD])
def test_no_module_of_io_index_or_core_is_over_400_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= 400, f"{path.relative_to(PACKAGE).as_posix()} has {lines} lines: split it by responsibility"


INSIDE = sorted(p for p in PACKAGE.rglob("*.py") if p != PACKAGE / "__init__.py")


@pytest.mark.parametrize("path", INSIDE, ids=[str(p.relative_to(PACKAGE)) for p in INSIDE])
def test_no_module_imports_the_package_face(path: Path) -> None:
    # `from .. import X` resolving to wds_pad, `from wds_pad import X`, `import wds_pad`:
    # the face imports every stage, so a module inside that imports it imports upward
    for line, target in _imports(path):
        assert target != "wds_pad", (
            f"{path.relative_to(ROOT)}:{line} imports the package face (wds_pad/__init__.py); import the "
            "module that defines the name (wds_pad.version for __version__)")


BLOCKER = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name in BLOCKED or any(name.startswith(b + ".") for b in BLOCKED):
            raise ImportError(f"{name} is blocked: wds_pad.core must not import it")
BLOCKED = {"torch", "fsspec", "webdataset", "aiohttp", "s3fs"}
sys.meta_path.insert(0, Block())
import wds_pad.core.planning.plan, wds_pad.core.seed, wds_pad.core.topology, wds_pad.core.permute
from wds_pad import plan_epoch, Topology
plan = plan_epoch({"a": list(range(10))}, Topology(2, 1), seed=3, batch_size=2)
print(len(plan))
"""


def test_core_imports_and_plans_without_torch_or_fsspec() -> None:
    done = subprocess.run([sys.executable, "-c", BLOCKER], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "3"


CORE = sorted((PACKAGE / "core").rglob("*.py"))


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PACKAGE / "core")) for p in CORE])
def test_core_never_reads_the_clock(path: Path) -> None:
    # numpy itself imports time, so this is checked in the source rather than by blocking it
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
        for name in names:
            assert name.split(".")[0] not in {"time", "datetime", "random"}, (
                f"{path.name}:{node.lineno} imports {name}: the planner must not depend on the clock "
                "or a global RNG")


#: what only a reader prints (the reading cost of a plan, its shuffle quality): it sits
#: beside the commands that print it (cli/readfigures.py, cli/shufflequality.py), not
#: among the planners
REPORTING = {"figures", "node_figures", "LocalityFigures", "NodeFigures", "shuffle_quality",
             "difference_entropy"}


@pytest.mark.parametrize("path", CORE, ids=[str(p.relative_to(PACKAGE / "core")) for p in CORE])
def test_core_holds_planners_not_reports(path: Path) -> None:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            assert node.name not in REPORTING, (
                f"core/{path.relative_to(PACKAGE / 'core')}:{node.lineno} defines {node.name}, a report: it "
                "belongs beside the readers that print it (wds_pad/cli/)")


@pytest.mark.parametrize("old", ["wds_pad.plan", "wds_pad.dataset", "wds_pad.stages", "wds_pad.index.tarscan",
                                 "wds_pad.index.format", "wds_pad.buckets"])
def test_a_module_lives_at_one_path(old: str) -> None:
    # public names come from wds_pad itself; a module is imported from where it is
    import importlib

    with pytest.raises(ModuleNotFoundError):
        importlib.import_module(old)


#: the one module that reaches torch.distributed, and the CLI command that makes a group
DISTRIBUTED = {"core/collective.py", "cli/index.py"}


@pytest.mark.parametrize("path", EVERY, ids=[str(p.relative_to(PACKAGE)) for p in EVERY])
def test_torch_distributed_is_reached_through_core_collective(path: Path) -> None:
    rel = path.relative_to(PACKAGE).as_posix()
    if rel in DISTRIBUTED:
        return
    for node in ast.walk(ast.parse(path.read_text())):
        names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                 [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
        for name in names:
            assert not name.startswith("torch.distributed"), (
                f"{rel}:{node.lineno} imports {name}: reach the process group through "
                "wds_pad.core.collective (dist_for, all_gather, broadcast, default_store)")


#: the most imports deep a chain inside core runs (a module importing another only for
#: a type does so under ``if TYPE_CHECKING:``, which does not count)
MAX_CORE_DEPTH = 6


def _runtime_core_imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    typing_only = {id(x) for n in ast.walk(tree) if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test)
                   for b in n.body for x in ast.walk(b)}
    core = {".".join(p.relative_to(ROOT).with_suffix("").parts) for p in CORE}
    out = set()
    for line, target in _imports(path):
        while target and target not in core and "." in target:
            target = target.rsplit(".", 1)[0]
        if target in core and not target.endswith("__init__"):
            out.add(target)
    lines = {n.lineno for n in ast.walk(tree) if id(n) in typing_only and isinstance(n, (ast.Import, ast.ImportFrom))}
    return out - {t for line, t in _imports(path) if line in lines}


def test_core_imports_run_at_most_six_deep() -> None:
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in CORE if p.name != "__init__.py"}
    edges = {m: _runtime_core_imports(p) - {m} for m, p in mods.items()}
    memo: dict[str, list[str]] = {}

    def longest(m: str, seen: frozenset[str]) -> list[str]:
        if m not in memo:
            paths = [longest(d, seen | {m}) for d in edges[m] if d in mods and d not in seen]
            memo[m] = [m] + max(paths, key=len, default=[])
        return memo[m]

    chain = max((longest(m, frozenset()) for m in sorted(mods)), key=len)
    assert len(chain) - 1 <= MAX_CORE_DEPTH, (
        f"core's imports run {len(chain) - 1} deep ({' -> '.join(c.rsplit('.', 1)[1] for c in chain)}): import a "
        "module only for a type under `if TYPE_CHECKING:`, or hand a planner what it needs")


SIZINGS = {"Count", "Budget", "Pack"}


@pytest.mark.parametrize("path", EVERY, ids=[str(p.relative_to(PACKAGE)) for p in EVERY])
def test_no_module_forks_on_a_sizing_type(path: Path) -> None:
    # a sizing says what differs through its protocol (core/sizing.py); only as_sizing turns
    # a batch size into one
    if path.name == "sizing.py":
        return
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "isinstance" and len(node.args) == 2:
            named = {getattr(x, "id", getattr(x, "attr", None)) for x in ast.walk(node.args[1])}
            assert not named & SIZINGS, (
                f"{path.relative_to(ROOT)}:{node.lineno} forks on a sizing's type "
                f"({', '.join(sorted(named & SIZINGS))}): ask the sizing (kind, pad_unit, describe, summary) instead")
