"""MkDocs hooks (``hooks:`` in mkdocs.yml): the site's home page is README.md itself, and its
changelog page CHANGELOG.md.

README.md links into ``docs/`` from the repository root; on the site those links are relative to
``docs/``. So the home page's source is README.md up to its "Docs" section (the site has its own
navigation), with ``](docs/`` made ``](``, and docs/index.md holds only what follows it. One text,
no copy to keep in step. docs/changelog.md is CHANGELOG.md the same way (its links are checked
by the strict build like any page's).
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
CHANGELOG = ROOT / "CHANGELOG.md"


def home_markdown(readme: str, tail: str) -> str:
    body = readme.split("\n## Docs\n", 1)[0].rstrip("\n")
    return body.replace("](docs/", "](") + "\n\n" + tail


def on_page_read_source(page, config):  # noqa: ANN001 (MkDocs' hook signature)
    if page.file.src_uri == "changelog.md":
        return CHANGELOG.read_text().replace("](docs/", "](")
    if page.file.src_uri != "index.md":
        return None
    tail = Path(page.file.abs_src_path).read_text()
    return home_markdown(README.read_text(), tail)
