"""Check every relative link and anchor of the documentation, offline.

python scripts/check_links.py            # README.md, CHANGELOG.md and docs/**/*.md; exit 1 on a broken link
python scripts/check_links.py --list     # ... and print every external URL (never fetched)
python scripts/check_links.py FILE ...   # only these files

A relative link must name a file of the repository, and its ``#anchor`` a heading (or an explicit id) of its
target. Where a link is followed decides the rules:

* README.md and CHANGELOG.md are read on GitHub: a link may name any file of the repository, and anchors are
  GitHub's heading slugs (lower case, punctuation dropped, every space a hyphen; a repeated heading gets -1, -2).
* a page of docs/ is served by the site (``mkdocs build``): a link must stay inside docs/ (the site serves
  nothing else: name source files as code spans), and anchors are the ids the site renders, found by rendering
  the target with mkdocs.yml's own Markdown extensions (so the configured ``toc`` slugify decides).
* a file a docs page includes (``--8<-- "CHANGELOG.md"``, pymdownx.snippets) is read in both places: its links
  must also resolve from the including page.

Pages of docs/ are also checked for the two list layouts GitHub renders and the site does not: a list right
after a paragraph's line, and a nested item indented by fewer than 4 spaces.

External links (http, https) are counted, and listed with ``--list``; nothing is fetched (the check runs
offline and gives the same answer every time).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import html
import os
import re
import sys
import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[1]
DOCS = "docs"
GITHUB = "github"  # the rules of a link followed on GitHub
SITE = "site"  # the rules of a link followed on the documentation site

FENCE = re.compile(r"^[ \t]*(```+|~~~+)[^\n]*\n.*?^[ \t]*\1[ \t]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(?!`).+?(?<!`)\1(?!`)", re.S)
COMMENT = re.compile(r"<!--.*?-->", re.S)
# [text](target "title") and ![alt](target): one level of nested brackets in the text.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>\n]*>|[^)\s]+)(?:\s+(?:\"[^\"]*\"|'[^']*'))?\s*\)")
REFERENCE = re.compile(r"^[ ]{0,3}\[[^\]\n]+\]:[ \t]*(<[^>\n]*>|\S+)", re.M)
AUTOLINK = re.compile(r"<(https?://[^>\s]+)>")
HTML_LINK = re.compile(r"<(?:a|img|source)\b[^>]*?\b(?:href|src)=[\"']([^\"']+)[\"']", re.I)
SNIPPET = re.compile(r"^[ \t]*-{1,}8<-{1,}[ \t]+[\"']([^\"'\n]+)[\"'][ \t]*$", re.M)
ATX = re.compile(r"^[ ]{0,3}(#{1,6})[ \t]+(.*?)(?:[ \t]+#+)?[ \t]*$", re.M)
SETEXT = re.compile(r"^([^\n]*\S[^\n]*)\n[ ]{0,3}(=+|-+)[ \t]*$", re.M)
EXPLICIT_ID = re.compile(r"<a\b[^>]*\b(?:id|name)=[\"']([^\"']+)[\"']", re.I)
EXTERNAL = ("http://", "https://")
IGNORED = ("mailto:", "ftp://", "data:")


@dataclass(frozen=True)
class Link:
    source: Path  # the file that holds the link
    line: int
    target: str  # as written


def blank(match: re.Match[str]) -> str:
    """A match replaced by spaces, its newlines kept (so offsets still give line numbers)."""
    return re.sub(r"[^\n]", " ", match.group(0))


def prose(text: str) -> str:
    """``text`` without code blocks, code spans and HTML comments (their brackets are not links)."""
    return CODE_SPAN.sub(blank, FENCE.sub(blank, COMMENT.sub(blank, text)))


def links(path: Path, text: str) -> Iterator[Link]:
    body = prose(text)
    found = []
    for pattern in (INLINE, REFERENCE, AUTOLINK, HTML_LINK):
        found += [(m.start(1), m.group(1).strip("<>")) for m in pattern.finditer(body)]
    for start, target in sorted(found):
        yield Link(path, body.count("\n", 0, start) + 1, html.unescape(target))


LIST_ITEM = re.compile(r"^( *)([*+-]|\d+[.)])[ \t]+\S")


def layout_problems(text: str) -> list[tuple[int, str]]:
    """Lists the site would not render as GitHub does (Python-Markdown's rules): a list right after a line of a
    paragraph (the site reads it as more of the paragraph), and a nested item indented by fewer than 4 spaces
    (the site flattens it). ``(line, problem)`` each; code blocks are skipped."""
    lines = FENCE.sub(blank, text).split("\n")
    out = []
    for i, line in enumerate(lines):
        item = LIST_ITEM.match(line)
        if not item or i == 0:
            continue
        indent = len(item.group(1))
        if indent == 0 and lines[i - 1].strip():
            start = next((j + 1 for j in range(i - 1, -1, -1) if not lines[j].strip()), 0)
            first = lines[start]
            if not LIST_ITEM.match(first) and not first.lstrip().startswith(("|", "<", ">")):
                out.append((i + 1, "a list right after a paragraph line: put a blank line before it"))
        elif 0 < indent < 4:
            parent = next((x for x in reversed(lines[:i]) if x.strip() and not x.startswith(" ")), "")
            if LIST_ITEM.match(parent):
                out.append((i + 1, f"a nested list item indented by {indent} spaces: indent it by 4"))
    return out


def snippets(text: str) -> list[str]:
    """Files included by pymdownx.snippets (``--8<-- "path"``, from the repository root; a ``:2:`` line range or
    ``:name`` section after the path is not part of it)."""
    return [
        re.sub(r"(:-?[0-9]*){1,2}$|:[a-z][-_0-9a-z]*$", "", s, flags=re.I)
        for s in SNIPPET.findall(FENCE.sub(blank, text))
    ]


# -- anchors -----------------------------------------------------------------------------------------------


def strip_inline(text: str) -> str:
    """A heading's text as rendered: links and images by their text, code spans by their content, no markup."""
    text = re.sub(r"!?\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2).strip(), text)
    text = re.sub(r"<[^>]+>", "", text)
    text = re.sub(r"(\*\*|__|\*|~~)(?=\S)(.+?)(?<=\S)\1", r"\2", text)
    return html.unescape(text)


def github_slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, only letters, digits, ``_``, ``-`` and spaces kept, each space
    a hyphen."""
    text = unicodedata.normalize("NFC", strip_inline(heading)).strip().lower()
    text = "".join(c for c in text if c in "-_ " or unicodedata.category(c)[0] in "LN")
    return text.replace(" ", "-")


def headings(text: str) -> list[str]:
    body = FENCE.sub(blank, COMMENT.sub(blank, text))
    found = [(m.start(), m.group(2)) for m in ATX.finditer(body)]
    found += [(m.start(), m.group(1)) for m in SETEXT.finditer(body) if not re.match(r"^\s*([-*_]\s*)+$", m.group(1))]
    return [h for _, h in sorted(found)]


def github_anchors(text: str) -> set[str]:
    out: set[str] = set()
    seen: dict[str, int] = {}
    for heading in headings(text):
        slug = github_slug(heading)
        out.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return out | set(EXPLICIT_ID.findall(text))


@contextlib.contextmanager
def _cwd(path: Path) -> Iterator[None]:
    old = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(old)


@functools.lru_cache(maxsize=4)
def site_markdown(root: Path = ROOT) -> Any:
    """A Markdown renderer with the site's extensions and their settings, read from mkdocs.yml (made in ``root``:
    pymdownx.snippets resolves its base path from the current folder)."""
    import logging

    import markdown
    from mkdocs.config import load_config

    logging.getLogger("mkdocs").setLevel(logging.ERROR)
    config = load_config(str(root / "mkdocs.yml" if (root / "mkdocs.yml").is_file() else ROOT / "mkdocs.yml"))
    with _cwd(root):
        return markdown.Markdown(extensions=config["markdown_extensions"], extension_configs=config["mdx_configs"])


def site_anchors(text: str, root: Path = ROOT) -> set[str]:
    """The ids the site renders for a page: headings (the configured slugify), attr_list ids, HTML anchors."""
    with _cwd(root):  # snippets are files of the repository
        md = site_markdown(root)
        md.reset()
        rendered = md.convert(text)
    return set(re.findall(r"\b(?:id|name)=\"([^\"]+)\"", rendered))


# -- the check ---------------------------------------------------------------------------------------------


class Checker:
    def __init__(self, root: Path = ROOT):
        self.root = root.resolve()
        self.docs = self.root / DOCS
        self.problems: list[str] = []
        self.external: dict[str, list[str]] = {}
        self.checked = 0
        self._anchors: dict[tuple[Path, str], set[str]] = {}

    def anchors(self, path: Path, rules: str) -> set[str]:
        key = (path, rules)
        if key not in self._anchors:
            text = path.read_text(encoding="utf-8")
            self._anchors[key] = site_anchors(text, self.root) if rules == SITE else github_anchors(text)
        return self._anchors[key]

    def where(self, link: Link) -> str:
        return f"{link.source.relative_to(self.root)}:{link.line}"

    def check_file(self, path: Path) -> None:
        path = path.resolve()
        text = path.read_text(encoding="utf-8")
        in_docs = self.docs in path.parents
        for link in links(path, text):
            self.check_link(link, path.parent, SITE if in_docs else GITHUB)
        for line, problem in layout_problems(text) if in_docs else []:
            self.problems.append(f"{self.where(Link(path, line, ''))}: {problem}")
        for name in snippets(text) if in_docs else []:
            included = self.root / name
            if not included.is_file():
                self.problems.append(f"{self.where(Link(path, 1, name))}: includes {name!r}, which does not exist")
                continue
            for link in links(included, included.read_text(encoding="utf-8")):
                # read on the site as part of this page: its links must resolve from here too
                self.check_link(link, path.parent, SITE, shown_in=path)

    def check_link(self, link: Link, base: Path, rules: str, shown_in: Path | None = None) -> None:
        target = link.target
        if target.startswith(EXTERNAL):
            if shown_in is None:
                self.external.setdefault(target, []).append(self.where(link))
            return
        if target.startswith(IGNORED) or not target:
            return
        self.checked += 1
        where = self.where(link) + (f" (shown in {shown_in.relative_to(self.root)})" if shown_in else "")
        path_part, _, anchor = target.partition("#")
        if path_part.startswith("/"):
            self.problems.append(f"{where}: {target!r} is absolute; write a path relative to the file")
            return
        file = (base / unquote(path_part)).resolve() if path_part else link.source
        if shown_in is not None and not path_part:
            file = shown_in.resolve()
        if self.root not in file.parents and file != self.root:
            self.problems.append(f"{where}: {target!r} points outside the repository")
            return
        if not file.exists():
            self.problems.append(f"{where}: {target!r}: {file.relative_to(self.root)} does not exist")
            return
        if rules == SITE and self.docs not in file.parents:
            self.problems.append(
                f"{where}: {target!r} is outside docs/, which the site does not serve; name it as a code span "
                f"(`{file.relative_to(self.root)}`) or link a page of docs/"
            )
            return
        if rules == SITE and file.is_dir():
            self.problems.append(f"{where}: {target!r} is a folder; link a page (its index.md)")
            return
        if anchor and file.suffix == ".md":
            found = self.anchors(file, rules)
            if unquote(anchor) not in found:
                near = sorted(a for a in found if a.startswith(anchor[:4]))[:5]
                hint = f"; headings there: {', '.join(near)}" if near else ""
                self.problems.append(f"{where}: {target!r}: no anchor #{anchor} in {file.relative_to(self.root)}{hint}")


def default_files(root: Path) -> list[Path]:
    files = [root / "README.md", root / "CHANGELOG.md", *sorted((root / DOCS).rglob("*.md"))]
    return [f for f in files if f.is_file()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", type=Path, help="Markdown files (default: README, CHANGELOG, docs/)")
    parser.add_argument("--list", action="store_true", help="print every external URL and where it is")
    parser.add_argument("--root", type=Path, default=ROOT, help="the repository (default: this one)")
    args = parser.parse_args(argv)
    checker = Checker(args.root)
    files = args.files or default_files(checker.root)
    for path in files:
        checker.check_file(path if path.is_absolute() else Path.cwd() / path)
    for problem in checker.problems:
        print(f"  {problem}", file=sys.stderr)
    sys.stderr.flush()
    urls = sum(len(w) for w in checker.external.values())
    shown = "" if args.list else "; --list shows them"
    print(
        f"check_links: {len(files)} files, {checker.checked} relative links checked, {len(checker.problems)} problems; "
        f"{urls} external links to {len(checker.external)} URLs (not fetched{shown})"
    )
    if args.list:
        for url, where in sorted(checker.external.items()):
            print(f"  {url}  ({', '.join(where)})")
    return 1 if checker.problems else 0


if __name__ == "__main__":
    sys.exit(main())
