"""The README's layout table names every top-level folder and every package of the tree.

A folder or package nobody describes is one a reader cannot place; the table is where a
newcomer starts, so it must not fall behind the code.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Folders that hold no project code: tool settings and caches.
NOT_LAID_OUT = {".ci", ".git", ".venv"}


def _tracked() -> list[Path]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True,
                         text=True).stdout
    return [Path(line) for line in out.splitlines() if (ROOT / line).exists()]


def _layout_table() -> str:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^### Layout\n(.*?)(?=^#|\Z)", readme, flags=re.S | re.M)
    assert match, "README.md has no '### Layout' section"
    return match.group(1)


def _named(table: str) -> set[str]:
    """Every `folder/` or `folder/sub/` named in the table's first column, without the slash."""
    names: set[str] = set()
    for line in table.splitlines():
        if line.startswith("|"):
            first = line.split("|")[1]
            names.update(name.rstrip("/") for name in re.findall(r"`([^`]+/)`", first))
    return names


def test_every_top_level_folder_is_in_the_layout_table() -> None:
    folders = {path.parts[0] for path in _tracked() if len(path.parts) > 1}
    missing = sorted(folders - NOT_LAID_OUT - _named(_layout_table()))
    assert not missing, f"README.md's layout table does not name: {missing}"


def test_every_package_is_in_the_layout_table() -> None:
    packages = {path.parent.as_posix() for path in _tracked() if path.name == "__init__.py"}
    missing = sorted(packages - _named(_layout_table()))
    assert not missing, f"README.md's layout table does not name the packages: {missing}"


def test_the_table_names_nothing_that_is_gone() -> None:
    gone = sorted(name for name in _named(_layout_table()) if not (ROOT / name).is_dir())
    assert not gone, f"README.md's layout table names folders that do not exist: {gone}"
