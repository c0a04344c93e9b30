"""The README's code blocks name only what exists, and its script matches the example.

The README and ``docs/getting-started.md`` (its longer twin) show three kinds
of block; each is checked without running it:

- ``python``: it compiles; every name it uses is imported or bound in the
  block or is one of the user's own objects the prose leaves to them
  (``PLACEHOLDERS``); every ``from shmloader... import`` resolves; every
  keyword passed to a shmloader callable is one of its parameters, and every
  attribute used on a shmloader object exists. The script is the same on both
  pages, and the example file the README names after it (``examples/...``)
  imports and calls every shmloader name the script does.
- ``bash``: every command is one the repository has or installs
  (``COMMANDS``): ``shmloader ...`` parses with the command's own parser,
  ``python -m M`` names an importable module, a script given to ``torchrun``
  or ``python`` exists and takes the flags passed to it, a file run exists
  and is executable, and every variable set before a command is one the code
  reads.
- the layout (a block without a language): every folder it draws exists.

The other pages of ``docs/`` (the guides) show recipes that leave the user's
objects to the prose: their ``python`` blocks must compile and get the
imports, keywords and attributes of shmloader right, as above.
"""

from __future__ import annotations

import argparse
import ast
import builtins
import contextlib
import functools
import importlib
import importlib.util
import inspect
import io
import os
import re
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
PAGES = ("README.md", "docs/getting-started.md")
#: The README's own limit (a landing page, not the manual).
MAX_README_LINES = 200

#: The user's own objects that the script leaves to them (the prose says so).
PLACEHOLDERS = frozenset({"ds", "dp", "sp", "collate", "accum", "epochs"})
#: The user's own training script that the launcher lines start.
USER_FILES = frozenset({"train.py"})

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.M | re.S)
ASSIGNMENT = re.compile(r"[A-Za-z_]\w*=.*")
OPERATORS = frozenset({"&&", "||", "|", ";", "&"})


def blocks(page: str, lang: str) -> list[tuple[str, str]]:
    """(where, code) of every fenced block of ``page`` in ``lang`` ("" for none)."""
    text = (REPO / page).read_text()
    return [
        (f"{page}:{text.count(chr(10), 0, m.start()) + 2}", m.group(2))
        for m in FENCE.finditer(text)
        if m.group(1) == lang
    ]


# ------------------------------------------------------------------ python


def _bound_and_used(tree: ast.AST) -> tuple[set[str], dict[str, int]]:
    bound: set[str] = set()
    used: dict[str, int] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if isinstance(node.ctx, ast.Load):
                used.setdefault(node.id, node.lineno)
            else:
                bound.add(node.id)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or (
            isinstance(node, ast.ExceptHandler) and node.name
        ):
            bound.add(node.name)
    return bound, used


def _ours(module: str) -> bool:
    return module.split(".")[0] in ("shmloader", "shmloaderd")


def shmloader_imports(tree: ast.AST) -> tuple[dict[str, object], list[str]]:
    """Names the code imports from shmloader, with their objects, and the imports that fail."""
    found: dict[str, object] = {}
    problems: list[str] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and _ours(node.module):
            try:
                module = importlib.import_module(node.module)
            except ImportError as e:
                problems.append(f"line {node.lineno}: from {node.module} import ...: {e}")
                continue
            for alias in node.names:
                if hasattr(module, alias.name):
                    found[alias.asname or alias.name] = getattr(module, alias.name)
                else:
                    problems.append(f"line {node.lineno}: {node.module} has no {alias.name!r}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if _ours(alias.name) and importlib.util.find_spec(alias.name) is None:
                    problems.append(f"line {node.lineno}: no module {alias.name!r}")
    return found, problems


def _keywords(obj: object) -> set[str] | None:
    """The keyword names ``obj`` accepts; None where it takes any (or has no signature)."""
    try:
        params = inspect.signature(obj).parameters  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return None
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return None
    return {
        name
        for name, p in params.items()
        if p.kind in (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    }


def python_problems(code: str, *, unbound: bool = True) -> list[str]:
    """What is wrong with a python block; ``unbound=False``: the user's own objects
    may be left to the prose (the guides' recipes), everything else is checked."""
    try:
        tree = ast.parse(code)
        compile(tree, "<block>", "exec")
    except SyntaxError as e:
        return [f"does not compile: {e}"]
    problems: list[str] = []
    bound, used = _bound_and_used(tree)
    known = bound | PLACEHOLDERS | set(dir(builtins))
    problems += [
        f"line {line}: {name!r} is neither imported nor defined (nor one of {sorted(PLACEHOLDERS)})"
        for name, line in sorted(used.items())
        if unbound and name not in known
    ]
    ours, failed = shmloader_imports(tree)
    problems += failed
    instances: dict[str, type] = {}  # loader = ShmLoader(...): the class of `loader`
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ours:
            accepted = _keywords(ours[node.func.id])
            problems += [
                f"line {node.lineno}: {node.func.id}() takes no keyword {kw.arg!r}"
                for kw in node.keywords
                if accepted is not None and kw.arg is not None and kw.arg not in accepted
            ]
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
            and isinstance(node.value, ast.Call)
            and isinstance(node.value.func, ast.Name)
            and isinstance(ours.get(node.value.func.id), type)
        ):
            instances[node.targets[0].id] = ours[node.value.func.id]  # type: ignore[assignment]
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in instances
            and not hasattr(instances[node.value.id], node.attr)
        ):
            cls = instances[node.value.id].__name__
            problems.append(f"line {node.lineno}: {cls} has no attribute {node.attr!r}")
    return problems


@pytest.mark.parametrize("page", PAGES)
def test_python_blocks_compile_and_name_only_what_exists(page: str) -> None:
    found = blocks(page, "python")
    assert found, f"{page} has no python block"
    problems = [f"{where}: {p}" for where, code in found for p in python_problems(code)]
    assert not problems, "\n".join(problems)


#: The other pages of the site: their recipes leave the user's objects (``accelerator``,
#: ``model``, ``path``, ...) to the prose, so only what they name of ours is checked, and
#: ``f(x=1, ...)`` is their "and your other arguments" (checked as ``f(x=1)``).
OTHER_ARGUMENTS = re.compile(r",\s*\.\.\.\s*\)")
GUIDES = tuple(
    str(p.relative_to(REPO))
    for p in sorted((REPO / "docs").rglob("*.md"))
    if str(p.relative_to(REPO)) not in PAGES
)


@pytest.mark.parametrize("page", [g for g in GUIDES if blocks(g, "python")])
def test_the_guides_python_blocks_compile_and_name_only_what_we_have(page: str) -> None:
    found = [(where, OTHER_ARGUMENTS.sub(")", code)) for where, code in blocks(page, "python")]
    problems = [
        f"{where}: {p}" for where, code in found for p in python_problems(code, unbound=False)
    ]
    assert not problems, "\n".join(problems)


def _script(page: str) -> tuple[str, str]:
    """The page's training script: its first python block that imports shmloader."""
    return next((w, c) for w, c in blocks(page, "python") if "from shmloader import" in c)


def test_the_script_is_the_same_on_both_pages() -> None:
    (_, readme), (where, other) = _script("README.md"), _script("docs/getting-started.md")
    assert other == readme, f"{where} differs from the README's script"


def _called(tree: ast.AST) -> set[str]:
    calls = (n for n in ast.walk(tree) if isinstance(n, ast.Call))
    return {n.func.id for n in calls if isinstance(n.func, ast.Name)}


def example_problems(script: str, example: Path) -> list[str]:
    """What the script uses of shmloader that ``example`` does not import and call."""
    shown = example.relative_to(REPO) if example.is_relative_to(REPO) else example
    if not example.is_file():
        return [f"{shown} does not exist"]
    ours, _ = shmloader_imports(ast.parse(script))
    tree = ast.parse(example.read_text())
    theirs, failed = shmloader_imports(tree)
    called = _called(tree)
    return failed + [
        f"{shown} does not {'call' if name in theirs else 'import'} {name}"
        for name in sorted(ours)
        if name not in theirs or name not in called
    ]


def test_the_example_the_readme_names_uses_the_same_api() -> None:
    text = README.read_text()
    where, script = _script("README.md")
    after = text[text.index(script) + len(script) :]
    named = re.search(r"`(examples/[\w/]+\.py)`", after)
    assert named, f"the README names no example file after its script ({where})"
    problems = example_problems(script, REPO / named.group(1))
    assert not problems, "\n".join(problems)


# -------------------------------------------------------------------- bash


def commands(code: str) -> list[list[str]]:
    """Each simple command of a bash block (comments dropped, split at && || | ;)."""
    out: list[list[str]] = []
    for line in code.replace("\\\n", " ").splitlines():
        lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
        lexer.whitespace_split = True
        words: list[str] = []
        for word in lexer:
            if word in OPERATORS:
                out += [words] if words else []
                words = []
            else:
                words.append(word)
        out += [words] if words else []
    return out


@functools.cache
def _source_text() -> str:
    trees = (REPO / "shmloader", REPO / "daemon")
    return "\n".join(p.read_text() for tree in trees for p in sorted(tree.rglob("*.py")))


def _venv_bin() -> Path:
    here = REPO / ".venv" / "bin"
    return here if here.is_dir() else Path(sys.executable).parent


def _parses(parser: argparse.ArgumentParser, args: list[str]) -> list[str]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            parser.parse_args(args)
    except SystemExit as e:
        if e.code:
            return [f"{parser.prog} {' '.join(args)}: {err.getvalue().strip().splitlines()[-1]}"]
    return []


def _shmloader(args: list[str]) -> list[str]:
    if args[:1] == ["daemon"]:
        return _shmloaderd(args[1:])
    from shmloader.tools.cli import build_parser

    return _parses(build_parser(), args)


def _shmloaderd(args: list[str]) -> list[str]:
    from shmloaderd.__main__ import build_parser

    return _parses(build_parser(), args)


def _flags_of(path: Path) -> set[str]:
    """The option strings of every ``add_argument`` call in ``path``."""
    return {"-h", "--help"} | {
        a.value
        for n in ast.walk(ast.parse(path.read_text()))
        if isinstance(n, ast.Call)
        and isinstance(n.func, ast.Attribute)
        and n.func.attr == "add_argument"
        for a in n.args
        if isinstance(a, ast.Constant) and isinstance(a.value, str) and a.value.startswith("-")
    }


def _script_run(script: str, args: list[str]) -> list[str]:
    if script in USER_FILES:
        return []
    path = REPO / script
    if not path.is_file():
        return [f"{script} does not exist"]
    flags = _flags_of(path)
    return [
        f"{script} has no option {flag}"
        for flag in (a.partition("=")[0] for a in args if a.startswith("-"))
        if flag not in flags
    ]


def _torchrun(args: list[str]) -> list[str]:
    i = next((i for i, a in enumerate(args) if a.endswith(".py")), None)
    if i is None:
        return ["torchrun starts no script"]
    return _script_run(args[i], args[i + 1 :])


def _python(args: list[str]) -> list[str]:
    if args[:1] == ["-m"] and len(args) > 1:
        module = args[1]
        if importlib.util.find_spec(module) is None:
            return [f"python -m {module}: no such module"]
        return []
    if args and args[0].endswith(".py"):
        return _script_run(args[0], args[1:])
    return [f"python {' '.join(args)}: neither -m MODULE nor a script"]


def _sphinx_build(args: list[str]) -> list[str]:
    positional = [a for a in args if not a.startswith("-")]
    # sphinx-build [options] SOURCEDIR OUTPUTDIR: -b takes a value
    values = {args[i + 1] for i, a in enumerate(args[:-1]) if a in ("-b", "-c", "-d", "-j")}
    source = [a for a in positional if a not in values][:1]
    if not source or not (REPO / source[0] / "conf.py").is_file():
        return [f"sphinx-build {' '.join(args)}: no conf.py in its source directory"]
    return []


#: The commands a block may run, each with the check of its arguments.
COMMANDS: dict[str, Callable[[list[str]], list[str]]] = {
    "shmloader": _shmloader,
    "shmloaderd": _shmloaderd,
    "python": _python,
    "torchrun": _torchrun,
    "sphinx-build": _sphinx_build,
}


def command_problems(words: list[str]) -> list[str]:
    problems: list[str] = []
    while words and ASSIGNMENT.fullmatch(words[0]):
        var = words.pop(0).partition("=")[0]
        if f'"{var}"' not in _source_text():
            problems.append(f"{var}: no variable shmloader or shmloaderd reads")
    if not words:
        return problems
    head, args = words[0], words[1:]
    name = head.removeprefix(".venv/bin/")
    if head.startswith(".venv/bin/") and not (_venv_bin() / name).exists():
        problems.append(f"{head}: setup.sh installs no {name!r}")
    elif "/" in head and not head.startswith(".venv/bin/"):
        path = REPO / head
        if not (path.is_file() and os.access(path, os.X_OK)):
            problems.append(f"{head}: no executable file of the repository")
        return problems
    check = COMMANDS.get(name)
    if check is None:
        return [*problems, f"{head}: not a command this test knows (COMMANDS)"]
    return problems + check(args)


@pytest.mark.parametrize("page", PAGES)
def test_bash_blocks_run_only_what_exists(page: str) -> None:
    found = blocks(page, "bash")
    assert found, f"{page} has no bash block"
    problems = [
        f"{where}: {p}"
        for where, code in found
        for words in commands(code)
        for p in command_problems(words)
    ]
    assert not problems, "\n".join(problems)


# ------------------------------------------------------------------ layout


def layout_problems(code: str) -> list[str]:
    """Folders the layout draws that do not exist (indented ones under the last top one)."""
    problems: list[str] = []
    top = REPO
    for line in code.splitlines():
        m = re.match(r"( *)([\w.-]+)/(?:\s|$)", line)
        if not m:
            continue
        path = REPO / m.group(2) if not m.group(1) else top / m.group(2)
        if not m.group(1):
            top = path
        if not path.is_dir():
            problems.append(f"{path.relative_to(REPO)}/ does not exist")
    return problems


def test_the_layout_draws_only_folders_that_exist() -> None:
    found = blocks("README.md", "")
    assert found, "the README has no layout block"
    problems = [f"{where}: {p}" for where, code in found for p in layout_problems(code)]
    assert not problems, "\n".join(problems)


def test_the_readme_is_short() -> None:
    lines = README.read_text().count("\n")
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines (at most {MAX_README_LINES})"


# ------------------------------------------------------- the checks can fail


@pytest.mark.parametrize(
    ("kind", "code", "said"),
    [
        ("python", "from shmloader import ShmLoder", "shmloader has no 'ShmLoder'"),
        ("python", "from shmloader.samplers import sharded_", "has no 'sharded_'"),
        ("python", "import shmloader.nosuch", "no module 'shmloader.nosuch'"),
        (
            "python",
            "from shmloader import ShmLoader\nloader = ShmLoader(ds, accumulation=2)",
            "ShmLoader() takes no keyword 'accumulation'",
        ),
        (
            "python",
            "from shmloader import ShmLoader\nloader = ShmLoader(ds)\nloader.set_epock(0)",
            "ShmLoader has no attribute 'set_epock'",
        ),
        ("python", "loader = ShmLoader(ds)", "'ShmLoader' is neither imported nor defined"),
        ("python", "for batch in loader\n    ...", "does not compile"),
        ("bash", ".venv/bin/shmloader demoo", "invalid choice: 'demoo'"),
        ("bash", ".venv/bin/shmloader gc --dry-runn", "unrecognized arguments: --dry-runn"),
        ("bash", ".venv/bin/shmloader daemon --sockett x", "unrecognized arguments: --sockett"),
        ("bash", ".venv/bin/shmloaderz demo", "setup.sh installs no 'shmloaderz'"),
        (
            "bash",
            "SHMLOADER=1 .venv/bin/torchrun --nproc-per-node 4 examples/train_spp.py",
            "examples/train_spp.py does not exist",
        ),
        (
            "bash",
            "SHMLOADER=1 .venv/bin/torchrun --nproc-per-node 4 examples/train_sp.py --spp 2",
            "examples/train_sp.py has no option --spp",
        ),
        (
            "bash",
            "SHMLOADER_SLOT=4 .venv/bin/torchrun --nproc-per-node 8 train.py",
            "SHMLOADER_SLOT: no variable",
        ),
        ("bash", "./setupp.sh && .venv/bin/shmloader demo", "./setupp.sh: no executable file"),
        ("bash", ".venv/bin/python -m benchmarks.runn", "no such module"),
        ("bash", ".venv/bin/sphinx-build -b html doc build/docs", "no conf.py"),
        ("bash", "make docs", "make: not a command this test knows"),
        ("layout", "shmloader/   the package\n  _nodes/     wrong", "shmloader/_nodes/ does not"),
    ],
)
def test_the_checks_catch_a_wrong_name(kind: str, code: str, said: str) -> None:
    if kind == "python":
        problems = python_problems(code)
    elif kind == "bash":
        problems = [p for words in commands(code) for p in command_problems(words)]
    else:
        problems = layout_problems(code)
    assert any(said in p for p in problems), f"{code!r}: expected {said!r}, got {problems}"


def test_the_example_check_catches_a_name_the_example_lacks(tmp_path: Path) -> None:
    script = "from shmloader import ShmLoader, dp_topology\n"
    example = tmp_path / "example.py"
    example.write_text("from shmloader import ShmLoader\nShmLoader(f)\n")
    assert example_problems(script, example) == [f"{example} does not import dp_topology"]
