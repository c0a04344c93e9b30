"""A plain ``pip install .`` installs every module of the package and the daemon.

setuptools finds regular packages only: a folder without ``__init__.py`` (a
namespace package) is silently left out of the wheel, and an editable
install, which maps the folder, never shows it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _source_copy(dest: Path) -> Path:
    """The files a fresh clone of this working tree has (tracked or not ignored), in ``dest``:
    an in-tree build would reuse ``build/`` and ship what an earlier build left there."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    wanted = ("pyproject.toml", "README.md", "LICENSE", "shmloader/", "daemon/")
    for name in filter(None, listed):
        if name.startswith(wanted) and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def test_the_wheel_holds_every_module_and_both_commands(tmp_path: Path) -> None:
    src = _source_copy(tmp_path / "src")
    out = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
         str(tmp_path), str(src)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
        env=dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1"),
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    (wheel,) = tmp_path.glob("shmloader-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "shmloader").rglob("*.py")}
    tree |= {p.relative_to(REPO / "daemon").as_posix() for p in (REPO / "daemon").rglob("*.py")}
    assert tree - names == set(), sorted(tree - names)
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "shmloader = shmloader.tools.cli:main" in text
    assert "shmloaderd = shmloaderd.__main__:main" in text
