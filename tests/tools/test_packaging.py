"""A real install: ``python -m build`` makes an sdist and, from it, a wheel that installs.

setuptools finds regular packages only: a folder without ``__init__.py`` (a
namespace package) is silently left out of the wheel, and an editable
install, which maps the folder, never shows it. So the wheel is built here
the way CI and a user build it (``python -m build``: the sdist first, the
wheel from the unpacked sdist, so a file the sdist lacks is missing from
the wheel too), then installed into a fresh venv and run from there.

The fresh venv gets torch and the other requirements without a download:
a ``.pth`` file points it at a folder of links to exactly the distributions
the wheel's metadata requires (with the ``daemon`` extra, recursively),
taken from the environment running the tests. Nothing else of that
environment is visible (not the editable shmloader, not the test tools), so
an import of an undeclared package fails the run, and ``pip install
--no-index`` fails if a declared requirement is not met.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import shmloader

REPO = Path(__file__).resolve().parents[2]
#: What the sdist is made from (the rest of the clone is not part of the distribution).
SOURCES = ("pyproject.toml", "MANIFEST.in", "README.md", "LICENSE", "shmloader/", "daemon/")
SOURCES += ("systemd/",)
#: What the sdist must carry besides the packages: the operator installs the unit from it.
SYSTEMD_FILES = ("README.md", "shmloaderd.service", "shmloaderd.env", "mnt-shmloader.mount")


@dataclass(frozen=True)
class Built:
    sdist: Path
    wheel: Path


def _source_copy(dest: Path) -> Path:
    """The files a fresh clone of this working tree has (tracked or not ignored), in ``dest``:
    an in-tree build would reuse ``build/`` and ship what an earlier build left there."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=REPO, capture_output=True, check=True, timeout=60,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        if name.startswith(SOURCES) and (REPO / name).is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, dest / name)
    return dest


def _env() -> dict[str, str]:
    """The environment without anything that would put the clone on the path."""
    drop = {"PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP", "VIRTUAL_ENV", "PIP_REQUIRE_VIRTUALENV"}
    env = {k: v for k, v in os.environ.items() if k not in drop}
    return env | {"PIP_DISABLE_PIP_VERSION_CHECK": "1", "PYTHONDONTWRITEBYTECODE": "1"}


def _run(cmd: list[str], cwd: Path, timeout: float) -> str:
    out = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, f"{cmd}: exit {out.returncode}\n{out.stdout}{out.stderr}"[-4000:]
    return out.stdout


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Built:
    """``python -m build --no-isolation`` (offline: the running environment's setuptools)."""
    tmp = tmp_path_factory.mktemp("build")
    src = _source_copy(tmp / "src")
    dist = tmp / "dist"
    _run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(src)],
         tmp, 300)  # fmt: skip
    (sdist,) = dist.glob("shmloader-*.tar.gz")
    (wheel,) = dist.glob("shmloader-*.whl")
    return Built(sdist, wheel)


def _metadata(wheel: Path) -> str:
    with zipfile.ZipFile(wheel) as z:
        (name,) = (n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return z.read(name).decode()


def test_the_wheel_holds_every_module_and_both_commands(built: Built) -> None:
    names = set(zipfile.ZipFile(built.wheel).namelist())
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "shmloader").rglob("*.py")}
    tree |= {p.relative_to(REPO / "daemon").as_posix() for p in (REPO / "daemon").rglob("*.py")}
    assert tree - names == set(), sorted(tree - names)
    (entry_points,) = (n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(built.wheel).read(entry_points).decode()
    assert "shmloader = shmloader.tools.cli:main" in text
    assert "shmloaderd = shmloaderd.__main__:main" in text
    # the version comes from one place, shmloader/__init__.py
    assert f"\nVersion: {shmloader.__version__}\n" in _metadata(built.wheel)
    assert built.wheel.name.startswith(f"shmloader-{shmloader.__version__}-")


def test_the_sdist_holds_the_daemon_and_the_systemd_unit(built: Built) -> None:
    with tarfile.open(built.sdist) as tar:
        names = {n.partition("/")[2] for n in tar.getnames()}
    tree = {p.relative_to(REPO).as_posix() for p in (REPO / "daemon").rglob("*.py")}
    tree |= {f"systemd/{name}" for name in SYSTEMD_FILES}
    tree |= {"pyproject.toml", "README.md", "shmloader/__init__.py"}
    assert tree - names == set(), sorted(tree - names)


def _requirements(wheel: Path, extra: str) -> list[importlib.metadata.Distribution]:
    """Every distribution the wheel needs with ``extra``, recursively, as installed here."""
    wanted = [
        Requirement(line.partition(":")[2].strip())
        for line in _metadata(wheel).splitlines()
        if line.startswith("Requires-Dist:")
    ]
    found: dict[str, importlib.metadata.Distribution] = {}
    while wanted:
        req = wanted.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        if name in found:
            continue
        found[name] = importlib.metadata.distribution(req.name)
        wanted += [
            r
            for r in map(Requirement, found[name].requires or [])
            if r.marker is None or r.marker.evaluate({"extra": ""})
        ]
    return list(found.values())


def _link_requirements(dists: list[importlib.metadata.Distribution], dest: Path) -> None:
    """Links in ``dest`` to the top-level files and folders of ``dists`` (their modules, their
    vendored libraries, their ``.dist-info``), so that pip sees them installed."""
    dest.mkdir()
    for dist in dists:
        site = Path(str(dist.locate_file("")))
        tops = {f.parts[0] for f in dist.files or [] if f.parts[0] not in ("..", "__pycache__")}
        for top in sorted(tops):
            if (site / top).exists() and not (dest / top).exists():
                (dest / top).symlink_to(site / top)


@pytest.mark.slow  # whole programs end to end (README: selections)
@pytest.mark.timeout(240)
def test_the_wheel_installs_into_a_fresh_venv_and_runs(built: Built, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], tmp_path, 60)
    python = str(venv / "bin" / "python")
    purelib = "import sysconfig; print(sysconfig.get_path('purelib'))"
    site = _run([python, "-c", purelib], tmp_path, 30).strip()
    _link_requirements(_requirements(built.wheel, "daemon"), tmp_path / "requirements")
    (Path(site) / "requirements.pth").write_text(f"{tmp_path / 'requirements'}\n")
    # this environment's pip installs into the venv (--python); --no-index: nothing downloaded
    pip = [sys.executable, "-m", "pip", "--python", python, "install", "-q", "--no-index"]
    _run([*pip, f"{built.wheel}[daemon]"], tmp_path, 120)

    version = shmloader.__version__
    for command in ("shmloader", "shmloaderd"):
        said = _run([str(venv / "bin" / command), "--version"], tmp_path, 60)
        assert said.split() == [command, version], said
    code = "import shmloader, shmloaderd, prometheus_client; print(shmloader.__file__)"
    where = _run([python, "-c", code + "; print(shmloaderd.__file__)"], tmp_path, 60)
    assert all(line.startswith(site) for line in where.split()), where  # the wheel's, not ours

    # small batches, 2 ranks, 1 worker each: the whole demo, shared and unshared, in seconds
    demo = ["--steps", "2", "--ranks", "2", "--sp", "2", "--seq-len", "1024", "--images", "2"]
    demo += ["--image-size", "64", "--workers", "1", "--timeout", "100"]
    out = _run([python, "-m", "shmloader", "demo", *demo], tmp_path, 150)
    assert out.rstrip().endswith("OK: every SP peer received identical batches"), out


#: Where the daemon's own venv is (systemd/README.md makes it; the unit runs its script).
DAEMON_VENV = "/opt/shmloader"


def test_the_unit_runs_the_daemon_from_its_own_venv() -> None:
    unit = (REPO / "systemd" / "shmloaderd.service").read_text()
    (exec_start,) = (line for line in unit.splitlines() if line.startswith("ExecStart="))
    assert exec_start.partition("=")[2].split()[0] == f"{DAEMON_VENV}/bin/shmloaderd"
    readme = (REPO / "systemd" / "README.md").read_text()
    install = readme[readme.index("## Install") :].partition("\n## ")[0]
    assert f"python3 -m venv {DAEMON_VENV}\n" in install, install
    wheel = f"shmloader-{shmloader.__version__}-py3-none-any.whl[daemon]"
    assert f"{DAEMON_VENV}/bin/pip install './{wheel}'" in install, install
    assert f"{DAEMON_VENV}/bin/shmloaderd --version" in install, install
    for text in (unit, readme):  # nothing runs out of a clone
        assert ".venv" not in text


def test_every_wheel_the_docs_name_is_this_version() -> None:
    pages = [REPO / "README.md", REPO / "systemd" / "README.md", *(REPO / "docs").rglob("*.md")]
    named = {
        f"{page.relative_to(REPO)}: {m.group(0)}"
        for page in pages
        for m in re.finditer(r"shmloader-([0-9][^-\s]*)-py3-none-any\.whl", page.read_text())
        if m.group(1) != shmloader.__version__
    }
    assert not named, sorted(named)
