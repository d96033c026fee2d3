"""Real English text from Debian packages, as jsonl corpora for tests, benchmarks and the demo.

    python -m data_pipeline.debian_text --corpus kjv jargon --out /tmp/text.jsonl.gz

Corpora (about 105 MB of text in all; `apt-get update` must have run once):
- kjv: the King James Bible (public domain), one document per chapter, decoded
  by the `bible` program of `bible-kjv` from `bible-kjv-text`'s data;
- jargon: the Jargon File (public domain), one document per entry;
- python-doc: Python 3.11's reST documentation sources, one document per page;
- perl-doc: Perl 5.36's POD manuals, one document per manual;
- linux-doc: the Linux 6.12 kernel's documentation (.rst and .txt), one document per file;
- gcide: the GNU Collaborative International Dictionary of English (Webster's 1913 and
  WordNet), whole entries in documents of ~16,000 characters;
- git-doc: Git 2.39's manual pages and guides (AsciiDoc sources), one document per file;
- postgresql-doc: PostgreSQL 15's manual, the text of each HTML page as one document.

Packages are fetched with `apt-get download` and unpacked with `dpkg -x` into a
cache directory (no root install), so a second call costs nothing.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Callable, Iterator

DEFAULT_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "mcore-stack", "debian-text")


class DebianTextUnavailable(RuntimeError):
    """apt-get/dpkg missing, or a package could not be downloaded; the message says which."""


def fetch_packages(packages: list[str], cache_dir: str = DEFAULT_CACHE) -> str:
    """Download and unpack `packages` under cache_dir; returns the unpacked root."""
    root = os.path.join(cache_dir, "root")
    os.makedirs(root, exist_ok=True)
    for tool in ("apt-get", "dpkg"):
        if shutil.which(tool) is None:
            raise DebianTextUnavailable(f"{tool} not found: Debian text needs a Debian/Ubuntu system")
    for package in packages:
        marker = os.path.join(cache_dir, f"{package}.unpacked")
        if os.path.exists(marker):
            continue
        downloads = os.path.join(cache_dir, "debs")
        os.makedirs(downloads, exist_ok=True)
        done = subprocess.run(["apt-get", "download", package], cwd=downloads,
                              capture_output=True, text=True)
        debs = glob.glob(os.path.join(downloads, f"{package}_*.deb"))
        if done.returncode != 0 or not debs:
            raise DebianTextUnavailable(f"apt-get download {package} failed ({done.stderr.strip()}); "
                                        "run 'apt-get update' once, or check the network")
        for deb in debs:
            unpacked = subprocess.run(["dpkg", "-x", deb, root], capture_output=True, text=True)
            if unpacked.returncode != 0:
                raise DebianTextUnavailable(f"dpkg -x {deb} failed: {unpacked.stderr.strip()}")
        open(marker, "w").close()
    return root


def _kjv_documents(root: str) -> Iterator[str]:
    bible = os.path.join(root, "usr", "bin", "bible")
    # -l100000: no line wrapping, one verse per line.
    out = subprocess.run([bible, "-p", os.path.join(root, "usr", "lib"), "-l100000",
                          "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    chapter: list[str] = []
    for line in out.splitlines():
        if line and not line.startswith(" "):  # "Genesis 1": a new chapter starts
            if chapter:
                yield "\n".join(chapter)
            chapter = [line, ""]
        elif line.strip():
            chapter.append(line.strip())
    if chapter:
        yield "\n".join(chapter)


def _jargon_documents(root: str) -> Iterator[str]:
    with gzip.open(os.path.join(root, "usr/share/doc/jargon-text/jargon.txt.gz"), "rt",
                   encoding="utf-8") as f:
        text = f.read()
    # Glossary entries start with an indented ":term: part-of-speech" line.
    for entry in re.split(r"\n(?=   :[^\n]+:)", text):
        entry = "\n".join(line.strip() for line in entry.strip().splitlines()).strip()
        if entry:
            yield entry


def _files_documents(*patterns: str) -> Callable[[str], Iterator[str]]:
    """One document per file matching any of `patterns` (.gz files are decompressed)."""
    def documents(root: str) -> Iterator[str]:
        paths = {p for pattern in patterns for p in glob.glob(os.path.join(root, pattern),
                                                                recursive=True)}
        for path in sorted(paths):
            with (gzip.open(path) if path.endswith(".gz") else open(path, "rb")) as f:
                text = f.read().decode("utf-8", errors="replace").strip()
            if text:
                yield text
    return documents


def _gcide_documents(root: str, document_chars: int = 16_000) -> Iterator[str]:
    """The dictionary's entries (each starts unindented after a blank line), in documents of
    whole consecutive entries up to ~16,000 characters: ~300-character entries as documents
    would make a corpus of a kind the others are not (tweets, not pages). The file is
    Latin-1 in a few places; those bytes become U+FFFD, as in _files_documents."""
    with gzip.open(os.path.join(root, "usr/share/dictd/gcide.dict.dz")) as f:  # dictzip is gzip
        text = f.read().decode("utf-8", errors="replace")
    entries = [entry.strip("\n") for entry in re.split(r"\n\n(?=\S)", text)]
    entries = [entry for entry in entries if entry and not entry.startswith("00-database")]
    group: list[str] = []
    size = 0
    for entry in entries:
        if group and size + len(entry) > document_chars:
            yield "\n\n".join(group)
            group, size = [], 0
        group.append(entry)
        size += len(entry) + 2
    if group:
        yield "\n\n".join(group)


# Tags whose text is its own line (or lines) in the page as a browser shows it.
_HTML_BLOCKS = frozenset("address blockquote br dd div dl dt h1 h2 h3 h4 h5 h6 hr li ol p pre table td "
                         "th title tr ul".split())


def _html_documents(pattern: str) -> Callable[[str], Iterator[str]]:
    """One document per HTML page matching `pattern`: its text (script and style left out),
    runs of blank lines squeezed."""
    from html.parser import HTMLParser

    class Text(HTMLParser):
        def __init__(self) -> None:
            super().__init__(convert_charrefs=True)
            self.parts: list[str] = []
            self._skip = 0

        def handle_starttag(self, tag, attrs) -> None:
            self._skip += tag in ("script", "style")
            if tag in _HTML_BLOCKS:
                self.parts.append("\n")

        def handle_endtag(self, tag) -> None:
            self._skip -= tag in ("script", "style") and self._skip > 0
            if tag in _HTML_BLOCKS:
                self.parts.append("\n")

        def handle_data(self, data: str) -> None:
            if not self._skip:
                self.parts.append(data)

    def documents(root: str) -> Iterator[str]:
        for path in sorted(glob.glob(os.path.join(root, pattern), recursive=True)):
            parser = Text()
            with open(path, "rb") as f:
                parser.feed(f.read().decode("utf-8", errors="replace"))
            parser.close()
            lines = (line.rstrip() for line in "".join(parser.parts).splitlines())
            text = re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip()
            if text:
                yield text
    return documents


CORPORA: dict[str, tuple[list[str], Callable[[str], Iterator[str]]]] = {
    "kjv": (["bible-kjv", "bible-kjv-text"], _kjv_documents),
    "jargon": (["jargon-text"], _jargon_documents),
    "python-doc": (["python3.11-doc"],
                   _files_documents("usr/share/doc/python3.11/html/_sources/**/*.rst.txt")),
    "perl-doc": (["perl-doc"], _files_documents("usr/share/perl/*/pod/*.pod")),
    "linux-doc": (["linux-doc-6.12"],
                  _files_documents("usr/share/doc/linux-doc-6.12/Documentation/**/*.rst.gz",
                                   "usr/share/doc/linux-doc-6.12/Documentation/**/*.txt.gz")),
    "gcide": (["dict-gcide"], _gcide_documents),
    "git-doc": (["git-doc"], _files_documents("usr/share/doc/git-doc/**/*.txt")),
    "postgresql-doc": (["postgresql-doc-15"], _html_documents("usr/share/doc/postgresql-doc-15/html/*.html")),
}


def documents(corpus: str, cache_dir: str = DEFAULT_CACHE) -> Iterator[str]:
    """The documents of one named corpus, fetching its packages if needed."""
    if corpus not in CORPORA:
        raise ValueError(f"unknown corpus {corpus!r}; choose from {', '.join(CORPORA)}")
    packages, extract = CORPORA[corpus]
    return extract(fetch_packages(packages, cache_dir))


def write_jsonl(corpora: list[str], out_path: str, cache_dir: str = DEFAULT_CACHE) -> tuple[int, int]:
    """Write the corpora's documents as {"text": ...} lines; returns (documents, text bytes)."""
    count = size = 0
    tmp = out_path + ".partial"
    # mtime=0 in the gzip header: the same corpus always gives the same bytes.
    with (gzip.GzipFile(tmp, "wb", mtime=0) if out_path.endswith(".gz") else open(tmp, "wb")) as f:
        for corpus in corpora:
            for text in documents(corpus, cache_dir):
                f.write(json.dumps({"text": text}, ensure_ascii=False).encode("utf-8") + b"\n")
                count += 1
                size += len(text.encode("utf-8"))
    os.replace(tmp, out_path)
    return count, size


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m data_pipeline.debian_text",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--corpus", nargs="+", required=True, choices=sorted(CORPORA))
    parser.add_argument("--out", required=True, help=".jsonl or .jsonl.gz to write")
    parser.add_argument("--cache-dir", default=DEFAULT_CACHE, help="where packages are unpacked")
    args = parser.parse_args(argv)
    try:
        count, size = write_jsonl(args.corpus, args.out, args.cache_dir)
    except DebianTextUnavailable as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    print(f"wrote {count:,} documents, {size / 1e6:.1f} MB of text to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
