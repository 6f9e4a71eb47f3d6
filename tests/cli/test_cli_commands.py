"""The shape of wds_pad.cli: app registers one module per command; the commands share
cli.common and never import app (nor each other), so the CLI has no import circle."""

from __future__ import annotations

import ast
from pathlib import Path

import wds_pad.cli.app as app

CLI = Path(app.__file__).resolve().parent
COMMANDS = ["plan", "demo", "index", "inspect", "verify"]


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
