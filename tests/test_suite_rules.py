"""Rules of the test suite itself."""

from __future__ import annotations

import re
from pathlib import Path

TESTS = Path(__file__).parent


def test_no_test_module_imports_a_conftest():
    """tests/conftest.py and tests/trl19/conftest.py are both `conftest`: collected together, an import of it gets
    whichever pytest loaded last. Shared constants and helpers live in fixtures or ordinary modules."""
    pattern = re.compile(r"^\s*(from\s+conftest\s+import|import\s+conftest\b)", re.M)
    offenders = [str(p.relative_to(TESTS)) for p in sorted(TESTS.rglob("*.py"))
                 if p.name != "conftest.py" and pattern.search(p.read_text())]
    assert offenders == []
