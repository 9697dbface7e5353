"""The README a user reads first: every link in it leads to a file of this repository (or a web address), none to a
folder beside it that only the project's developers have (before: ../shared/ARCHITECTURE.md)."""

from __future__ import annotations

import re

from tests.helpers import REPO

#: ``[text](target)`` and ``[text](target#anchor)`` of Markdown.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def test_every_readme_link_resolves_inside_the_repository() -> None:
    readme = (REPO / "README.md").read_text()
    targets = [t for t in LINK.findall(readme) if not re.match(r"^[a-z]+:", t) and not t.startswith("#")]
    assert targets, "the README links its documentation"
    broken = []
    for target in targets:
        path = (REPO / target.split("#", 1)[0]).resolve()
        if not path.is_relative_to(REPO.resolve()) or not path.exists():
            broken.append(target)
    assert not broken, f"README links that lead outside the repository or nowhere: {broken}"
