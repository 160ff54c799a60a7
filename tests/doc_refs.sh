#!/usr/bin/env bash
# Every reference into docs/ names something that exists, and nothing points
# outside the repository (issue 24).
#
# Checked in src/ kernels/ reference/ tests/ cases/ examples/ python/ docs/,
# README.md and CMakeLists.txt:
#   docs/contract.md §N[.M]      a heading "§N[.M] ..." of docs/contract.md
#   docs/frameworks.md §N[.M]    a heading "§N[.M] ..." of docs/frameworks.md
#     (lists and ranges after one name are checked too: "§3, §5", "§10.2-§10.3")
#   docs/architecture.md idea N  a heading "Idea N: ..." of docs/architecture.md
#   docs/NAME.md "Heading"       a heading of docs/NAME.md containing that text
#                                (also after "idea N, ")
#   docs/NAME.md                 the file exists
#   NAME.md#anchor (Markdown)    a heading of NAME.md with that GitHub anchor
#   a bare §N inside docs/contract.md or docs/frameworks.md: its own heading
# (the "docs/" prefix may be left out inside docs/). Outside docs/, any
# citation of a spec document that is not in the repository fails (the
# patterns are the OLD expression below): the project cites its own docs/.
# Each problem is printed as FILE:LINE: what is wrong; exit 1 if any.
#
# Usage: doc_refs.sh SOURCE_DIR
set -u
src=${1:?usage: doc_refs.sh SOURCE_DIR}
py=$(command -v python3 || echo /usr/bin/python3)
exec "$py" - "$src" <<'PY'
import bisect, os, re, sys

root = os.path.abspath(sys.argv[1])
SCAN = ["src", "kernels", "reference", "tests", "cases", "examples", "python", "docs", "README.md", "CMakeLists.txt"]
SELF = os.path.join("tests", "doc_refs.sh")
SKIP_EXT = {".npy", ".png", ".svg", ".gz", ".bin", ".o", ".a"}

problems = []
checked = 0


def problem(path, line, msg):
    problems.append(f"{path}:{line}: {msg}")


def slug(text):
    """GitHub's anchor of a heading."""
    s = text.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s, flags=re.UNICODE)
    return s.replace(" ", "-")


class Doc:
    def __init__(self, path):
        self.sections, self.ideas, self.names, self.slugs = set(), set(), [], set()
        fence = False
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.lstrip().startswith("```"):
                    fence = not fence
                    continue
                m = None if fence else re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
                if not m:
                    continue
                text = m.group(1)
                self.names.append(text.lower())
                self.slugs.add(slug(text))
                s = re.match(r"§(\d+(?:\.\d+)*)\b", text)
                if s:
                    self.sections.add(s.group(1))
                i = re.match(r"idea\s+(\d+)\b", text, re.I)
                if i:
                    self.ideas.add(i.group(1))


docs = {}
docs_dir = os.path.join(root, "docs")
if os.path.isdir(docs_dir):
    for n in sorted(os.listdir(docs_dir)):
        if n.endswith(".md"):
            docs[n[:-3]] = Doc(os.path.join(docs_dir, n))


def files():
    for entry in SCAN:
        p = os.path.join(root, entry)
        if os.path.isfile(p):
            yield entry
        elif os.path.isdir(p):
            for d, subdirs, names in os.walk(p):
                subdirs[:] = sorted(s for s in subdirs if not s.startswith(".") and s != "__pycache__")
                for n in sorted(names):
                    rel = os.path.relpath(os.path.join(d, n), root)
                    if os.path.splitext(n)[1] not in SKIP_EXT and rel != SELF:
                        yield rel


# A comment marker at the start of a line is dropped when lines are joined, so
# that a citation broken over two comment lines is read whole.
LEAD = re.compile(r"^\s*(?:///?|#+|\*+|--|;+)?\s*")
NUM = r"\d+(?:\.\d+)*"
DOC = r"(?<![\w./-])(?:docs/)?(?P<doc>[a-z][a-z0-9_-]*)\.md"
# docs/X.md §N, with a list or range after it
SECT = re.compile(DOC + r",?\s*§(?P<first>" + NUM + r")(?P<more>(?:\s*(?:,|and|or|-|–|to)\s*§" + NUM
                  + r"|\s*[-–]\s*" + NUM + r")*)")
IDEA = re.compile(DOC + r",?\s*[Ii]dea\s+(?P<first>\d+)(?P<more>(?:\s*(?:,|and)\s*\d+\b)*)(?:,\s*\"(?P<name>[^\"\n(){};]{1,80})\")?")
NAMED = re.compile(DOC + r"(?:,\s*|\s+)\"(?P<name>[^\"\n(){};]{1,80})\"")
ANCHOR = re.compile(r"\]\((?P<file>[\w./-]*?)(?P<doc>[a-z][a-z0-9_-]*)\.md#(?P<anchor>[\w-]+)\)")
PLAIN = re.compile(DOC)
BARE = re.compile(r"§(" + NUM + r")")
OLD = re.compile(r"\bCONTRACT\b|\bFRAMEWORKS\b|DESIGN\.md|STYLE\.md|\bSTYLE(?: \d|:)|TOOLCHAIN\.md|\.\./shared|/work/shared")


def known(doc, path, line, prefixed=True):
    """Whether docs/DOC.md exists; a missing one is a problem when the
    citation said docs/ (a bare NAME.md may be another file)."""
    if doc in docs:
        return True
    if not prefixed:
        return False
    problem(path, line, f"docs/{doc}.md does not exist")
    return False


for rel in files():
    try:
        with open(os.path.join(root, rel), encoding="utf-8") as f:
            lines = f.read().split("\n")
    except (UnicodeDecodeError, OSError):
        continue
    in_docs = rel.startswith("docs" + os.sep)
    own = os.path.splitext(os.path.basename(rel))[0] if in_docs else None
    starts, parts, pos = [], [], 0
    for ln in lines:
        body = LEAD.sub("", ln, count=1)
        starts.append(pos)
        parts.append(body)
        pos += len(body) + 1
    text = " ".join(parts)

    def line_of(off):
        return bisect.bisect_right(starts, off)

    consumed = []
    for m in SECT.finditer(text):
        doc, ln = m.group("doc"), line_of(m.start())
        consumed.append((m.start(), m.end()))
        # Only the docs with numbered sections take § citations; a § after
        # another file name (an issue, a README section) is not ours.
        if doc not in ("contract", "frameworks"):
            continue
        if not known(doc, rel, ln, m.group(0).startswith("docs/")):
            continue
        for n in [m.group("first")] + re.findall(NUM, m.group("more")):
            checked += 1
            if n not in docs[doc].sections:
                problem(rel, ln, f"docs/{doc}.md has no heading §{n}")
    for m in IDEA.finditer(text):
        doc, ln = m.group("doc"), line_of(m.start())
        consumed.append((m.start(), m.end()))
        if not known(doc, rel, ln, m.group(0).startswith("docs/")):
            continue
        for n in [m.group("first")] + re.findall(r"\d+", m.group("more")):
            checked += 1
            if n not in docs[doc].ideas:
                problem(rel, ln, f"docs/{doc}.md has no heading \"Idea {n}\"")
        if m.group("name"):
            checked += 1
            if not any(m.group("name").lower() in h for h in docs[doc].names):
                problem(rel, ln, f"docs/{doc}.md has no heading \"{m.group('name')}\"")
    for m in NAMED.finditer(text):
        doc, ln = m.group("doc"), line_of(m.start())
        if not known(doc, rel, ln, m.group(0).startswith("docs/")):
            continue
        checked += 1
        if not any(m.group("name").lower() in h for h in docs[doc].names):
            problem(rel, ln, f"docs/{doc}.md has no heading \"{m.group('name')}\"")
    for m in PLAIN.finditer(text):
        if m.group(0).startswith("docs/"):
            checked += 1
            known(m.group("doc"), rel, line_of(m.start()))
    if rel.endswith(".md"):
        for m in ANCHOR.finditer(text):
            if "://" in m.group("file") or m.group("doc") not in docs:
                continue
            checked += 1
            if m.group("anchor") not in docs[m.group("doc")].slugs:
                problem(rel, line_of(m.start()), f"{m.group('doc')}.md has no heading with anchor #{m.group('anchor')}")
    if in_docs and own in ("contract", "frameworks"):
        for m in BARE.finditer(text):
            if any(a <= m.start() < b for a, b in consumed):
                continue
            checked += 1
            if m.group(1) not in docs[own].sections:
                problem(rel, line_of(m.start()), f"§{m.group(1)} is not a heading of this file")
    if not in_docs:
        for i, ln in enumerate(lines, 1):
            for m in OLD.finditer(ln):
                problem(rel, i, f"cites the spec outside the repository ({m.group(0)!r}); cite docs/ instead")

for p in problems:
    print(p)
if problems:
    print(f"doc_refs: {len(problems)} problem(s); {checked} reference(s) checked")
    sys.exit(1)
print(f"doc_refs: {checked} reference(s) into docs/ checked, none broken, none outside the repository")
PY
