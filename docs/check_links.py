#!/usr/bin/env python3
"""Checks the internal links of the README, the changelog, bench/README.md and the book.

Every relative link or image must name an existing file (or directory), and every `#anchor`
(alone or after `page.md`) must name a heading of that page, slugged as GitHub and mdBook do:
lower-case, spaces to `-`, punctuation dropped, `-1`, `-2`… for repeated headings. Every page
under docs/src must also be listed in docs/src/SUMMARY.md. http(s) and mailto links are not
followed. Exit status 1 with the list of failures; on success prints "N links checked".

Usage: python3 docs/check_links.py   (from anywhere; paths are taken from this file's place)
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BOOK_SRC = os.path.join(ROOT, "docs", "src")

FENCE = re.compile(r"^\s*(```|~~~)")
INLINE_CODE = re.compile(r"`+[^`]*`+")
# [text](target) and ![alt](target); the text may hold inline code or brackets one level deep.
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^()\s]*(?:\([^()]*\)[^()\s]*)*)(?:\s+\"[^\"]*\")?\s*\)")
REF_DEF = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*(\S+)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
HTML_ID = re.compile(r"""<a\s+[^>]*(?:id|name)=["']([^"']+)["']""")


def markdown_files():
    files = []
    for name in ("README.md", "CHANGELOG.md", os.path.join("bench", "README.md")):
        path = os.path.join(ROOT, name)
        if os.path.isfile(path):
            files.append(path)
    for base, _dirs, names in os.walk(BOOK_SRC):
        for name in sorted(names):
            if name.endswith(".md"):
                files.append(os.path.join(base, name))
    return files


def prose_lines(text):
    """Yields (line number, line) outside fenced code blocks."""
    fenced = False
    for number, line in enumerate(text.split("\n"), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield number, line


def slug(heading):
    """GitHub's and mdBook's anchor of a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links keep their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.replace("`", "").replace("*", "").replace("~", "")
    text = text.strip().lower()
    out = []
    for ch in text:
        if ch.isalnum() or ch in "-_":
            out.append(ch)
        elif ch.isspace():
            out.append("-")
    return "".join(out)


_anchor_cache = {}


def anchors(path):
    if path not in _anchor_cache:
        found, seen = set(), {}
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _n, line in prose_lines(text):
            m = HEADING.match(line)
            if m:
                base = slug(m.group(2))
                count = seen.get(base, 0)
                seen[base] = count + 1
                found.add(base if count == 0 else f"{base}-{count}")
            for html_id in HTML_ID.findall(line):
                found.add(html_id)
        _anchor_cache[path] = found
    return _anchor_cache[path]


def links(path):
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for number, line in prose_lines(text):
        bare = INLINE_CODE.sub("", line)
        for m in INLINE_LINK.finditer(bare):
            yield number, m.group(1).strip("<>")
        m = REF_DEF.match(bare)
        if m:
            yield number, m.group(1).strip("<>")


def check_link(source, target):
    """An error message, or None when the link resolves."""
    if re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", target):  # http:, https:, mailto:, …
        return None
    if target == "":
        return "empty link"
    file_part, _, anchor = target.partition("#")
    if file_part:
        resolved = os.path.normpath(os.path.join(os.path.dirname(source), file_part))
        if not os.path.exists(resolved):
            return f"no such file: {file_part}"
    else:
        resolved = source
    if anchor and resolved.endswith(".md") and os.path.isfile(resolved):
        if anchor not in anchors(resolved):
            return f"no heading #{anchor} in {os.path.relpath(resolved, ROOT)}"
    return None


def summary_failures():
    summary = os.path.join(BOOK_SRC, "SUMMARY.md")
    if not os.path.isfile(summary):
        return ["docs/src/SUMMARY.md is missing"]
    listed = set()
    for _n, target in links(summary):
        listed.add(os.path.normpath(os.path.join(BOOK_SRC, target.partition("#")[0])))
    failures = []
    for base, _dirs, names in os.walk(BOOK_SRC):
        for name in sorted(names):
            path = os.path.normpath(os.path.join(base, name))
            if name.endswith(".md") and name != "SUMMARY.md" and path not in listed:
                failures.append(f"{os.path.relpath(path, ROOT)}: not listed in docs/src/SUMMARY.md")
    return failures


def main():
    failures, checked = [], 0
    for path in markdown_files():
        for number, target in links(path):
            checked += 1
            error = check_link(path, target)
            if error:
                failures.append(f"{os.path.relpath(path, ROOT)}:{number}: ({target}) {error}")
    failures += summary_failures()
    if failures:
        print(f"{len(failures)} broken of {checked} links checked:")
        for failure in failures:
            print("  " + failure)
        return 1
    print(f"{checked} links checked")
    return 0


if __name__ == "__main__":
    sys.exit(main())
