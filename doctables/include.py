"""A file of the checkout as a fenced block, so a doc that shows it (the README's CI workflows) shows it exactly.

    python -m doctables.include examples/github-actions/own-trainer.yml
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LANGUAGES = {".yml": "yaml", ".yaml": "yaml", ".py": "python", ".ini": "ini", ".toml": "toml"}


def main(argv: list[str]) -> int:
    if len(argv) != 1 or not (ROOT / argv[0]).is_file():
        print("usage: python -m doctables.include PATH (a file of the checkout)", file=sys.stderr)
        return 2
    path = ROOT / argv[0]
    print(f"```{LANGUAGES.get(path.suffix, '')}\n{path.read_text().rstrip()}\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
