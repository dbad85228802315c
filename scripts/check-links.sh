#!/usr/bin/env bash
# Checks the documentation's relative links: every Markdown link, image and reference definition (and
# HTML href/src) in README.md, docs/**/*.md and bench/**/*.md must name a file or folder that exists, and a
# `#anchor` must match a heading of the target Markdown file by GitHub's slug rule (lowercase; spaces become
# '-'; punctuation other than '-' and '_' dropped; repeated headings get -1, -2, ...). Links with a scheme
# (http:, https:, mailto:, ...) are not fetched. Also fails when README.md has more than 200 lines.
# Prints each problem as `file:line: link -> why` and exits 1 if there is any. Python 3 standard library
# only, no network.
set -euo pipefail
cd "$(dirname "$0")/.."

exec python3 - "$@" <<'PYEOF'
import os, re, sys, unicodedata
from urllib.parse import unquote

MAX_README_LINES = 200
ROOT = os.getcwd()


def markdown_files():
    files = ["README.md"] if os.path.isfile("README.md") else []
    for top in ("docs", "bench"):
        for d, dirs, names in os.walk(top):
            dirs.sort()
            files += [os.path.join(d, n) for n in sorted(names) if n.endswith(".md")]
    return files


FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")


def prose_lines(text):
    """(line number, line, line with inline code spans blanked) outside fenced code blocks."""
    fence = None
    for no, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip().strip(fence[0]):
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield no, line, blank_code_spans(line)


def blank_code_spans(line):
    out, i = [], 0
    while i < len(line):
        if line[i] == "`":
            j = i
            while j < len(line) and line[j] == "`":
                j += 1
            ticks = line[i:j]
            end = line.find(ticks, j)
            # a closing run of exactly the same length
            while end != -1 and line[end + len(ticks):end + len(ticks) + 1] == "`":
                end = line.find(ticks, end + len(ticks) + 1)
            if end == -1:
                out.append(ticks)
                i = j
                continue
            out.append(" " * (end + len(ticks) - i))
            i = end + len(ticks)
        else:
            out.append(line[i])
            i += 1
    return "".join(out)


def slug(heading):
    """GitHub's anchor for a heading's text."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # links and images: their text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    text = text.strip().lower()
    kept = []
    for c in text:
        cat = unicodedata.category(c)
        if c in "-_" or c == " " or cat[0] in "LN" or cat[0] == "M" or cat == "Pc":
            kept.append(c)
    return "".join(kept).replace(" ", "-")


ANCHOR_CACHE = {}


def anchors(path):
    if path in ANCHOR_CACHE:
        return ANCHOR_CACHE[path]
    with open(path, encoding="utf-8") as f:
        text = f.read()
    found, seen = set(), {}
    prev = prev_raw = None
    for no, raw, line in prose_lines(text):
        raw = raw.replace("`", "")  # a code span's text is part of the heading
        heading = None
        m = re.match(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$", line)
        if m:
            heading = (re.match(r"^ {0,3}#{1,6}(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$", raw).group(1) or "")
        elif prev is not None and prev.strip() and re.match(r"^ {0,3}(=+|-+)[ \t]*$", line) \
                and not re.match(r"^ {0,3}([-*+]|\d+[.)])( |$)", prev) and "|" not in prev:
            heading = prev_raw.strip()
        if heading is not None:
            s = slug(heading)
            n = seen.get(s, 0)
            seen[s] = n + 1
            found.add(s if n == 0 else f"{s}-{n}")
        for a in re.findall(r"""<a\s[^>]*?(?:name|id)\s*=\s*["']([^"']+)["']""", line):
            found.add(a)
        prev, prev_raw = line, raw
    ANCHOR_CACHE[path] = found
    return found


def destination(s):
    """The link destination at the start of s (just after '('), or None."""
    s = s.lstrip()
    if s.startswith("<"):
        end = s.find(">")
        return s[1:end] if end != -1 else None
    depth, out = 0, []
    for c in s:
        if c == "(":
            depth += 1
        elif c == ")":
            if depth == 0:
                break
            depth -= 1
        elif c.isspace():
            break
        out.append(c)
    return "".join(out)


def links(line):
    # inline links and images: ](dest ...), with a '[' earlier on the line
    for m in re.finditer(r"\]\(", line):
        if "[" not in line[:m.start()]:
            continue
        dest = destination(line[m.end():])
        if dest is not None:
            yield dest
    # reference definitions: [label]: dest
    m = re.match(r"^ {0,3}\[[^\]]+\]:[ \t]*(\S+)", line)
    if m:
        yield m.group(1).strip("<>")
    # HTML
    for m in re.finditer(r"""<(?:a|img|source)\s[^>]*?(?:href|src)\s*=\s*["']([^"']*)["']""", line):
        yield m.group(1)


def check(path, no, link):
    if not link:
        return "empty link"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", link) or link.startswith("//"):
        return None  # external: not fetched
    target, _, anchor = link.partition("#")
    target = unquote(target.split("?", 1)[0])
    if target.startswith("/"):
        resolved = os.path.normpath(os.path.join(ROOT, target.lstrip("/")))
    elif target:
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), target))
    else:
        resolved = path
    if not os.path.exists(resolved):
        return f"no such file: {os.path.relpath(resolved, ROOT)}"
    if os.path.relpath(os.path.abspath(resolved), ROOT).startswith(".."):
        return "outside the repository"
    if not anchor:
        return None
    anchor = unquote(anchor)
    md = resolved
    if os.path.isdir(md):
        md = os.path.join(md, "README.md")
        if not os.path.isfile(md):
            return f"anchor #{anchor} on a folder without README.md"
    if not md.endswith(".md"):
        if re.fullmatch(r"L\d+(-L\d+)?", anchor):
            return None  # a line anchor into a source file
        return f"anchor #{anchor} on a file that is not Markdown"
    if anchor not in anchors(md):
        return f"no heading with anchor #{anchor} in {os.path.relpath(md, ROOT)}"
    return None


problems = 0
checked = 0
for path in markdown_files():
    with open(path, encoding="utf-8") as f:
        text = f.read()
    for no, _, line in prose_lines(text):
        for link in links(line):
            checked += 1
            why = check(path, no, link)
            if why:
                print(f"{path}:{no}: {link} -> {why}")
                problems += 1

if os.path.isfile("README.md"):
    with open("README.md", encoding="utf-8") as f:
        n = sum(1 for _ in f)
    if n > MAX_README_LINES:
        print(f"README.md:{n}: (length) -> README.md has {n} lines, more than {MAX_README_LINES}: move detail into docs/")
        problems += 1

sys.stdout.flush()
if problems:
    print(f"check-links.sh: {problems} problem(s) in {checked} links", file=sys.stderr)
    sys.exit(1)
print(f"check-links.sh: {checked} links OK", file=sys.stderr)
PYEOF
