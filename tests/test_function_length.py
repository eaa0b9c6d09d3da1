"""House rule (issue 15): no function in src/ runs over 60 lines unless a ``NOTE: kept whole`` comment in its
body says why it must stay whole (e.g. a numba hot loop)."""

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "orbitflow"
MAX_LINES = 60


def long_functions(root: Path) -> list[str]:
    found = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        lines = text.splitlines()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                length = node.end_lineno - node.lineno + 1
                body = "\n".join(lines[node.lineno - 1:node.end_lineno])
                if length > MAX_LINES and "NOTE: kept whole" not in body:
                    found.append(f"{path.relative_to(root.parent)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_over_60_lines_without_a_reason():
    assert long_functions(SRC) == []


def test_the_rule_catches_a_long_function(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES))
    (tmp_path / "long.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "kept.py").write_text(f"def g():\n    # NOTE: kept whole: a test\n{body}\n")
    assert [f.split()[1] for f in long_functions(tmp_path)] == ["f"]
