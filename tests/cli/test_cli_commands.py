"""The shape of wds_pad.cli: app registers one module per command; the commands share
cli.common (and cli.plot) and never import app (nor each other), so the CLI has no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import wds_pad.cli.app as app

CLI = Path(app.__file__).resolve().parent
COMMANDS = ["plan", "demo", "index", "inspect", "verify", "simulate"]


def _cli_imports(path: Path) -> set[str]:
    """The wds_pad.cli modules ``path`` imports (relative or absolute, anywhere in it)."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            out |= {node.module} if node.module else {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("wds_pad.cli."):
            out.add(node.module.split(".")[2])
    return out


def test_app_registers_one_module_per_command_in_help_order() -> None:
    assert [m.__name__.rpartition(".")[2] for m in app.COMMANDS] == COMMANDS
    sub = next(a for a in app.build_parser()._actions if a.dest == "command")
    assert list(sub.choices) == COMMANDS


def test_commands_import_common_never_app_nor_each_other() -> None:
    for name in COMMANDS:
        imported = _cli_imports(CLI / f"{name}.py")
        assert "app" not in imported and not imported & (set(COMMANDS) - {name}), (name, imported)
    assert _cli_imports(CLI / "common.py") == set()
    assert _cli_imports(CLI / "plot.py") == {"common"}


# -- what the commands share: the order of buckets in tables and plots ----------------------
def test_aspect_buckets_are_ordered_by_ratio_not_as_strings() -> None:
    from wds_pad.cli.common import bucket_order

    assert bucket_order(["16:9", "1:1", "1:2", "4:3", "9:16", "3:4"]) == ["1:2", "9:16", "3:4", "1:1", "4:3", "16:9"]
    assert bucket_order(["2:1", "21:9", "10:1", "1:10"]) == ["1:10", "2:1", "21:9", "10:1"]
    assert bucket_order(["4:2", "2:1"]) == ["4:2", "2:1"]  # equal ratios keep the canonical order
    assert bucket_order(["16:9", "other", "1:1"]) == ["16:9", "other", "1:1"]  # not all ratios: as given
    assert bucket_order([3, 1, 2]) == [3, 1, 2] and bucket_order(["1:0", "1:1"]) == ["1:0", "1:1"]
    assert bucket_order([]) == []


def test_demo_lists_buckets_by_ratio(tmp_path, capsys, monkeypatch) -> None:
    import matplotlib.axes

    import wds_pad.cli.app as cli_app

    ticks: list[list[str]] = []
    real = matplotlib.axes.Axes.set_xticks
    monkeypatch.setattr(matplotlib.axes.Axes, "set_xticks",
                        lambda self, x, labels=None, **kw: ticks.append(list(labels)) or real(self, x, labels, **kw))
    assert cli_app.main(["demo", "--out", str(tmp_path), "--samples", "120"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if ln.startswith("2. indexed into"))
    listed = [kv.split("=")[0] for kv in line.split(": ", 1)[1].split(", ")]
    table = [ln.split()[1] for ln in out.splitlines() if ln.startswith("images ")]
    ratio = [float(w) / float(h) for w, h in (k.split(":") for k in listed)]
    assert len(listed) >= 4 and ratio == sorted(ratio)
    assert table == listed and ticks == [listed]
