"""The Debian corpora's extractors on small files laid out as their packages lay them out
(no download: the real packages are read by the tests and benchmarks that use them)."""

from __future__ import annotations

import gzip
import os

from data_pipeline.debian_text import CORPORA, _gcide_documents, _html_documents


def _write(root, relative: str, data: bytes) -> None:
    path = os.path.join(root, relative)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(data)


def test_gcide_entries_are_grouped_whole_and_the_header_dropped(tmp_path):
    entries = [f"Word{i} \\Word{i}\\ n.\n   1. The {i}th meaning, as in caf\u00e9.\n   [1913 Webster]"
               for i in range(40)]
    text = "\n\n00-database-url\n   ftp://ftp.gnu.org/gnu/gcide\n\n" + "\n\n".join(entries) + "\n"
    raw = text.encode("utf-8").replace("caf\u00e9".encode("utf-8"), b"caf\xe9")  # one Latin-1 byte
    _write(tmp_path, "usr/share/dictd/gcide.dict.dz", gzip.compress(raw))
    docs = list(_gcide_documents(str(tmp_path), document_chars=400))
    assert len(docs) > 5 and all(len(d) <= 400 for d in docs)
    split = [entry for doc in docs for entry in doc.split("\n\n")]
    expected = [e.replace("caf\u00e9", "caf\ufffd") for e in entries]
    assert split == expected  # every entry once, whole, in order; the database header gone


def test_html_pages_become_their_text_in_lines(tmp_path):
    page = (b"<html><head><title>9.1. Logical Operators</title><style>p {color: red}</style>"
            b"<script>var x = 1;</script></head><body><div class=\"nav\">Prev</div><div>Up</div>"
            b"<h2>9.1. Logical Operators</h2><p>The usual operators: <code>AND</code> &amp; "
            b"<code>OR</code>.</p><ul><li>one</li><li>two</li></ul>\n\n\n\n<pre>SELECT 1;</pre>"
            b"</body></html>")
    _write(tmp_path, "html/functions-logical.html", page)
    _write(tmp_path, "html/empty.html", b"<html><body><script>only()</script></body></html>")
    docs = list(_html_documents("html/*.html")(str(tmp_path)))
    assert len(docs) == 1
    lines = docs[0].split("\n")
    assert lines[0] == "9.1. Logical Operators" and "Prev" in lines and "Up" in lines
    assert "The usual operators: AND & OR." in lines and "one" in lines and "SELECT 1;" in lines
    assert "color" not in docs[0] and "var x" not in docs[0] and "\n\n\n" not in docs[0]


def test_every_corpus_names_its_packages():
    assert {"gcide", "git-doc", "postgresql-doc"} <= set(CORPORA)
    assert all(packages and callable(extract) for packages, extract in CORPORA.values())
