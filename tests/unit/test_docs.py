"""The prose names only what exists: NOTE rules, dotted names, the NOTE index.

The prose is every docstring and comment of the Python trees (``shmloader``,
``daemon``, ``tests``, ``benchmarks``, ``examples``) and every Markdown page
(``README.md``, ``benchmarks/README.md``, ``docs/**``).

A NOTE rule is *defined* by a line of a docstring or a comment that is

- ``NOTE [name]`` alone, or
- a heading ``Title (NOTE [name])`` that opens its paragraph,

followed by the rule's text, indented deeper than that line (a comment
``# NOTE [name]`` then ``#     text``; a docstring line then its indented
block). Definitions live in Python files only. Everything else that reads
``NOTE [name]`` (wrapped across lines or not) *cites* the rule. The checks:

(a) every name is defined exactly once, and every cited name is defined;
    a citation that says where its rule is (``NOTE [name] in ``mod````,
    ``NOTE [name] (``mod``)``, in Markdown with single backticks) names the
    module (dotted, a file path or its last part) that defines it;
(b) every dotted name ``shmloader.x.y`` / ``shmloaderd.x`` in the prose
    resolves: the longest importable module prefix, then attributes (or
    the annotated fields of a class) for the rest;
(c) ``docs/internals/notes.md`` lists every definition, once, with the file
    that defines it, and nothing else.
"""

from __future__ import annotations

import ast
import functools
import importlib
import io
import re
import tokenize
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PY_TREES = ("shmloader", "daemon", "tests", "benchmarks", "examples")
INDEX = REPO / "docs" / "internals" / "notes.md"

NOTE = re.compile(r"NOTE\s+\[([^\[\]]{1,80})\]")
ALONE = re.compile(r"NOTE \[([^\[\]]{1,80})\]")
HEADING = re.compile(r"\S.*\(NOTE \[([^\[\]]{1,80})\]\)")
#: Where a citation says its rule is: `` in ``mod``` `, `` (``mod``)``, `` in mod)``.
WHERE = re.compile(r"\s*(?:\s+in\s+|\()(`{1,2})?([A-Za-z_][\w./-]*\w)(`{1,2})?")
#: Quoted (``"shmloader.balance"``) it is a string, a logger's name say: not a reference.
DOTTED = re.compile(r"(?<![\w./'\"-])(shmloaderd?(?:\.[A-Za-z_]\w*)+)")


@dataclass(frozen=True)
class Prose:
    """One docstring, one run of comment lines, or one Markdown page."""

    path: Path
    line: int  # of the first line of ``text``
    text: str
    python: bool

    def where(self, offset: int) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line + self.text.count(chr(10), 0, offset)}"


def _comments(path: Path, source: str) -> list[Prose]:
    """Runs of comment lines (consecutive lines), each ``#`` marker removed."""
    runs: list[Prose] = []
    lines: list[str] = []
    start = last = -1
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        row = tok.start[0]
        if lines and row != last + 1:
            runs.append(Prose(path, start, "\n".join(lines), True))
            lines = []
        if not lines:
            start = row
        lines.append(tok.string[1:])
        last = row
    if lines:
        runs.append(Prose(path, start, "\n".join(lines), True))
    return runs


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _docstrings(path: Path) -> list[Prose]:
    out = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if (
                body
                and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)
            ):
                out.append(Prose(path, body[0].lineno, body[0].value.value, True))
    return out


def python_files() -> list[Path]:
    # this file's docstring shows the forms with placeholder names: not prose to check
    here = Path(__file__).resolve()
    return sorted(p for tree in PY_TREES for p in (REPO / tree).rglob("*.py") if p != here)


def markdown_files() -> list[Path]:
    return sorted(
        [REPO / "README.md", *(REPO / "benchmarks").glob("*.md"), *(REPO / "docs").rglob("*.md")]
    )


@functools.cache
def prose() -> tuple[Prose, ...]:
    out: list[Prose] = []
    for path in python_files():
        source = path.read_text()
        out += _docstrings(path) + _comments(path, source)
    out += [Prose(path, 1, path.read_text(), False) for path in markdown_files()]
    return tuple(out)


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def definitions_in(block: Prose) -> list[tuple[str, int]]:
    """(name, offset of its ``NOTE``) of every rule ``block`` defines."""
    if not block.python:
        return []
    found = []
    lines = block.text.split("\n")
    offset = 0
    for i, line in enumerate(lines):
        body = line.strip()
        opens = ALONE.fullmatch(body)
        if not opens and (i == 0 or not lines[i - 1].strip()):
            opens = HEADING.fullmatch(body)
        following = next((n for n in lines[i + 1 :] if n.strip()), None)
        if opens and following is not None and _indent(following) > _indent(line):
            name = opens.group(1)
            found.append((name, offset + line.index(f"NOTE [{name}]")))
        offset += len(line) + 1
    return found


@dataclass(frozen=True)
class Citation:
    name: str
    where: str
    module: str | None  # where the citation says the rule is


def _says_where(said: re.Match, text: str) -> bool:
    """Whether the words after a citation name a module: backticked, dotted or with an
    underscore (``ring``, ``shmloader._node.ring``, ``daemon_client``), or a bare word
    that closes the parenthesis or the clause (``(ring)``, ``in ring:``)."""
    token = said.group(2)
    if said.group(1) or "." in token or "_" in token:
        return True
    return text[said.end() : said.end() + 1] in (")", ":", ";")


def _scan() -> tuple[dict[str, list[str]], list[Citation]]:
    defined: dict[str, list[str]] = {}
    cited: list[Citation] = []
    for block in prose():
        own = set()
        for name, offset in definitions_in(block):
            defined.setdefault(name, []).append(block.where(offset))
            own.add(offset)
        for m in NOTE.finditer(block.text):
            if m.start() in own:
                continue
            said = WHERE.match(block.text, m.end())
            module = said.group(2) if said and _says_where(said, block.text) else None
            name = " ".join(m.group(1).split())
            cited.append(Citation(name, block.where(m.start()), module))
    return defined, cited


@functools.cache
def scan() -> tuple[dict[str, list[str]], tuple[Citation, ...]]:
    defined, cited = _scan()
    return defined, tuple(cited)


def module_of(where: str) -> str:
    """``shmloader/_node/ring.py:12`` -> ``shmloader._node.ring``."""
    parts = list(Path(where.rpartition(":")[0]).with_suffix("").parts)
    if parts[0] == "daemon":
        parts = parts[1:]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def names_module(said: str, where: str) -> bool:
    """Whether ``said`` (``ring``, ``ring.py``, ``_node/ring.py``, ``shmloader._node.ring``)
    names the module of the definition at ``where``."""
    dotted = module_of(where)
    said = said.removesuffix(".py").removeprefix("daemon/").replace("/", ".")
    return dotted == said or dotted.endswith("." + said)


# --------------------------------------------------------------- (a) NOTE rules


def test_every_note_is_defined_exactly_once() -> None:
    defined, _ = scan()
    twice = {name: at for name, at in defined.items() if len(at) > 1}
    assert not twice, f"NOTE rules defined more than once: {twice}"


def test_every_cited_note_is_defined() -> None:
    defined, cited = scan()
    missing = [f"{c.where}: NOTE [{c.name}]" for c in cited if c.name not in defined]
    assert not missing, "cited, never defined:\n" + "\n".join(missing)


def test_a_citation_names_the_module_that_defines_the_note() -> None:
    defined, cited = scan()
    wrong = [
        f"{c.where}: NOTE [{c.name}] in {c.module!r}, defined at {defined[c.name][0]}"
        for c in cited
        if c.module and c.name in defined and not names_module(c.module, defined[c.name][0])
    ]
    assert not wrong, "citations naming the wrong module:\n" + "\n".join(wrong)


def test_the_rules_are_found_in_every_form_the_tree_uses() -> None:
    def defs(text: str) -> list[str]:
        return [n for n, _ in definitions_in(Prose(REPO / "x.py", 1, text, True))]

    assert defs("Summary.\n\nNOTE [a rule]\n    Its text.\n") == ["a rule"]
    assert defs(" NOTE [a rule]\n     its text,\n     commented") == ["a rule"]
    assert defs("NOTE [a rule]\n\n    Its text.\n    ") == ["a rule"]  # a docstring's first line
    assert defs("Intro.\n\nWhat counts (NOTE [a rule])\n    Its text.\n") == ["a rule"]
    # running text cites: a wrapped citation alone on its line, a heading inside a paragraph
    assert defs("as it says in\nNOTE [a rule]\nand more.") == []
    assert defs("Intro,\nthen (NOTE [a rule])\n    - a list item") == []
    text = "the rule (NOTE [a\n    rule] in ``shmloader._node.ring``): more"
    block = Prose(REPO / "x.py", 1, text, True)
    m = NOTE.search(block.text)
    assert m and " ".join(m.group(1).split()) == "a rule"
    said = WHERE.match(text, m.end())
    assert said and said.group(2) == "shmloader._node.ring"
    assert names_module("_node/ring.py", "shmloader/_node/ring.py:3")
    assert names_module("ring", "shmloader/_node/ring.py:3")
    assert names_module("registry", "daemon/shmloaderd/registry.py:3")
    assert not names_module("ringdir", "shmloader/_node/ring.py:3")


# --------------------------------------------------------------- (b) dotted names


def resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            fields = getattr(obj, "__annotations__", {}) if isinstance(obj, type) else {}
            if hasattr(obj, attr):
                obj = getattr(obj, attr)
            elif attr in fields or attr in getattr(obj, "__slots__", ()):
                return attr == parts[-1]
            else:
                return False
        return True
    return False


def dotted_names() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for block in prose():
        for m in DOTTED.finditer(block.text):
            found.setdefault(m.group(1), []).append(block.where(m.start()))
    return found


def test_every_dotted_name_resolves() -> None:
    stale = {name: at for name, at in sorted(dotted_names().items()) if not resolves(name)}
    assert not stale, "names that do not exist:\n" + "\n".join(
        f"{name}: {', '.join(at)}" for name, at in stale.items()
    )


def test_resolving_imports_the_module_then_looks_up_attributes() -> None:
    assert resolves("shmloader._node.ring.RingWriter")
    assert resolves("shmloader.ShmLoader.state_dict")
    assert resolves("shmloaderd.registry")
    assert not resolves("shmloader._node.ring.NoSuchThing")
    assert not resolves("shmloader.loader._exchange_group")
    assert not resolves("shmloader.admin")


# ------------------------------------------------- (b) the short forms of names

#: Modules the layer move renamed (issue #30): their old names are gone for good.
MOVED = {
    "admin": "shmloader._node.inventory",
    "cudaops": "shmloader.device.cuda",
    "hostmem": "shmloader.device.registrar",
    "report": "shmloader._roles.stats",
    "roles": "shmloader._roles.base",
    "sampler": "shmloader.samplers.sharded",
    "startup": "shmloader._setup.build",
    "worker": "shmloader._workers.collate",
    "writer": "shmloader._roles.node_writer",
}
#: ``admin.register``, ``roles.py``: an old module name used as a module.
OLD_MODULE = re.compile(r"`{1,2}(" + "|".join(MOVED) + r")(?:\.py|\.\w+)+`{1,2}")
#: A file name (``ring.py``, ``tests/unit/test_ring.py``).
FILE = re.compile(r"(?<![\w/.-])([\w./-]*\w\.py)\b")
#: The user's own scripts the guides speak of.
USER_FILES = {"train.py"}
#: A private name (``_await_readers``, ``loader._exchange_group``): ours, so it must be in
#: our code.
PRIVATE = re.compile(r"(?<![\w/{}$-])(?<![^\w]\.)(_[a-z]\w*)\b")


@functools.cache
def identifiers() -> frozenset[str]:
    """Every name the Python trees define or use, and every module path part."""
    found: set[str] = set()
    for path in python_files():
        found.update(path.relative_to(REPO).with_suffix("").parts)
        for node in ast.walk(_tree(path)):
            for field in ("name", "id", "attr", "arg", "asname"):
                value = getattr(node, field, None)
                if isinstance(value, str):
                    found.update(value.split("."))
    return frozenset(found)


@functools.cache
def repo_files() -> tuple[str, ...]:
    return tuple(
        str(p.relative_to(REPO))
        for tree in (*PY_TREES, ".ci", "docs")  # docs/conf.py
        if (REPO / tree).exists()
        for p in (REPO / tree).rglob("*.py")
    )


def test_no_old_module_name_is_used_as_a_module() -> None:
    found = [
        f"{block.where(m.start())}: {m.group(0)} ({m.group(1)} is {MOVED[m.group(1)]} now)"
        for block in prose()
        for m in OLD_MODULE.finditer(block.text)
    ]
    assert not found, "\n".join(found)


def test_every_file_named_exists() -> None:
    files = repo_files()
    missing = [
        f"{block.where(m.start())}: {m.group(1)}"
        for block in prose()
        for m in FILE.finditer(block.text)
        if (name := m.group(1).lstrip("./")) not in USER_FILES
        and not any(f == name or f.endswith("/" + name) for f in files)
    ]
    assert not missing, "files that do not exist:\n" + "\n".join(missing)


def test_every_private_name_is_in_the_code() -> None:
    known = identifiers()
    missing = [
        f"{block.where(m.start())}: {m.group(1)}"
        for block in prose()
        for m in PRIVATE.finditer(block.text)
        if m.group(1) not in known
    ]
    assert not missing, "private names the code does not have:\n" + "\n".join(missing)


# --------------------------------------------------------------- (c) the index

#: An entry of the index: ``| NOTE [name] | `path` | one line |``.
ENTRY = re.compile(r"^\|\s*NOTE \[([^\[\]]+)\]\s*\|\s*`([^`]+)`\s*\|\s*(.*?)\s*\|\s*$", re.M)


def index_entries() -> list[tuple[str, str, str]]:
    return ENTRY.findall(INDEX.read_text())


def test_the_index_lists_every_note_once_with_its_file() -> None:
    defined, _ = scan()
    entries = index_entries()
    names = [name for name, _, _ in entries]
    assert len(names) == len(set(names)), "listed twice: " + ", ".join(
        sorted({n for n in names if names.count(n) > 1})
    )
    assert set(names) == set(defined), (
        f"not in the index: {sorted(set(defined) - set(names))}; "
        f"in the index, defined nowhere: {sorted(set(names) - set(defined))}"
    )
    misplaced = [
        f"NOTE [{name}]: index says {path}, defined at {defined[name][0]}"
        for name, path, _ in entries
        if path != defined[name][0].rpartition(":")[0]
    ]
    assert not misplaced, "\n".join(misplaced)
    assert all(line for _, _, line in entries), "an entry without its one line"


@pytest.mark.parametrize("page", ["flow.md", "state-machines.md", "wire.md", "notes.md"])
def test_the_internals_pages_are_linked_from_the_overview(page: str) -> None:
    assert (REPO / "docs" / "internals" / page).exists()
    assert f"internals/{page}" in (REPO / "docs" / "architecture.md").read_text()
