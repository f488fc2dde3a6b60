"""Exit codes are a public contract: every error class has a documented code, and the README's
"Exit codes" table says exactly what ``errors.EXIT_CODES`` says (the CLI's --help epilog)."""

import re
from pathlib import Path

from drlcli import errors

README = Path(__file__).resolve().parents[1] / "README.md"


def test_every_error_class_has_a_documented_code():
    classes = [c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, errors.DrlError)]
    assert {c.exit_code for c in classes} <= set(errors.EXIT_CODES)
    assert len({c.kind for c in classes}) == len(classes)  # each kind names one class in --json output


def test_readme_exit_code_table_matches():
    section = README.read_text().split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    rows = dict(re.findall(r"^\| (\d+) \| (.+?) \|$", section, flags=re.MULTILINE))
    assert {int(code): text for code, text in rows.items()} == errors.EXIT_CODES
