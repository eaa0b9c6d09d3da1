"""The package's layering (``.importlinter`` at the repository root) holds: imports point downwards."""

from pathlib import Path

import pytest

importlinter_cli = pytest.importorskip("importlinter.cli")

CONFIG = Path(__file__).resolve().parents[1] / ".importlinter"


def test_import_contracts_hold(capsys):
    code = importlinter_cli.lint_imports(config_filename=str(CONFIG), no_cache=True)
    out = capsys.readouterr().out
    assert code == 0, out
