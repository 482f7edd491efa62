#!/usr/bin/env python3
"""The rooms of the source tree and the one direction they may lean: a file may include the public
headers (include/kvtd/...) of a room on a lower floor, and private headers of its own room only.
Fails naming each include that reaches sideways or up, or into another room's private files.

  rooms_test.py ROOT

The floors below are the architecture (docs/architecture.md, "Where the code lives"); CMake links
the same way, so a violation usually fails the build too, but this names the rule it breaks.
"""
import os
import re
import sys

# Each room (a folder and its CMake target) and its floor; a room may lean only on lower floors.
FLOORS = {
    "base": 0,
    "proto": 1, "cudasim": 1, "daemon/device/modes": 1,
    "ipc": 2, "kernels": 2, "config": 2, "storage": 2, "metrics": 2, "listeners": 2,
    "events": 3, "control": 3, "client/engine": 3, "daemon/endpoint": 3, "daemon/common": 3,
    "client": 4, "daemon/device": 4, "daemon/ctl": 4, "tools/loadgen": 4, "tools/storage_bench": 4,
    "daemon/storage": 5,
    "daemon/serve": 6,
    "daemon/process": 7,
    "daemon": 8,  # the kvtd binary (daemon/main.cpp)
}
TOP_FOLDERS = {room.split("/")[0] for room in FLOORS}  # what is walked (not tests/, build*/, ...)
SOURCES = (".cpp", ".h", ".cu", ".cuh", ".c")


def room_of(rel):
    """The room a path (relative to the root) belongs to: the longest FLOORS key that prefixes it."""
    best = None
    for room in FLOORS:
        if (rel == room or rel.startswith(room + "/")) and (best is None or len(room) > len(best)):
            best = room
    return best


def tree_files(root):
    """Every file under the rooms' top folders, as a path relative to root."""
    for dirpath, dirs, files in os.walk(root):
        rel_dir = os.path.relpath(dirpath, root)
        if rel_dir != "." and rel_dir.split("/")[0] not in TOP_FOLDERS:
            dirs[:] = []
            continue
        for f in files:
            yield os.path.normpath(os.path.join(rel_dir, f))


def public_headers(root):
    """'kvtd/...' include path -> the room whose include/ holds it."""
    owners = {}
    for rel in tree_files(root):
        m = re.match(r"(.*?)/include/(kvtd/.*)", rel)
        if m:
            owners[m.group(2)] = room_of(m.group(1) + "/")
    return owners


def include_problems(root, rel, room, owners, prefix_owner):
    """What is wrong with the includes of source `rel` of `room`, one line each."""
    problems = []
    with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as fh:
        text = fh.read()
    for m in re.finditer(r'^\s*#\s*include\s+"([^"]+)"', text, re.M):
        inc = m.group(1)
        where = f"{rel}:{text.count(chr(10), 0, m.start()) + 1}: #include \"{inc}\""
        if inc.startswith("kvtd/"):
            owner = owners.get(inc) or prefix_owner.get(os.path.dirname(inc))
            if owner is None:
                problems.append(f"{where}: no room's include/ has it")
            elif owner != room and FLOORS[owner] >= FLOORS[room]:
                problems.append(f"{where}: {room} (floor {FLOORS[room]}) leans on {owner} "
                                f"(floor {FLOORS[owner]}): only lower floors")
            continue
        # A private header: it must lie in this room (beside the file or under the room).
        candidates = [os.path.normpath(os.path.join(os.path.dirname(rel), inc))]
        candidates += [os.path.normpath(os.path.join(room, sub, inc)) for sub in ("", "src", "include")]
        found = [c for c in candidates if os.path.exists(os.path.join(root, c))]
        if not found:
            problems.append(f"{where}: not a header of {room} (another room's private header?)")
        elif room_of(found[0]) != room:
            problems.append(f"{where}: a private header of {room_of(found[0])}, not of {room}")
    return problems


def main():
    root = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else ".")
    owners = public_headers(root)
    prefix_owner = {os.path.dirname(k): v for k, v in owners.items()}  # generated headers (version.h)
    problems = []
    for rel in tree_files(root):
        if not rel.endswith(SOURCES):
            continue
        room = room_of(rel)
        if room is None:
            problems.append(f"{rel}: in no room of tests/scripts/rooms_test.py's floors: add its folder")
        else:
            problems += include_problems(root, rel, room, owners, prefix_owner)
    for p in problems:
        print(p)
    if problems:
        print(f"rooms: {len(problems)} include(s) against the floors")
        return 1
    print(f"rooms: every include leans on its own room or a lower floor ({len(FLOORS)} rooms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
