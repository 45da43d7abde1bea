"""The documentation stays true to the code: the generated pages are current and complete, the link checker finds
what is broken, and the site builds with every warning an error."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from xfam.core.registry import defaults_of

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import check_links  # noqa: E402
import generate_docs  # noqa: E402
from docgen import components  # noqa: E402
from docgen.text import fmt  # noqa: E402

CELL = r"(?:[^|\\]|\\.)+"  # a table cell's text (``\|`` escaped)


def builtin(slot: str) -> dict[str, type]:
    return {n: c for n, c in components.REGISTRIES[slot].items() if c.__module__.startswith("xfam.")}


def sections(page: str) -> dict[str, str]:
    """``{heading: its text}`` of a page's ``##`` sections."""
    parts = re.split(r"^## (.+)$", page, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


@pytest.fixture(scope="module")
def pages() -> dict[str, str]:
    with generate_docs.builtin_only():
        return {slot: components.slot_page(slot) for slot in components.PAGES} | {"index": components.index_page()}


def test_every_generated_file_is_up_to_date() -> None:
    stale, problems = generate_docs.generate(check=True)
    assert not problems, problems
    names = [str(p.relative_to(ROOT)) for p in stale]
    assert not stale, f"stale: {names}. Fix: python scripts/generate_docs.py (make generated)"


def test_the_reference_shows_exactly_the_builtin_components(pages: dict[str, str]) -> None:
    for slot in components.PAGES:
        shown = set(sections(pages[slot])) - {"Capabilities"}
        assert shown == set(builtin(slot)), slot
        assert "toy_" not in pages[slot]  # the test doubles registered by tests/doubles.py
        index = sections(pages["index"])[slot]
        linked = set(re.findall(rf"\[`(\w+)`\]\({components.PAGES[slot]}\.md#(\w+)\)", index))
        assert linked == {(n, n) for n in builtin(slot)}, slot
    registered = {n for registry in components.REGISTRIES.values() for n in registry.names()}
    assert {"toy_linear", "toy_bias", "toy_memory"} <= registered  # (so the exclusion above was tested)


def test_a_plugins_component_is_left_out() -> None:
    from xfam.api import POS

    cls = type("Plugin", (POS.base,), {"__module__": "someone_elses.plugin", "__doc__": "A plugin's encoding."})
    POS.register("plugin_pos")(cls)
    try:
        with generate_docs.builtin_only():
            assert "plugin_pos" not in components.slot_page("pos") + components.readme_slots()
        assert "plugin_pos" in POS  # restored afterwards
    finally:
        POS._classes.pop("plugin_pos")


def test_every_parameter_appears_with_its_type_default_and_range(pages: dict[str, str]) -> None:
    checked = 0
    for slot in components.PAGES:
        found = sections(pages[slot])
        for name, cls in builtin(slot).items():
            for key, default in defaults_of(cls).items():
                row = re.search(rf"^\| `{re.escape(key)}` \| {CELL} \| `([^`]*)` \| {CELL} \|", found[name], re.M)
                assert row, f"{slot}={name}: no row for {key}"
                assert row.group(1) == fmt(default), f"{slot}={name}.{key}: {row.group(1)} != {fmt(default)}"
                checked += 1
    assert checked > 150
    local = sections(pages["attention"])["local"]
    assert re.search(r"^\| `window` \| int \| `256` \| > 0 \|", local, re.M)  # Annotated[int, Positive]
    assert re.search(r"^\| `dropout` \| float \| `0.0` \| 0 ≤ x < 1 \|", local, re.M)  # Probability
    assert re.search(r"^\| `mode` \| `window` \\\| `block` \|", local, re.M)  # a Literal


def test_compatibility_states_what_the_check_refuses(pages: dict[str, str]) -> None:
    attention = sections(pages["attention"])
    assert "combines with every other component" in attention["vanilla"]
    assert "`pos=alibi`" in attention["linformer"] and "cannot add a score bias" in attention["linformer"]
    assert "`memory=xl`" in attention["lsh"]  # accepts_memory=false
    memory = sections(pages["memory"])
    assert "`pos=sinusoidal`" in memory["xl"] and "`pos=rope`" not in memory["xl"]  # needs relative positions
    assert "memory.store=DIR" in memory["spalm"]  # refused alone, until a datastore is named
    assert "`memory=xl`" in sections(pages["data"])["listops"]  # rows are not a stream


def test_readme_slot_list_is_filled_between_its_markers() -> None:
    text = "# x\n\n<!-- slots:start -->\nold\n<!-- slots:end -->\n\nrest\n"
    with generate_docs.builtin_only():
        new = generate_docs.render_readme(text)
    assert new.startswith("# x\n\n<!-- slots:start -->\n- **attention** (") and new.endswith(
        "<!-- slots:end -->\n\nrest\n"
    )
    assert "old" not in new and "[reference](docs/reference/data.md)" in new
    with pytest.raises(generate_docs.MarkersMissing):
        generate_docs.render_readme("# a README without the markers\n")


def test_the_changelog_page_shows_changelog_md_below_its_title() -> None:
    page = (ROOT / "docs" / "changelog.md").read_text()
    assert page.startswith("# Changelog\n") and '--8<-- "CHANGELOG.md:2:"' in page
    assert (ROOT / "CHANGELOG.md").read_text().startswith("# "), "the page leaves out CHANGELOG.md's title line"


# -- the link checker --------------------------------------------------------------------------------------------


def test_check_links_finds_a_broken_link_and_a_broken_anchor(tmp_path: Path) -> None:
    docs = tmp_path / "docs"
    docs.mkdir()
    (tmp_path / "README.md").write_text(
        "# Project\n\n## Usage\n\n[ok](#usage) [ok](docs/a.md#first-part) [bad](#nowhere) [gone](docs/missing.md)\n"
        "[source](xfam/x.py) and [site](https://example.org/page)\n"
    )
    (tmp_path / "xfam").mkdir()
    (tmp_path / "xfam" / "x.py").write_text("")
    (docs / "a.md").write_text(
        "# A\n\n## First part\n\n## `code` and [link](b.md) in a heading\n\n"
        "[ok](b.md#the-b-section) [bad anchor](b.md#no-such-section) [outside](../xfam/x.py)\n"
        "[ok](#code-and-link-in-a-heading) `[not a link](nowhere.md)`\n\n```\n[not a link](nowhere.md)\n```\n"
    )
    (docs / "b.md").write_text("# B\n\n## The B section\n")
    checker = check_links.Checker(tmp_path)
    for path in check_links.default_files(tmp_path):
        checker.check_file(path)
    problems = "\n".join(checker.problems)
    assert len(checker.problems) == 4, problems
    assert "README.md:5: '#nowhere': no anchor #nowhere in README.md" in problems
    assert "README.md:5: 'docs/missing.md': docs/missing.md does not exist" in problems
    assert "docs/a.md:7: 'b.md#no-such-section': no anchor #no-such-section in docs/b.md" in problems
    assert "docs/a.md:7: '../xfam/x.py' is outside docs/" in problems
    assert checker.external == {"https://example.org/page": ["README.md:6"]}  # listed, never fetched


def test_check_links_finds_lists_the_site_would_not_render() -> None:
    text = "Intro:\n* glued to the paragraph\n\n* item\n  * nested by 2\n    * nested by 4\n\n```\nx:\n* code\n```\n"
    assert check_links.layout_problems(text) == [
        (2, "a list right after a paragraph line: put a blank line before it"),
        (5, "a nested list item indented by 2 spaces: indent it by 4"),
    ]
    assert check_links.layout_problems("Intro:\n\n* item\n    * nested\n  continued\n* next\n") == []


def test_check_links_help_and_the_repository_passes() -> None:
    out = subprocess.run([sys.executable, "scripts/check_links.py", "--help"], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0 and "--list" in out.stdout
    assert check_links.main([]) == 0


def test_the_site_uses_the_slugs_the_checker_reads() -> None:
    """Anchors are GitHub's on the site too (one rule in both places): the checker's own GitHub slugs agree with
    the site's rendering of every page."""
    for page in sorted((ROOT / "docs").glob("*.md")):
        text = page.read_text()
        site = check_links.site_anchors(text)
        headings = {a for a in check_links.github_anchors(text) if not re.search(r"-\d+$", a)}
        assert headings <= site, f"{page.name}: {sorted(headings - site)[:5]}"


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line or "ERROR" in line]
    assert result.returncode == 0, "\n".join(warnings) or result.stderr[-3000:]
    assert (tmp_path / "site" / "reference" / "attention" / "index.html").is_file()
