"""Every table of figures in the README and ``docs/`` says where its numbers come from.

A *table* is a Markdown pipe table outside fenced code: a header row, a
delimiter row (``| --- | --- |``) and the ``|`` rows after it. It is
*number-bearing* when one of its body cells, code spans removed, holds a
decimal number with a fractional part (``0.81``, ``0.60x``, ``2.27-2.52``),
neither part of a dotted version (``3.11.7``) nor a size (``16.25 MiB``: a
size in a table is a setting, a bound or a batch, more often than a
measurement; a measured size comes with a time or a ratio beside it).
``NOT_FIGURES`` names the tables whose other decimals are not measurements
(the versions a test run passed on).

A number-bearing table *cites* its source in a paragraph right above or right
below it (one blank line between) that begins with ``Source:`` or
``Sources:``. In it each results file is a path ``benchmarks/results/...``
ending in ``.md`` or ``.txt`` (in a code span, or a link), followed, before
the next path, either by the command that made it in a code span
(``python -m benchmarks.<tool> ...``, ``.venv/bin/python`` allowed) or by the
words ``command not recorded``::

    Source: `benchmarks/results/step/step.md` (`python -m benchmarks.step --out
    benchmarks/results/step`).

The checks: every number-bearing table cites at least one results file; every
cited file exists; a cited command is the one the file records on its
``Command:`` line (``benchmarks.provenance`` writes it), the ``--out`` option
aside (where a run wrote its files does not change them); a file cited as
``command not recorded`` records none. ``UNCITED`` lists the tables known not
to cite yet, with why; each must still exist and still be uncited, so that an
entry goes as soon as its table cites.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

import pytest

from benchmarks.provenance import recorded_command

REPO = Path(__file__).resolve().parents[2]

#: A decimal with a fractional part, not part of a dotted version, not a size.
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+(?![\d.])(?!\s?(?:KiB|MiB|GiB|TiB|kB|MB|GB)\b)")
DELIMITER = re.compile(r"^\|(\s*:?-+:?\s*\|)+\s*$")
CODE = re.compile(r"`([^`]*)`")
RESULTS = re.compile(r"benchmarks/results/[\w./-]*\.(?:md|txt)\b")
COMMAND = re.compile(r"^(?:\.venv/bin/)?python -m benchmarks\.\w+")
NOT_RECORDED = "command not recorded"

#: (page, header row) of tables whose decimals are no measurement, and why.
NOT_FIGURES = {
    ("README.md", "| | admitted | passed on |"): "the versions a test run passed on",
}
#: (page, header row) of number-bearing tables that do not cite yet, and why.
UNCITED = {
    (
        "docs/faults.md",
        "| fault | observed outcome | detected after |",
    ): "times the fault tests themselves measure (tests/faults/, as the page says), "
    "not a benchmark's results file",
    (
        "docs/user-guide.md",
        "| DP | window | `tokens` | baseline | `attention` | baseline | planning ms |",
    ): "reads benchmarks/results/balance.md (the prose above it names the command) "
    "without a Source line",
}


@dataclass(frozen=True)
class Table:
    page: str
    line: int  # of the header row, 1-based
    header: str
    body: tuple[str, ...]
    above: str  # the paragraph right above (one blank line between), joined by spaces
    below: str  # the paragraph right below


def pages() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def _paragraph(lines: list[str], start: int, step: int) -> str:
    """The paragraph that begins (step 1) or ends (step -1) one blank line from ``start``."""
    i = start + step
    if not (0 <= i < len(lines)) or lines[i].strip():
        return ""  # no blank line between: not a paragraph of its own
    i += step
    found: list[str] = []
    while 0 <= i < len(lines) and lines[i].strip() and not lines[i].startswith("|"):
        found.append(lines[i].strip())
        i += step
    return " ".join(found if step > 0 else reversed(found))


def tables(text: str, page: str) -> list[Table]:
    lines = text.split("\n")
    out: list[Table] = []
    fenced = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif (
            not fenced
            and line.startswith("|")
            and i + 1 < len(lines)
            and DELIMITER.match(lines[i + 1])
        ):
            end = i + 2
            while end < len(lines) and lines[end].startswith("|"):
                end += 1
            body = tuple(lines[i + 2 : end])
            above, below = _paragraph(lines, i, -1), _paragraph(lines, end - 1, 1)
            out.append(Table(page, i + 1, line.strip(), body, above, below))
            i = end
            continue
        i += 1
    return out


def number_bearing(table: Table) -> bool:
    return any(
        FIGURE.search(CODE.sub("", cell))
        for row in table.body
        for cell in row.strip("|").split("|")
    )


def citation(table: Table) -> str | None:
    """The ``Source:`` paragraph above or below the table, or None."""
    for para in (table.above, table.below):
        if re.match(r"Sources?:", para):
            return para
    return None


def cited(para: str) -> list[tuple[str, str | None]]:
    """(results file, its command, or None for ``command not recorded``) in citation order.

    Raises ValueError for a file followed by neither a command nor those words.
    """
    para = re.sub(r"\]\([^)]*\)", "]", para)  # a link's target repeats its text
    spans = list(CODE.finditer(para))
    in_commands = [s for s in spans if COMMAND.match(s.group(1))]
    found = [  # a path inside a command (its --out) is no citation
        m
        for m in RESULTS.finditer(para)
        if not any(s.start() < m.start() < s.end() for s in in_commands)
    ]
    out: list[tuple[str, str | None]] = []
    for n, m in enumerate(found):
        # what follows the path: after the code span that holds it, if one does
        after = next((s.end() for s in spans if s.start() < m.start() < s.end()), m.end())
        upto = found[n + 1].start() if n + 1 < len(found) else len(para)
        commands = [
            s.group(1) for s in spans if after <= s.start() < upto and COMMAND.match(s.group(1))
        ]
        if not commands and NOT_RECORDED not in para[after:upto]:
            raise ValueError(f"{m.group(0)}: no command follows it (nor {NOT_RECORDED!r})")
        out.append((m.group(0), " ".join(commands[0].split()) if commands else None))
    return out


def normalized(command: str) -> list[str]:
    """The words of a command, ``.venv/bin/`` and the ``--out`` option aside."""
    words = shlex.split(command)
    if words and words[0].endswith("/python"):
        words[0] = "python"
    out: list[str] = []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--out":
            skip = True
        elif not w.startswith("--out="):
            out.append(w)
    return out


def problems(table: Table, root: Path = REPO) -> list[str]:
    """What is wrong with a number-bearing table's citation (nothing: cites well)."""
    where = f"{table.page}:{table.line}"
    para = citation(table)
    if para is None:
        return [f"{where}: a table of figures with no Source: paragraph above or below it"]
    try:
        files = cited(para)
    except ValueError as exc:
        return [f"{where}: {exc}"]
    if not files:
        return [f"{where}: its Source: paragraph names no benchmarks/results/ file"]
    out = []
    for path, command in files:
        file = root / path
        if not file.is_file():
            out.append(f"{where}: cites {path}, which does not exist")
            continue
        recorded = recorded_command(file.read_text())
        if command is None:
            if recorded is not None:
                out.append(f"{where}: cites {path} as {NOT_RECORDED!r}; it records `{recorded}`")
        elif recorded is None:
            out.append(f"{where}: cites {path} with `{command}`; the file records no command")
        elif normalized(command) != normalized(recorded):
            out.append(f"{where}: cites {path} with `{command}`; the file records `{recorded}`")
    return out


def all_tables() -> list[Table]:
    return [t for p in pages() for t in tables(p.read_text(), str(p.relative_to(REPO)))]


def test_every_table_of_figures_cites_its_results_file_and_command() -> None:
    found = [
        p
        for t in all_tables()
        if number_bearing(t)
        and (t.page, t.header) not in NOT_FIGURES
        and (t.page, t.header) not in UNCITED
        for p in problems(t)
    ]
    assert not found, "\n".join(found)


def test_the_known_exceptions_are_still_there_and_still_apply() -> None:
    by_key = {(t.page, t.header): t for t in all_tables()}
    for key, why in NOT_FIGURES.items():
        assert key in by_key, f"NOT_FIGURES names a table that is gone: {key} ({why})"
        assert number_bearing(by_key[key]), f"{key} holds no decimal: drop it from NOT_FIGURES"
    for key, why in UNCITED.items():
        assert key in by_key, f"UNCITED names a table that is gone: {key} ({why})"
        assert number_bearing(by_key[key]), f"{key} holds no figure: drop it from UNCITED"
        assert citation(by_key[key]) is None, f"{key} cites now: drop it from UNCITED"


def test_the_tables_the_pages_show_are_found() -> None:
    """The parser sees the README's two tables of figures (a guard against finding none)."""
    readme = [t for t in all_tables() if t.page == "README.md" and number_bearing(t)]
    assert len(readme) >= 3, [t.header for t in readme]  # versions, delivery, step


# ------------------------------------------------------------ the check can fail

CMD = "python -m benchmarks.step --out benchmarks/results/step"


def _table(source: str, where: str = "below") -> Table:
    text = "| a | b |\n| --- | --- |\n| x | 0.81 |\n"
    text = f"{text}\n{source}\n" if where == "below" else f"{source}\n\n{text}"
    found = tables(text, "page.md")
    assert len(found) == 1
    return found[0]


@pytest.mark.parametrize(
    ("source", "said"),
    [
        ("Some prose without a source.", "no Source: paragraph"),
        ("Source: the step benchmark.", "names no benchmarks/results/ file"),
        ("Source: `benchmarks/results/nosuch/step.md` (`" + CMD + "`).", "does not exist"),
        ("Source: `benchmarks/results/step/step.md`.", "no command follows it"),
        (
            "Source: `benchmarks/results/step/step.md` (`python -m benchmarks.step --quick`).",
            "the file records `python -m benchmarks.step --out benchmarks/results/step`",
        ),
        (
            "Source: `benchmarks/results/step/step.md` (command not recorded).",
            "it records `python -m benchmarks.step",
        ),
    ],
)
def test_the_check_catches_a_table_that_cites_badly(source: str, said: str) -> None:
    found = problems(_table(source))
    assert any(said in p for p in found), (source, found)


@pytest.mark.parametrize("where", ["above", "below"])
def test_a_citation_above_or_below_with_a_wrapped_command_passes(where: str) -> None:
    source = (
        "Source: [`benchmarks/results/step/step.md`](benchmarks/results/step/step.md)\n"
        "(`.venv/bin/python -m benchmarks.step --out\nsomewhere/else`)."
    )
    assert problems(_table(source, where)) == []


def test_a_table_without_decimals_or_with_versions_only_carries_no_figures() -> None:
    names = tables("| kind | code |\n| --- | --- |\n| BATCH | 2 |\n", "p.md")[0]
    versions = tables("| | passed on |\n| --- | --- |\n| Python | `3.11.7` 3.11.7 |\n", "p.md")[0]
    bounds = tables("| what | bound |\n|---|---|\n| all requests | 16.25 MiB |\n", "p.md")[0]
    assert not number_bearing(names) and not number_bearing(versions)
    assert not number_bearing(bounds)
    assert number_bearing(tables("| | x |\n| --- | --- |\n| a | 0.60x |\n", "p.md")[0])


# ------------------------------------------------- the README's step table, value by value

STEP_WAYS = ("base", "shmloader-in-step", "shmloader", "shmloader-huge")  # its columns


def step_table_problems(readme: str, rows: list[dict]) -> list[str]:
    """Cells of the README's step table (``next()`` / above C, the slowest rank's p50)
    that are not what ``step.json`` holds, to the digits shown."""

    def worst(topology: str, mib: int, way: str, key: str) -> float:
        return max(
            r[key]
            for r in rows
            if r["topology"] == topology and r["mib"] == mib and r["mode"] == way
        )

    out = []
    for line in readme.splitlines():
        m = re.fullmatch(r"\| SP(\d)( over two nodes)?, (\d+) MiB \| (.*) \|", line.strip())
        if not m:
            continue
        topology = f"{'2nodes' if m.group(2) else '1node'}-sp{m.group(1)}"
        cells = [c.strip() for c in m.group(4).split("|")]
        for way, cell in zip(STEP_WAYS, cells, strict=True):
            shown_next, shown_above = cell.split(" / ")
            got_next = worst(topology, int(m.group(3)), way, "next_ms_p50")
            got_above = worst(topology, int(m.group(3)), way, "above_ms_p50")
            if (
                abs(float(shown_next) - got_next) > 0.006
                or abs(float(shown_above) - got_above) > 0.051
            ):
                out.append(f"{topology} {m.group(3)} MiB {way}: shows {cell}, "
                           f"step.json {got_next:.2f} / {got_above:.1f}")  # fmt: skip
    return out


def test_the_readme_step_table_is_what_its_results_file_holds() -> None:
    import json

    rows = json.loads((REPO / "benchmarks/results/step_standing/full/step.json").read_text())[
        "rows"
    ]
    readme = (REPO / "README.md").read_text()
    assert "| SP2, 256 MiB | " in readme
    assert step_table_problems(readme, rows) == []
    wrong = readme.replace("| SP2, 256 MiB | 3.43 / 139.6 |", "| SP2, 256 MiB | 3.43 / 193.6 |")
    assert step_table_problems(wrong, rows) == ["1node-sp2 256 MiB base: shows 3.43 / 193.6, "
                                                "step.json 3.43 / 139.6"]  # fmt: skip
