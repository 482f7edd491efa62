#!/usr/bin/env python3
"""The source's shape, as docs/development.md asks it: no non-test source file over 500 lines, no
function over 80. Fails naming each file and function over.

  source_shape_test.py ROOT

Functions are found by braces: a '{' at namespace or class scope whose statement has a ')' before
it (and is not a class, struct, enum, namespace or initialiser) opens a function body, which ends
at its matching '}'. Comments, strings and character literals are blanked first, so their braces
do not count. Python (the package under python/, the tools' and examples' scripts) is read by its
own parser: a function's lines run from its `def` (or first decorator) to its last statement.
"""
import ast
import os
import re
import sys

MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 80
SOURCE_DIRS = ["base", "client", "config", "control", "cudasim", "daemon", "events", "ipc", "kernels",
               "listeners", "metrics", "proto", "storage", "tools"]
EXTENSIONS = (".cpp", ".h", ".cu", ".cuh", ".c")
PYTHON_DIRS = ["python", "tools", "examples"]
SCOPE_WORDS = re.compile(r"\b(namespace|class|struct|union|enum)\b")


def blank_comments_and_strings(text):
    """The text with comments, string and character literals replaced by spaces (newlines kept)."""
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
            m = re.match(r'R"([^(\s]*)\(', text[i:])
            if not m:
                out.append(c)
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            j = n if end < 0 else end + len(m.group(1)) + 2
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        elif c in "\"'":
            if c == "'" and i > 0 and (text[i - 1].isalnum()):  # a digit separator: 1'000
                out.append(" ")
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != c and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            j = min(j + 1, n)
            out.append(re.sub(r"[^\n]", " ", text[i:j]))
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


def long_functions(text):
    """(first line, lines, signature) of each function body over MAX_FUNCTION_LINES."""
    code = blank_comments_and_strings(text)
    code = re.sub(r"^[ \t]*#.*$", "", code, flags=re.M)  # preprocessor lines
    stack = []  # per open brace: 'scope', 'function' or 'block'
    statement_start = 0
    found = []
    line = 1
    opened_at = {}
    for pos, c in enumerate(code):
        if c == "\n":
            line += 1
        elif c in ";":
            statement_start = pos + 1
        elif c == "{":
            head = code[statement_start:pos]
            in_function = "function" in stack
            if in_function:
                kind = "block"
            elif SCOPE_WORDS.search(head) and ")" not in head.split("{")[-1].split(":")[0]:
                kind = "scope"
            elif ")" in head and not re.search(r"=\s*$", head.strip()) and "extern" not in head:
                kind = "function"
                opened_at[len(stack)] = (line, " ".join(head.split())[-120:])
            else:
                kind = "scope"
            stack.append(kind)
            statement_start = pos + 1
        elif c == "}":
            if stack:
                kind = stack.pop()
                if kind == "function":
                    first, head = opened_at.pop(len(stack))
                    if line - first + 1 > MAX_FUNCTION_LINES:
                        found.append((first, line - first + 1, head))
            statement_start = pos + 1
    return found


def long_python_functions(text, rel):
    """(first line, length, head) of each Python function or method over MAX_FUNCTION_LINES."""
    found = []
    for node in ast.walk(ast.parse(text, filename=rel)):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            length = node.end_lineno - first + 1
            if length > MAX_FUNCTION_LINES:
                found.append((first, length, f"def {node.name}"))
    return found


def sources(root, tops, extensions):
    for top in tops:
        for dirpath, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            for f in sorted(files):
                if f.endswith(extensions):
                    yield os.path.join(dirpath, f)


def check(path, root, finder):
    rel = os.path.relpath(path, root)
    with open(path, encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    problems = []
    lines = text.count("\n")
    if lines > MAX_FILE_LINES:
        problems.append(f"{rel}: {lines} lines (at most {MAX_FILE_LINES}: split it by idea)")
    for first, length, head in finder(text, rel):
        problems.append(f"{rel}:{first}: a function of {length} lines (at most {MAX_FUNCTION_LINES}): {head}")
    return problems


def main():
    root = sys.argv[1] if len(sys.argv) > 1 else "."
    problems = []
    for path in sources(root, SOURCE_DIRS, EXTENSIONS):
        problems += check(path, root, lambda text, rel: long_functions(text))
    for path in sources(root, PYTHON_DIRS, (".py",)):
        problems += check(path, root, long_python_functions)
    for p in problems:
        print(p)
    if problems:
        print(f"source shape: {len(problems)} problem(s)")
        return 1
    print("source shape: every file within 500 lines, every function within 80")
    return 0


if __name__ == "__main__":
    sys.exit(main())
