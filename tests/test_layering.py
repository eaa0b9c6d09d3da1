"""The package's layering (``.importlinter`` at the repository root) holds: imports point downwards."""

import logging
from contextlib import contextmanager
from pathlib import Path

import pytest

importlinter_cli = pytest.importorskip("importlinter.cli")

CONFIG = Path(__file__).resolve().parents[1] / ".importlinter"


def test_import_contracts_hold(capsys):
    logging.getLogger("orbitflow")  # made here if no earlier test made it, so the last check holds alone too
    with _loggers_kept():
        code = importlinter_cli.lint_imports(config_filename=str(CONFIG), no_cache=True)
    out = capsys.readouterr().out
    assert code == 0, out
    assert not logging.getLogger("orbitflow").disabled  # later tests read its records


@contextmanager
def _loggers_kept():
    """import-linter configures its logging with ``logging.config.dictConfig``, whose default disables every logger
    that exists and is not its own: ``orbitflow``'s among them, so a later test in this process that reads
    orbitflow's log records saw none (tests/test_cli.py's, when it ran after this one). Their states come back."""
    loggers = [lg for lg in logging.Logger.manager.loggerDict.values() if isinstance(lg, logging.Logger)]
    disabled = [lg.disabled for lg in loggers]
    try:
        yield
    finally:
        for lg, was in zip(loggers, disabled):
            lg.disabled = was
