#!/usr/bin/env python3
"""The user documents say only what is true of this build: every relative link resolves (file and
heading anchor), every `--flag` they name is a flag of the program that has it (kvtd, kvtd
selftest, kvtd ctl, kvtd-loadgen, kvtd-storage-bench, the bench and check scripts) or one of the
other programs' flags listed below, and every `kvtd ctl` command they show exists.

Usage: check_docs.py ROOT --help-of PROGRAM... (each PROGRAM a command line whose --help is read)
Prints one line per problem (file:line: what) and exits 1 on any."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

# Flags of programs that are not kvtd's, named in the documents (cmake, systemd, the kernel's
# tools, FastDeploy's launch line, python's tools): checked by this list instead of a --help.
OTHER_PROGRAMS_FLAGS = {
    "--build", "--install",  # cmake
    "--shm-size",  # docker run
    "--cflags", "--libs",  # pkg-config
    "--output-on-failure", "--repeat", "--test-dir", "-L",  # ctest
    "--gtest_filter",  # googletest
    "--allow-root",  # lintian
    "--now",  # systemctl enable --now
    "--forward",  # patch
    "--enable-hierarchical-cache", "--hicache-storage-backend", "--hicache-storage-backend-extra-config",  # sglang
    "--enable-metrics", "--tp", "--dp", "--enable-dp-attention",  # sglang
    # sglang's ServerArgs fields as flags (model_path; hicache_mem_layout, read by hiradix_cache.py:93)
    "--model-path", "--hicache-mem-layout",
    "--kv-transfer-config", "--tensor-parallel-size", "--data-parallel-size",  # vLLM
    "--pid", "--fork", "--mount-proc",  # unshare
}

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)|!\[[^\]]*\]\(([^)\s]+)\)")
CODE_SPAN = re.compile(r"`([^`]+)`")
FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9_-]*[a-z0-9])")
CTL = re.compile(r"kvtd ctl ([^`]*)")


def documents(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md")), *sorted((root / "docs" / "engines").glob("*.md")),
            root / "cudasim" / "README.md"]


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    out: set[str] = set()
    fenced = False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"^#+ (.*)$", line)):
            out.add(slug(m.group(1)))
    return out


def ctl_command(words: list[str], value_flags: set[str]) -> str | None:
    """The command word of `kvtd ctl` followed by `words`: the first word that is neither a flag
    nor the value of a flag that takes one."""
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word.startswith("-"):
            skip = "=" not in word and word in value_flags
        else:
            return word
    return None


def known_flags(programs: list[str]) -> tuple[set[str], set[str], set[str]]:
    flags, ctl_commands, ctl_value_flags = set(OTHER_PROGRAMS_FLAGS), set(), set()
    for program in programs:
        out = subprocess.run(shlex.split(program) + ["--help"], capture_output=True, text=True, timeout=60)
        text = out.stdout + out.stderr
        if out.returncode != 0 and "usage" not in text.lower():
            sys.exit(f"check_docs: `{program} --help` failed ({out.returncode}): {text[:400]}")
        flags.update(FLAG.findall(text))
        if program.endswith(" ctl") and (m := re.search(r"command TEXT REQUIRED\s+(.*)", text)):
            ctl_commands.update(c.strip() for c in m.group(1).split("|"))
            for names in re.findall(r"^\s+(-[\w,-]+) (?:TEXT|UINT|INT|FLOAT)\b", text, re.M):
                ctl_value_flags.update(names.split(","))
    return flags, ctl_commands, ctl_value_flags


def check(root: Path, programs: list[str]) -> list[str]:
    flags, ctl_commands, ctl_value_flags = known_flags(programs)
    if not ctl_commands:
        return ["check_docs: no `kvtd ctl` among the programs, or its help lists no commands"]
    problems = []
    for doc in documents(root):
        fenced = False
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(root)}:{n}"
            if line.startswith("```"):
                fenced = not fenced
                continue
            for m in LINK.finditer(line):
                target = m.group(1) or m.group(2)
                if re.match(r"^[a-z]+:", target):
                    continue  # http:, https:, mailto:
                file, _, anchor = target.partition("#")
                path = (doc.parent / file).resolve() if file else doc
                if not path.exists():
                    problems.append(f"{where}: link to {target}: no such file")
                elif anchor and path.suffix == ".md" and anchor not in anchors(path):
                    problems.append(f"{where}: link to {target}: {path.name} has no heading #{anchor}")
            code = [line] if fenced else CODE_SPAN.findall(line)
            for span in code:
                for flag in FLAG.findall(span):
                    if flag not in flags:
                        problems.append(f"{where}: {flag} is not a flag of any kvtd program")
                for m in CTL.finditer(span):
                    command = ctl_command(m.group(1).split(), ctl_value_flags)
                    if command is not None and re.match(r"^[a-z][a-z-]*$", command) and command not in ctl_commands:
                        problems.append(f"{where}: `kvtd ctl {command}` is not a kvtd ctl command")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("root", type=Path)
    ap.add_argument("--help-of", nargs="+", required=True, dest="programs")
    args = ap.parse_args()
    problems = check(args.root.resolve(), args.programs)
    for p in problems:
        print(p)
    print(f"check_docs: {len(documents(args.root))} documents, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
