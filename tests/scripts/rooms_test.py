#!/usr/bin/env python3
"""The rooms of the source tree and the one direction they may lean: a file may include the public
headers (include/kvtd/...) of a room on a lower floor, and private headers of its own room only.
Fails naming each include that reaches sideways or up, or into another room's private files.

  rooms_test.py ROOT

The floors below are the architecture (docs/architecture.md, "Where the code lives"); CMake links
the same way, so a violation usually fails the build too, but this names the rule it breaks.

The Python package (python/kvtd) has floors too, read from its imports: a module imports only
modules of lower floors, or its own engine's package; no engine imports another; no `_private`
name is imported from another module.
"""
import ast
import os
import re
import sys

# Each room (a folder and its CMake target) and its floor; a room may lean only on lower floors.
FLOORS = {
    "base": 0,
    "proto": 1, "cudasim": 1, "device_modes": 1,
    "ipc": 2, "kernels": 2, "config": 2, "storage": 2, "transport": 2, "metrics": 2, "listeners": 2,
    "events": 3, "control": 3, "client/engine": 3, "daemon/endpoint": 3, "daemon/common": 3,
    "client": 4, "daemon/device": 4, "daemon/ctl": 4, "tools/loadgen": 4, "tools/storage_bench": 4, "tools/pd_bench": 4,
    "daemon/storage": 5,
    "daemon/serve": 6,
    "daemon/process": 7,
    "daemon": 8,  # the kvtd binary (daemon/main.cpp)
}
# The rooms libkvtd_client.so is made of, and the kernels nvcc compiles: no fmt or spdlog. The
# client library is loaded into engine processes that carry fmt builds of their own, and needs only
# libc and libstdc++ (the daemon's rooms use fmt, CMakeLists.txt).
NO_FMT_ROOMS = {"base", "proto", "ipc", "client/engine", "client", "kernels", "cudasim"}
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
    if room in NO_FMT_ROOMS:
        for m in re.finditer(r'^\s*#\s*include\s+<((?:fmt|spdlog)/[^>]+)>', text, re.M):
            line = text.count(chr(10), 0, m.start()) + 1
            problems.append(f"{rel}:{line}: #include <{m.group(1)}>: {room} is part of the client library or "
                            "the kernels, which use no fmt (see NO_FMT_ROOMS)")
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


# Python modules of python/kvtd and their floors. An engine's package (kvtd.engines.<engine>.*)
# is floor 6 and a room of its own; the names engines' configs load (kvtd.sglang, ...) alias an
# engine's module and sit on top with the package's __init__.
PY_FLOORS = {
    "kvtd._native": 0,
    "kvtd.errors": 1, "kvtd.geometry": 1,
    "kvtd.cache_groups": 2, "kvtd.tensors": 2, "kvtd.task_args": 2, "kvtd.control": 2,
    "kvtd.places": 3, "kvtd.models": 3,
    "kvtd.session": 4,
    "kvtd.testing": 5, "kvtd.engines": 5, "kvtd.engines.rank": 5,
    "kvtd": 7, "kvtd.fastdeploy": 7, "kvtd.fastdeploy_v1": 7, "kvtd.sglang": 7, "kvtd.vllm": 7,
}
ENGINE_FLOOR = 6


def py_modules(root):
    """{module name: path} of every module under python/kvtd."""
    base = os.path.join(root, "python")
    out = {}
    for dirpath, dirs, files in os.walk(os.path.join(base, "kvtd")):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = os.path.join(dirpath, f)
    return out


def py_room(mod):
    """(floor, room) of a module: an engine's modules share the room kvtd.engines.<engine>."""
    if mod in PY_FLOORS:
        return PY_FLOORS[mod], mod
    parts = mod.split(".")
    if len(parts) >= 3 and parts[:2] == ["kvtd", "engines"]:
        return ENGINE_FLOOR, ".".join(parts[:3])
    return None, None


def py_imports(mod, path, modules):
    """(line, imported module, imported name or None) of each kvtd import in `mod`."""
    package = mod if path.endswith("__init__.py") else mod.rpartition(".")[0]
    tree = ast.parse(open(path, encoding="utf-8").read(), filename=path)
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "kvtd" or a.name.startswith("kvtd."):
                    yield node.lineno, a.name, None
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if not (target == "kvtd" or target.startswith("kvtd.")):
                continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                yield (node.lineno, sub, None) if sub in modules else (node.lineno, target, a.name)


def python_problems(root):
    modules = py_modules(root)
    problems = []
    for mod, path in sorted(modules.items()):
        floor, room = py_room(mod)
        rel = os.path.relpath(path, root)
        if floor is None:
            problems.append(f"{rel}: module {mod} is on no floor of tests/scripts/rooms_test.py's PY_FLOORS")
            continue
        for line, target, name in py_imports(mod, path, modules):
            where = f"{rel}:{line}: imports {target}" + (f".{name}" if name else "")
            t_floor, t_room = py_room(target)
            if name is not None and name.startswith("_") and target != mod:
                problems.append(f"{where}: a private name of another module")
            if t_floor is None:
                problems.append(f"{where}: no module of the package")
            elif t_room == room or target == mod:
                continue
            elif floor == ENGINE_FLOOR and t_floor == ENGINE_FLOOR:
                problems.append(f"{where}: one engine ({room}) imports another ({t_room})")
            elif t_floor >= floor:
                problems.append(f"{where}: {room} (floor {floor}) leans on {t_room} (floor {t_floor}): only lower floors")
    return problems, len(modules)


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
    py_problems, py_count = python_problems(root)
    problems += py_problems
    for p in problems:
        print(p)
    if problems:
        print(f"rooms: {len(problems)} include(s) or import(s) against the floors")
        return 1
    print(f"rooms: every include leans on its own room or a lower floor ({len(FLOORS)} rooms); "
          f"every import of the {py_count} Python modules too")
    return 0


if __name__ == "__main__":
    sys.exit(main())
