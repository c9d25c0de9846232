"""How a benchmark's `--out BENCHMARKS.md` files its section (`benchmarks/bench_report.py:write_section`): at the top
of its topic, older measurements kept below, nothing else touched. In-process on small texts; no benchmark runs."""

from __future__ import annotations

import importlib.util
import re

from conftest import ROOT

_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "benchmarks" / "bench_report.py")
bench_report = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench_report)
write_section, section_title = bench_report.write_section, bench_report.section_title

FILE = """# Benchmarks

Head text.

| topic | figure |
|---|---|
| A | 1 |

## Topic A

Written by a.py.

### Speed, 2026-01-02 10:00 UTC

old speed

#### Details

old details

## Topic B

### Memory, 2026-01-01 09:00 UTC

memory figures
"""


def test_title_is_the_heading_without_its_date():
    assert section_title("## Overhead benchmark, 2026-11-22 01:55 UTC") == "Overhead benchmark"
    assert section_title("### Molecules sampling throughput, 2026-11-26 10:08-10:12 UTC") == (
        "Molecules sampling throughput")
    assert section_title("### The main job (`make train`), 2026-11-26 and 2026-11-27") == "The main job (`make train`)"
    assert section_title("## GEARS: summary, by seed") == "GEARS: summary, by seed"


def test_a_rerun_goes_on_top_of_its_topic_and_keeps_the_older_measurement(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(FILE)
    section = ("## Speed, 2026-02-03 11:00 UTC\n\nnew speed\n\n### Details\n\n```bash\n# a shell comment, not a "
               "heading\npython a.py\n```\n")
    write_section(path, section, topic="Topic B")  # the title lives in Topic A: that wins over `topic`
    text = path.read_text()
    a_start, b_start = text.index("## Topic A"), text.index("## Topic B")
    topic_a = text[a_start:b_start]
    assert topic_a.index("Written by a.py.") < topic_a.index("### Speed, 2026-02-03") < topic_a.index(
        "### Speed, 2026-01-02")
    assert "#### Details\n\n```bash\n# a shell comment, not a heading\n" in topic_a  # demoted, fence left alone
    assert "old speed" in topic_a and "old details" in topic_a
    assert text[:a_start] == FILE[:FILE.index("## Topic A")]  # head and table untouched
    assert text[b_start:] == FILE[FILE.index("## Topic B"):]  # other topics untouched


def test_the_same_heading_twice_leaves_one_copy(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(FILE)
    write_section(path, "## Memory, 2026-03-01 08:00 UTC\n\nfirst\n", topic="Topic B")
    write_section(path, "## Memory, 2026-03-01 08:00 UTC\n\nsecond\n", topic="Topic B")
    text = path.read_text()
    assert text.count("### Memory, 2026-03-01 08:00 UTC") == 1 and "second" in text and "first" not in text
    assert text.index("### Memory, 2026-03-01") < text.index("### Memory, 2026-01-01")


def test_a_new_title_goes_to_its_topic_or_a_new_one_at_the_end(tmp_path):
    path = tmp_path / "BENCHMARKS.md"
    path.write_text(FILE)
    write_section(path, "## Latency, 2026-03-01 08:00 UTC\n\nlatency\n", topic="Topic B")
    write_section(path, "## Elastic restarts, 2026-03-02 08:00 UTC\n\nrestarts\n", topic="Elastic training")
    write_section(path, "## Untopical, 2026-03-03 08:00 UTC\n\nx\n")
    text = path.read_text()
    topic_b = text[text.index("## Topic B"):text.index("## Elastic training")]
    assert topic_b.index("### Latency") < topic_b.index("### Memory")
    assert text.index("## Elastic training\n\n### Elastic restarts, 2026-03-02") < text.index(
        "## Untopical\n\n### Untopical, 2026-03-03")
    write_section(path, "## Elastic restarts, 2026-03-04 08:00 UTC\n\nagain\n", topic="Elastic training")
    assert path.read_text().count("## Elastic training") == 1


def test_benchmarks_md_round_trips_and_names_every_scripts_topic(tmp_path):
    """Writing back any measurement of the real file leaves it byte for byte; each script's TOPIC is a `## ` there."""
    real = (ROOT / "BENCHMARKS.md").read_text()
    path = tmp_path / "BENCHMARKS.md"
    measurements = re.split(r"\n(?=#{2,3} )", real)  # no fenced line of BENCHMARKS.md starts with '## ' or '### '
    measurements = [m for m in measurements if m.startswith("### ")]
    assert len(measurements) > 20
    for measurement in measurements:
        path.write_text(real)
        write_section(path, measurement)
        assert path.read_text() == real, measurement.splitlines()[0]
    topics = set(re.findall(r"^## (.+)$", real, re.M))
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        for topic in re.findall(r'^TOPIC = "(.+)"$', script.read_text(), re.M):
            assert topic in topics, f"{script.name}: TOPIC {topic!r} is no '## ' heading of BENCHMARKS.md"
