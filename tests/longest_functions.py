#!/usr/bin/python3
"""The longest functions in src/ and kernels/ (issue 22 item 4).

A brace-matching scan: a function is a `{ ... }` block at namespace level
(or a member defined in a class body) whose opening line looks like a
signature, i.e. has a `(` before the `{` and is not a control statement,
an initialiser list or a table. Comments and string literals are skipped.

    tests/longest_functions.py SRC [--top N] [--limit L]

Prints the N longest (lines from the signature to the closing brace); exits
1 when one is longer than L lines. Tables (a `= {` initialiser, a static
table in a function whose body is one statement) are not functions.
"""
import os
import re
import sys


def strip(text):
    """Blanks comments and string/char literals, keeping line breaks."""
    out = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append(" " * (j - i))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c == 'R' and text.startswith('R"', i):
            m = re.match(r'R"([^(]*)\(', text[i:])
            end = ')' + (m.group(1) if m else '') + '"'
            j = text.find(end, i)
            j = n if j < 0 else j + len(end)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            j = i + 1
            while j < n and text[j] != c:
                j += 2 if text[j] == "\\" else 1
            j += 1
            out.append(c + re.sub(r"[^\n]", " ", text[i + 1:j - 1]) + c)
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


CONTROL = re.compile(r"\b(if|for|while|switch|catch|do|else|return)\b\s*(\(|\{|$)")


def functions(path):
    text = strip(open(path, encoding="utf-8", errors="replace").read())
    res = []
    depth = 0
    # stack of (kind, start_index) for open braces; kind: 'ns' (namespace,
    # class, extern) or 'fn' or 'other'
    stack = []
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == "{":
            # the text since the previous ; { } is the head of this block
            k = max(text.rfind(";", 0, i), text.rfind("{", 0, i), text.rfind("}", 0, i))
            head = text[k + 1:i]
            h = " ".join(head.split())
            in_fn = any(kind == "fn" for kind, _ in stack)
            if in_fn:
                kind = "other"
            elif re.search(r"\b(namespace|class|struct|union|enum)\b[^()]*$", h) or h.startswith("extern"):
                kind = "ns"
            elif "(" in h and not CONTROL.search(h) and not re.search(r"=\s*$", h):
                kind = "fn"
            else:
                kind = "other"
            start = k + 1
            # the signature's first line: skip the blank lines after the previous statement
            while start < i and text[start] in " \t\n":
                start += 1
            stack.append((kind, start))
        elif c == "}":
            if stack:
                kind, start = stack.pop()
                if kind == "fn":
                    first = text.count("\n", 0, start) + 1
                    last = text.count("\n", 0, i) + 1
                    sig = " ".join(text[start:text.find("{", start)].split())
                    name = re.search(r"([A-Za-z_~][\w:<>~]*)\s*\((?!.*\()", sig)
                    name = name.group(1) if name else sig[:60]
                    # lambdas/initialisers at namespace level: `= [..](..) {`
                    if re.search(r"=\s*\[", sig):
                        pass
                    else:
                        res.append((last - first + 1, path, first, name))
        i += 1
    return res


def main():
    args = sys.argv[1:]
    src = args[0] if args and not args[0].startswith("--") else "."
    top = 25
    limit = None
    if "--top" in args:
        top = int(args[args.index("--top") + 1])
    if "--limit" in args:
        limit = int(args[args.index("--limit") + 1])
    allf = []
    for root in ("src", "kernels"):
        for d, _, fs in os.walk(os.path.join(src, root)):
            for f in fs:
                if f.endswith((".cpp", ".h", ".cu")):
                    allf.extend(functions(os.path.join(d, f)))
    allf.sort(key=lambda t: (-t[0], t[1], t[2]))
    print(f"longest functions in src/ and kernels/ ({len(allf)} functions; lines from signature to closing brace)")
    for lines, path, line, name in allf[:top]:
        print(f"  {lines:5d}  {os.path.relpath(path, src)}:{line}  {name}")
    over = [t for t in allf if limit is not None and t[0] > limit]
    if over:
        print(f"FAIL: {len(over)} function(s) over the limit of {limit} lines")
        return 1
    if limit is not None:
        print(f"ok: none over {limit} lines")
    return 0


if __name__ == "__main__":
    sys.exit(main())
