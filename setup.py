"""The two parts of the metadata that depend on where the repository lives (pyproject.toml lists them as dynamic).

- ``project_urls``: the repository's address, from GitHub Actions' ``$GITHUB_SERVER_URL``/``$GITHUB_REPOSITORY``
  (every job of the release workflow has them), else from ``git remote get-url origin``; none when neither says.
- the long description: README.md, its relative links made absolute against that address (PyPI shows the README
  away from the repository, where a link such as ``docs/own-trainer.md`` leads nowhere).

Everything else is in pyproject.toml.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from setuptools import setup

HERE = Path(__file__).resolve().parent


def repository_url() -> str | None:
    server, repo = os.environ.get("GITHUB_SERVER_URL"), os.environ.get("GITHUB_REPOSITORY")
    if server and repo:
        return f"{server}/{repo}"
    try:
        remote = subprocess.run(["git", "remote", "get-url", "origin"], cwd=HERE, capture_output=True, text=True,
                                timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.fullmatch(r"(?:https://|git@)(github\.com|gitlab\.com)[/:](.+?)(?:\.git)?/?", remote)
    return f"https://{m[1]}/{m[2]}" if m else None


def long_description(url: str | None) -> str:
    text = (HERE / "README.md").read_text()
    if not url:
        return text
    # ](path) and ](path#anchor) that are not absolute (http:, https:, mailto:) nor in-page (#...)
    return re.sub(r"\]\((?![a-z][a-z0-9+.-]*:|#)([^)\s]+)\)", lambda m: f"]({url}/blob/HEAD/{m[1]})", text)


def project_urls(url: str | None) -> dict[str, str]:
    if not url:
        return {}
    return {"Homepage": url, "Documentation": f"{url}#readme", "Source": url, "Issues": f"{url}/issues",
            "Changelog": f"{url}/releases"}


URL = repository_url()
URLS = project_urls(URL)

if __name__ == "__main__":  # setuptools' build backend runs this file as __main__; tests import its functions
    setup(long_description=long_description(URL), long_description_content_type="text/markdown", project_urls=URLS)
