"""The plugin's options, read from a real pytest parser with the plugin registered, and the CLI's subcommands, read
from its own argparse parser: the options of docs/reference.md, and what tests/test_docs.py holds every doc against.

    python -m doctables.options          # the plugin's options (flag, default, meaning); docs/reference.md has them all
"""

from __future__ import annotations

import argparse
import sys


def plugin_options() -> list[dict]:
    """Each option of the plugin's group: ``{"flag", "dest", "default", "help", "choices"}``, in registration order;
    the default is the ini twin's (what applies when neither the command line nor the ini file sets it)."""
    from _pytest.config import get_config

    config = get_config()
    config.pluginmanager.import_plugin("pytest_rlhfmem.plugin")  # pytest_addoption is historic: runs on register
    parser = config._parser
    (group,) = [g for g in parser._groups if g.name == "rlhfmem"]
    out = []
    for opt in group.options:
        attrs = opt.attrs()
        dest = attrs["dest"]
        default = parser._inidict[dest][2] if dest in parser._inidict else attrs.get("default")
        out.append({"flag": opt.names()[0], "dest": dest, "default": default, "help": attrs.get("help", ""),
                    "choices": tuple(attrs.get("choices") or ())})
    return out


def cli_subcommands() -> set[str]:
    """The subcommands ``rlhfmem`` accepts, from the parser ``pytest_rlhfmem.cli`` builds."""
    from pytest_rlhfmem.cli import build_parser

    (sub,) = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return set(sub.choices)


def _default(o: dict) -> str:
    d = o["default"]
    if d in (None, "", False):
        return "off" if d is False else "-"
    return f"{d:g}" if isinstance(d, float) else str(d)


def options_table() -> list[str]:
    rows = ["| option | default | meaning |", "|---|---|---|"]
    for o in plugin_options():
        flag = o["flag"] + ("={" + ",".join(o["choices"]) + "}" if o["choices"] else "")
        meaning = o["help"].replace("<", "&lt;").replace(">", "&gt;").replace("|", "\\|")
        rows.append(f"| `{flag}` | {_default(o)} | {meaning} |")
    return rows


def main(argv: list[str]) -> int:
    if argv:
        print("usage: python -m doctables.options", file=sys.stderr)
        return 2
    print("\n".join(options_table()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
