"""Every table the README and docs restate from committed budgets, recorded runs, the plugin's own option table or a
file of the checkout is generated: a block fenced by ``<!-- generated: COMMAND -->`` ... ``<!-- end generated -->``
must be exactly what COMMAND prints now (the generators are in doctables/). A block edited by hand fails here; after a
budget update, rerun the command and paste its output."""

import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"<!-- generated: (?P<cmd>.+?) -->\n(?P<body>.*?)\n<!-- end generated -->", re.S)
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
BLOCKS = [(doc, m["cmd"], m["body"]) for doc in DOCS for m in FENCE.finditer(doc.read_text())]


def test_the_readme_and_docs_have_generated_tables():
    assert {doc.name for doc, _, _ in BLOCKS} >= {"README.md", "methods.md", "cpu-path.md", "study-scale.md",
                                                  "reports.md", "diff-flush-none-vs-after-inference.md"}
    assert len(BLOCKS) >= 11


@pytest.mark.parametrize(("doc", "cmd", "body"), BLOCKS,
                         ids=[f"{d.name}:{' '.join(c.split()[2:])}" for d, c, _ in BLOCKS])
def test_a_generated_table_is_what_its_command_prints(doc, cmd, body):
    argv = shlex.split(cmd)
    assert argv[0] == "python", f"{doc.name}: a generated block's command starts with python: {cmd!r}"
    done = subprocess.run([sys.executable, *argv[1:]], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, f"{doc.name}: '{cmd}' exited {done.returncode}: {done.stderr[-2000:]}"
    out = done.stdout
    assert body == out.rstrip("\n"), f"{doc.name}: the table under '{cmd}' is stale; rerun it and paste its output"
