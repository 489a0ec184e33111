"""The operator reference lists every registered operator (docs match the code)."""
from pathlib import Path

from ktinject.operators import registry

DOC = Path(__file__).resolve().parents[1] / "docs" / "operators.md"


def test_every_registered_operator_has_a_row():
    text = DOC.read_text()
    table = text[text.index("<!-- OPERATOR TABLE"):text.index("<!-- END OPERATOR TABLE -->")]
    rows = [line.split("|")[1].strip().strip("`") for line in table.splitlines() if line.startswith("| `")]
    assert rows == sorted(rows)
    assert set(rows) == set(registry.names())
