"""Every relative link in the project's documents resolves, and no file points at notes outside the project.

Documents: README.md, docs/*.md and the markdown cells of every lessons/*/*.ipynb. For each relative link or image
(`[text](target)`, `![alt](target)`, `<img src="target">`) the target file must exist, relative to the document;
a `#anchor` into a .md file must name one of its headings, by GitHub's rule (lowercase; drop everything but
letters, digits, spaces, hyphens and underscores; spaces become hyphens; a repeated heading gets -1, -2, ...).
Links with a scheme (https:, mailto:) are not fetched.
"""
import json
import re
import subprocess
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
IMG = re.compile(r"<img\s[^>]*src=[\"']([^\"']+)[\"']", re.I)
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")
FORBIDDEN = ("FORMULAS.md", "DESIGN.md", "../shared")


def documents():
    """(path, markdown text) of every document whose links must resolve."""
    docs = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    out = [(p, p.read_text(encoding="utf-8")) for p in docs if p.exists()]
    for nb in sorted((ROOT / "lessons").glob("*/*.ipynb")):
        cells = json.loads(nb.read_text(encoding="utf-8"))["cells"]
        text = "\n\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown")
        out.append((nb, text))
    return out


def links(text):
    """The link targets of a markdown text, outside code blocks and code spans."""
    text = CODE.sub("", FENCE.sub("", text))
    return LINK.findall(text) + IMG.findall(text)


def github_anchor(heading):
    """The id GitHub gives a heading: the rendered text, lowercased, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text
    text = re.sub(r"<[^>]+>", "", text).replace("`", "").replace("*", "")
    text = re.sub(r"(?<!\w)_+|_+(?!\w)", "", text)  # _emphasis_, not snake_case
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(md_text):
    """Every heading anchor of a markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen, out = {}, set()
    for line in FENCE.sub("", md_text).splitlines():
        m = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        a = github_anchor(m.group(1))
        n = seen.get(a, 0)
        seen[a] = n + 1
        out.add(a if n == 0 else f"{a}-{n}")
    return out


def broken(path, target):
    """Why `target` (a link in `path`) does not resolve, or None."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("//"):
        return None  # a URL: not checked here
    file, _, anchor = target.partition("#")
    dest = (path.parent / unquote(file)).resolve() if file else path
    if not dest.exists():
        return f"{dest.relative_to(ROOT) if dest.is_relative_to(ROOT) else dest} does not exist"
    if not dest.is_relative_to(ROOT):
        return "points outside the project"
    if anchor and dest.suffix == ".md" and unquote(anchor).lower() not in anchors(dest.read_text(encoding="utf-8")):
        return f"{dest.relative_to(ROOT)} has no heading with the anchor #{anchor}"
    return None


@pytest.mark.parametrize("path,text", documents(), ids=lambda x: x.name if isinstance(x, Path) else "")
def test_relative_links_resolve(path, text):
    bad = [f"{target}: {why}" for target in links(text) if (why := broken(path, target))]
    assert not bad, f"{path.relative_to(ROOT)}:\n  " + "\n  ".join(bad)


def test_the_reference_exists_and_the_lessons_link_it():
    ref = ROOT / "docs" / "reference.md"
    assert ref.exists()
    lessons = [(p, text) for p, text in documents() if p.suffix == ".ipynb"]
    unlinked = [p.name for p, text in lessons if not any(t.startswith("../../docs/reference.md") for t in links(text))]
    assert lessons and not unlinked, f"lessons that never link docs/reference.md: {unlinked}"


def test_the_anchor_rule():
    assert github_anchor("ZeRO: memory and communication per rank") == "zero-memory-and-communication-per-rank"
    assert github_anchor("Activation memory (Korthikanti et al. 2022)") == "activation-memory-korthikanti-et-al-2022"
    assert github_anchor("`no_sync` and *buckets*") == "no_sync-and-buckets"
    assert anchors("# A\n## A\n```\n# not a heading\n```\n### B: c\n") == {"a", "a-1", "b-c"}


def test_no_file_points_outside_the_project():
    """The project carries its own references: no file names notes that are not part of it."""
    files = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                           capture_output=True, text=True, check=True).stdout.split("\n")
    me = Path(__file__).resolve()
    hits = []
    for name in filter(None, files):
        path = ROOT / name
        if path.resolve() == me or not path.is_file() or "site-packages/" in name:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary files (figures, the compressed corpus)
        for word in FORBIDDEN:
            for i, line in enumerate(text.splitlines(), 1):
                if word in line:
                    hits.append(f"{name}:{i}: {word}")
    assert not hits, "mentions of notes outside the project:\n  " + "\n  ".join(hits)


def test_every_lesson_links_the_notation_table():
    """One notation for the course (docs/reference.md, "Notation"): every lesson points its reader to it."""
    lessons = sorted((ROOT / "lessons").glob("[0-9][0-9]_*/[0-9][0-9]_*.py"))
    assert len(lessons) >= 11
    missing = [p.name for p in lessons if "docs/reference.md#notation" not in p.read_text(encoding="utf-8")]
    assert not missing, f"these lessons do not link the notation table: {missing}"
    assert "## Notation" in (ROOT / "docs" / "reference.md").read_text(encoding="utf-8")
