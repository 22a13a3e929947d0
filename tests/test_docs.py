"""The docs check (issue 39): everything README.md and docs/ name exists. Every relative link resolves (a file of the
checkout, and a ``#anchor`` into a markdown file names one of its headings); every ``tox -e NAME`` is an environment
of tox.ini; every ``--rlhfmem-*`` / ``--gpu-marker`` option is one the plugin registers (read from a real pytest
parser: doctables/options.py); every ``rlhfmem SUBCOMMAND`` in code is one the CLI's own parser accepts."""

import configparser
import re
from pathlib import Path

import pytest

from doctables.options import cli_subcommands, plugin_options

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "docs").glob("*/README.md"))]
IDS = [str(d.relative_to(ROOT)) for d in DOCS]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
OPTION = re.compile(r"(?<![\w-])(--(?:rlhfmem-[a-z0-9-]*[a-z0-9]|gpu-marker))")
COMMAND = re.compile(r"(?:`|^\s*(?:\$ )?)rlhfmem ([a-z][a-z-]*)", re.M)  # in inline code, or a command line


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation other than '-' and '_' dropped, spaces to '-'."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def _prose(text: str) -> str:
    return re.sub(r"```.*?```", "", text, flags=re.S)  # fenced blocks hold no links or headings


def _tox_envs() -> set[str]:
    cp = configparser.ConfigParser(interpolation=None)
    cp.read(ROOT / "tox.ini")
    return {s.split(":", 1)[1] for s in cp.sections() if s.startswith("testenv:")} | {"py"}


def bad_links(doc: Path, base: Path | None = None) -> list[str]:
    """``base``: the directory the doc's relative links start from (the doc's own by default)."""
    base = base or doc.parent
    out = []
    for target in LINK.findall(_prose(doc.read_text())):
        if re.match(r"[a-z]+:", target):
            continue  # https:, mailto:
        path, _, anchor = target.partition("#")
        dest = (base / path).resolve() if path else doc
        if not dest.exists() or (path and ROOT.resolve() not in dest.parents):
            out.append(f"{target}: no such file in the checkout")
        elif anchor and dest.suffix == ".md" and anchor not in {
                slug(h) for h in re.findall(r"^#+ (.+)$", _prose(dest.read_text()), re.M)}:
            out.append(f"{target}: {dest.name} has no such heading")
    return out


def bad_tox_envs(doc: Path) -> list[str]:
    envs = _tox_envs()
    return [env for names in re.findall(r"tox -e ([\w,.-]+)", doc.read_text())
            for env in names.strip(".,").split(",") if env not in envs]


def bad_options(doc: Path) -> list[str]:
    flags = {o["flag"] for o in plugin_options()}
    return [opt for opt in OPTION.findall(doc.read_text()) if opt not in flags]


def bad_commands(doc: Path) -> list[str]:
    commands = cli_subcommands()
    return [sub for sub in COMMAND.findall(doc.read_text()) if sub not in commands]


CHECKS = {"link": bad_links, "tox environment": bad_tox_envs, "option": bad_options, "rlhfmem subcommand": bad_commands}


@pytest.mark.parametrize("check", CHECKS)
@pytest.mark.parametrize("doc", DOCS, ids=IDS)
def test_everything_a_doc_names_exists(doc, check):
    assert CHECKS[check](doc) == [], f"{doc.relative_to(ROOT)}: {check}s that do not exist"


def test_the_docs_are_found_and_name_things():
    assert len(DOCS) >= 15
    text = "".join(d.read_text() for d in DOCS)
    assert len(LINK.findall(text)) >= 40 and len(OPTION.findall(text)) >= 30 and len(COMMAND.findall(text)) >= 30


def test_each_check_fails_on_what_does_not_exist(tmp_path):
    bad = tmp_path / "bad.md"  # its links read as if it were in docs/
    bad.write_text("# One heading\n\nSee [the page](no-such-page.md), [a heading](advise.md#no-such-heading),\n"
                   "[here](#one-heading) and [advise](advise.md#premise-check). Run `tox -e no-such-env` or\n"
                   "`tox -e lint`, pass `--rlhfmem-no-such-option` or `--rlhfmem-json`, then `rlhfmem frobnicate`\n"
                   "and `rlhfmem diff`.\n\n    rlhfmem nosuch out.json\n")
    assert bad_links(bad, ROOT / "docs") == ["no-such-page.md: no such file in the checkout",
                                             "advise.md#no-such-heading: advise.md has no such heading"]
    assert bad_tox_envs(bad) == ["no-such-env"]
    assert bad_options(bad) == ["--rlhfmem-no-such-option"]
    assert bad_commands(bad) == ["frobnicate", "nosuch"]
    assert slug("Speed (measured 2026-11-22: load 1.3-2.4)") == "speed-measured-2026-11-22-load-13-24"
