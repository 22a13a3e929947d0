"""docs/reference.md's one table (doctables/reference.py) holds every option and every environment variable: the
plugin's options and the CLI's are read from their parsers; the environment variables from a scan of the package
(every ``os.environ`` / ``os.getenv`` access). The scan itself is checked on code written for it, so a new way of
reading the environment cannot slip past it unseen (issue 49: four variables the code read were documented nowhere)."""

import ast
import os
import re
from pathlib import Path

import pytest

from doctables.options import cli_subcommands, plugin_options
from doctables.reference import ENVIRONMENT, KINDS, environment_problems, scan_environment, table

ROOT = Path(__file__).resolve().parent.parent
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
LITERAL_ACCESS = re.compile(r"""(?:environ(?:\.get|\.pop|\.setdefault)?\(|environ\[|getenv\()"""
                            r"""\s*["']([A-Z][A-Z0-9_]+)["']""")


@pytest.fixture(scope="module")
def found() -> dict[str, set[str]]:
    return scan_environment()  # parses every module of the package: once


def test_every_environment_variable_the_code_uses_has_words(found):
    assert environment_problems(found) == []


def test_every_environment_access_is_found_by_the_scan(found):
    """Independently of the scan's resolution: every string constant an ``os.environ`` / ``getenv`` line names."""
    literal = set()
    for f in (ROOT / "pytest_rlhfmem").rglob("*.py"):
        for line in f.read_text().splitlines():
            if re.search(r"os\.environ|getenv\(", line) and not line.lstrip().startswith("#"):
                literal |= set(LITERAL_ACCESS.findall(line))
    assert literal and literal <= set(found), sorted(literal - set(found))
    assert {"RLHFMEM_CACHE_DIR", "RLHFMEM_SNAPSHOTS_DIR", "RLHFMEM_HISTORY_MAX_ENTRIES", "RLHFMEM_HISTORY_CONTEXT",
            "CUDA_VISIBLE_DEVICES", "CXX", "RLHFMEM_CAPTURE_DIR", "RLHFMEM_RECORDER_LIBRARY"} <= set(found)


def test_the_launchers_variables_are_marked_internal(found):
    for name in found:
        if name.startswith(("RLHFMEM_CAPTURE_", "RLHFMEM_RUN_")) or name.endswith("_LIBRARY"):
            assert ENVIRONMENT[name][0] == "internal", name
    assert all(kind in KINDS for kind, _ in ENVIRONMENT.values())


def test_the_table_has_every_option_subcommand_and_variable(found):
    rows = table(found)
    text = "\n".join(rows)
    for o in plugin_options():
        assert f"`{o['flag']}" in text and f"ini `{o['dest']}`" in text
    for sub in cli_subcommands():
        assert f"`rlhfmem {sub}`" in text or sub in {"help"}, sub
    for name in found:
        assert f"`${name}" in text, name
    assert "<!-- generated: python -m doctables.reference -->" in REFERENCE


def test_the_scan_resolves_constants_imports_aliases_and_mappings(tmp_path, monkeypatch):
    pkg = tmp_path / "pytest_rlhfmem"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "names.py").write_text('ENV_A = "RLHFMEM_A"\nPREFIX = "RLHFMEM_TOKEN_"\n')
    (pkg / "sub" / "reader.py").write_text(
        "import os\nfrom ..names import ENV_A, PREFIX\nfrom .. import names as N\n"
        "def f(env=None, token='x'):\n"
        "    e = os.environ\n"
        "    a = os.environ.get(ENV_A)\n"
        "    b = e.get('RLHFMEM_B')\n"
        "    c = os.getenv('RLHFMEM_C')\n"
        "    d = 'RLHFMEM_D' in os.environ\n"
        "    run_env = dict(os.environ, RLHFMEM_E='1')\n"
        "    run_env['RLHFMEM_F'] = '1'\n"
        "    run_env.update({N.ENV_A: '2'})\n"
        "    child = {**(env or {}), PREFIX + token: '1'}\n"
        "    os.environ.setdefault('RLHFMEM_G', '1')\n"
        "    return a, b, c, d, child, {'not_an_env_key': 1}\n")
    monkeypatch.setattr("doctables.reference.ROOT", tmp_path)
    found = scan_environment(pkg)
    assert set(found) == {"RLHFMEM_A", "RLHFMEM_B", "RLHFMEM_C", "RLHFMEM_D", "RLHFMEM_E", "RLHFMEM_F", "RLHFMEM_G",
                          "RLHFMEM_TOKEN_"}
    assert found["RLHFMEM_A"] == {"pytest_rlhfmem.sub.reader"}
    (pkg / "sub" / "bad.py").write_text("import os\ndef g(name):\n    return os.environ.get(name)\n")
    with pytest.raises(ValueError, match=r"bad\.py:3: an environment access whose name is not a constant"):
        scan_environment(pkg)


def test_the_table_cells_escape_pipes_and_keep_code_spans():
    from doctables.reference import _cell

    assert _cell("a | b <x> `c<d>`") == "a \\| b &lt;x&gt; `c<d>`"
    assert ast.parse("x = 1") and os.sep  # the modules the scan needs are the standard library's
