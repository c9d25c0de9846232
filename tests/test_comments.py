"""Comments and docstrings state invariants and reasons: no dates and no timings (those live in BENCHMARKS.md,
bug history in commit messages) and no numbers of this project's issues (history too). Scans the package's and
scripts' comments and docstrings and the configs' comments (and, for issue numbers, the tests' too); figures inside
quotes or backticks are examples of formats or output, not claims, and are skipped. An upstream issue that explains a
workaround is named with its project: `pytorch#67742`, `owner/repo#12` or its address."""

from __future__ import annotations

import ast
import io
import re
import tokenize

from conftest import ROOT

DATE = re.compile(r"\b20\d\d-\d\d-\d\d\b")
# A duration or a speed-up: "15 s", "2 min", "5-25 ms", "40 µs", "1.6x". Not "2s" (math), "2 x 64" (a shape),
# "ANI-1x" (a name) or words such as "seconds" (a unit in a field's description).
TIMING = re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s(?:s|min)|\s?(?:ms|µs|us))\b|(?<![\w.-])\d+(?:\.\d+)?x\b")
QUOTED = re.compile(r"'[^']*'|\"[^\"]*\"|`[^`]*`")
# An issue by number alone: "issue 19", "(issues #54, #77)", "(#19)". Not "pytorch#75097" or an issue's address
# (".../issues/35"): those name whose issue it is.
ISSUE = re.compile(r"\bissues?\s+#?\d+|(?<![\w/.-])#\d+\b", re.IGNORECASE)


def python_texts(source: str):
    """(line, text) of every comment and every docstring (also a field's docstring) of a Python source."""
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            yield tok.start[0], tok.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for k, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + k, line


def yaml_comments(source: str):
    for n, line in enumerate(source.splitlines(), 1):
        if "#" in line:
            yield n, line[line.index("#"):]


def figures(text: str) -> list[str]:
    text = QUOTED.sub("", text)
    return [m.group(0) for rx in (DATE, TIMING) for m in rx.finditer(text)]


def issue_numbers(text: str) -> list[str]:
    return ISSUE.findall(QUOTED.sub("", text))


def offending_lines(check=figures, folders=("trainer", "scripts")) -> list[str]:
    found = []
    sources = [(p, python_texts) for d in folders for p in sorted((ROOT / d).rglob("*.py"))]
    sources += [(p, yaml_comments) for p in sorted((ROOT / "configs").rglob("*.yaml"))]
    for path, texts in sources:
        for n, text in texts(path.read_text(encoding="utf-8")):
            if hits := check(text):
                found.append(f"{path.relative_to(ROOT)}:{n}: {hits}: {text.strip()}")
    return found


def test_figures_are_found_and_formats_are_not():
    assert figures("# the compile takes ~15 s cold, a step 1.6x faster") == ["15 s", "1.6x"]
    assert figures("measured 2026-11-26 on 2 cores: 5-25 ms a step, 40 µs of it the guard") == [
        "2026-11-26", "25 ms", "40 µs"]
    assert figures("# 12 x 768 blocks; (1 - 2s) alpha^2; ANI-1x; timeout in seconds; '90s'; `timeout_s=1800`") == []


def test_no_dates_or_timings_in_comments_and_docstrings():
    found = offending_lines()
    assert not found, ("comments and docstrings quote no dates or timings (put the figure in BENCHMARKS.md and "
                       "say the reason here):\n" + "\n".join(found))


def test_issue_numbers_are_found_and_upstream_references_are_not():
    assert issue_numbers("# what still surprised (issue 19); GEARS issues #54, #77; fixed in (#12)") == [
        "issue 19", "issues #54", "#77", "#12"]
    assert issue_numbers("# pytorch#75097; huggingface/accelerate#3210; https://github.com/o/r/issues/35; "
                         "`#5`; 12 # 3 x 64; color #ff0000") == []


def test_no_issue_numbers_in_comments_and_docstrings():
    found = offending_lines(issue_numbers, folders=("trainer", "scripts", "tests", "benchmarks"))
    assert not found, ("comments and docstrings name no issue by its number alone (bug history goes to commit "
                       "messages; an upstream issue that explains a workaround is named as project#N or by its "
                       "address):\n" + "\n".join(found))
