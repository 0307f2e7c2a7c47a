#!/usr/bin/env python3
"""Fails on measurement narratives in the comments of src/**/*.rs.

Comments say why, in the present tense; figures from a run belong in
bench/results/, not in the code. This check reads the comment part of every
line (`//`, `///`, `//!` and `/* ... */` block comments, nested ones too;
string and character literals are skipped, so "http://x" is no comment) and
matches each comment line, case-insensitively, against the patterns below
(the house rules' list, no broader). Every hit is printed as file:line: text;
the exit status is 1 when there is one.

Usage:
  python3 tools/check_comments.py            # checks src/
  python3 tools/check_comments.py PATH...    # checks these files or folders
  python3 tools/check_comments.py --self-test
"""

import os
import re
import sys

PATTERNS = [
    r"callgrind",
    r"perf record",
    r"perf stat",
    r"[0-9][0-9,.]* ?instructions",
    r"~ ?[0-9]",
    r"[0-9][0-9,.]* ?(->|→) ?[0-9]",
    r"this session",
    r"previous session",
    r"as before",
    r"re-run",
]
NARRATIVE = re.compile("|".join(f"(?:{p})" for p in PATTERNS), re.IGNORECASE)

# A character literal at a quote ('a', '\n', '\u{1F600}', '"'); a quote not
# starting one begins a lifetime or a label ('a, 'static).
CHAR_LITERAL = re.compile(r"'(?:\\[^']*|[^\\'\n])'")
RAW_STRING = re.compile(r'(?:br|cr|r)(#*)"')


def string_start(text, i):
    """Whether a string literal starts at i: `"`, or a prefix (b, c, r, br,
    cr) not ending an identifier, then the quote."""
    if text[i] == '"':
        return True
    if text[i] not in "bcr" or (i > 0 and (text[i - 1].isalnum() or text[i - 1] == "_")):
        return False
    return bool(RAW_STRING.match(text, i)) or (text[i] in "bc" and text.startswith('"', i + 1))


def comments(text):
    """Yields (line number, comment text) for each line holding comment text;
    a block comment spanning lines yields one item per line."""
    i, n, line = 0, len(text), 1
    pending = {}  # line -> comment text gathered on it

    def add(ln, s):
        pending[ln] = pending.get(ln, "") + s

    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            end = text.find("\n", i)
            end = n if end < 0 else end
            add(line, text[i:end])
            i = end
        elif text.startswith("/*", i):
            depth, j, start = 1, i + 2, i
            while j < n and depth:
                if text.startswith("/*", j):
                    depth, j = depth + 1, j + 2
                elif text.startswith("*/", j):
                    depth, j = depth - 1, j + 2
                else:
                    j += 1
            for k, part in enumerate(text[start:j].split("\n")):
                add(line + k, part)
            line += text.count("\n", start, j)
            i = j
        elif string_start(text, i):
            m = RAW_STRING.match(text, i)
            if m:  # raw string: ends at `"` followed by as many `#`
                close = '"' + m.group(1)
                end = text.find(close, m.end())
                end = n if end < 0 else end + len(close)
            else:  # plain (or byte / C) string with escapes
                j = text.index('"', i) + 1
                while j < n and text[j] != '"':
                    j += 2 if text[j] == "\\" else 1
                end = min(j + 1, n)
            line += text.count("\n", i, end)
            i = end
        elif c == "'":
            m = CHAR_LITERAL.match(text, i)
            i = m.end() if m else i + 1
        else:
            i += 1
    yield from sorted(pending.items())


def hits(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    for ln, comment in comments(text):
        if NARRATIVE.search(comment):
            yield ln, comment.strip()


def rust_files(paths):
    for p in paths:
        if os.path.isdir(p):
            for d, dirs, files in os.walk(p):
                dirs.sort()
                for name in sorted(files):
                    if name.endswith(".rs"):
                        yield os.path.join(d, name)
        else:
            yield p


def self_test():
    sample = '''//! Layer: lane. Picks a lane.
/// Costs ~40 instructions per call.
fn f<'a>(s: &'a str) -> char {
    let url = "http://x/~1 // not a comment";
    let raw = r#"a "// ~2" b"#;
    let q = '"'; // 21,752 -> 21,592 after the change
    /* outer /* nested: callgrind */
       still the block: as before */
    let b = b"/* no */"; let c = '\\''; // one allocation per request
    'x'
}
// Re-run next time; this session's numbers.
'''
    got = [ln for ln, _ in ((ln, c) for ln, c in comments(sample) if NARRATIVE.search(c))]
    want = [2, 6, 7, 8, 12]
    assert got == want, f"hits on lines {got}, expected {want}"
    texts = dict(comments(sample))
    assert 4 not in texts and 5 not in texts, texts
    assert texts[9].strip() == "// one allocation per request", texts[9]
    print("self-test passed")


def main(argv):
    if argv == ["--self-test"]:
        self_test()
        return 0
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = argv or [os.path.join(root, "src")]
    found = 0
    for path in rust_files(paths):
        rel = os.path.relpath(path, root) if not argv else path
        for ln, comment in hits(path):
            print(f"{rel}:{ln}: {comment}")
            found += 1
    if found:
        print(f"{found} comment line(s) with a measurement narrative: comments say why, in the "
              f"present tense; figures from a run go to bench/results/", file=sys.stderr)
        return 1
    print("no measurement narratives in comments")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
