"""Citations of the docs in code comments and pages: `PAGE.md, "Section title"` names a section that
PAGE has (comments cite design pages by section title, not by number), and every docs/ page named
exists."""

from __future__ import annotations

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[2]
SOURCES = [*REPO.glob("csrc/**/*.[ch]*"), *REPO.glob("csrc/**/*.cu*"), *REPO.glob("python/**/*.py"),
           *REPO.glob("benchmarks/*.py"), *REPO.glob("tests/**/*.py"), *REPO.glob("docs/*.md"), REPO / "README.md"]
CITATION = re.compile(r"([\w-]+\.md)(?:#[\w-]+)?\)?, \"([^\"]+)\"")


def flat(path: pathlib.Path) -> str:
    """The file's text with comment continuations joined, so a citation wrapped over lines reads as one."""
    return re.sub(r"\s*\n\s*(?://|#)?\s*", " ", path.read_text(errors="replace"))


def headings(page: pathlib.Path) -> set[str]:
    return {line.lstrip("#").strip() for line in page.read_text().splitlines() if line.startswith("#")}


def test_every_cited_section_exists():
    cited = [(path, page, title) for path in set(SOURCES) for page, title in CITATION.findall(flat(path))
             if (REPO / "docs" / page).is_file()]
    assert len(cited) >= 10
    missing = [f"{path.relative_to(REPO)}: {page}, \"{title}\"" for path, page, title in cited
               if title not in headings(REPO / "docs" / page)]
    assert not missing, missing


def test_every_named_docs_page_exists():
    named = {(path, name) for path in set(SOURCES) for name in re.findall(r"docs/([\w-]+\.md)", path.read_text(errors="replace"))}
    missing = [f"{path.relative_to(REPO)}: docs/{name}" for path, name in named if not (REPO / "docs" / name).is_file()]
    assert not missing, missing
