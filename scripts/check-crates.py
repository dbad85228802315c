#!/usr/bin/env python3
"""Checks the workspace's crate graph against docs/ARCHITECTURE.md, and every crate's declared
dependencies against its code. Fails (exit 1) naming each difference:

1. The crate table of docs/ARCHITECTURE.md (the rows after the `crate-graph` marker) lists every
   workspace crate with exactly the workspace crates its Cargo.toml depends on ([dependencies]).
2. No crate declares a dependency it does not use: each [dependencies] entry is named in the crate's
   src/ (or build.rs), each [dev-dependencies] entry in its src/, tests/, benches/ or examples/.
3. The front ends stay off the model runtime: kura-router, kura-bench and kura-sim do not link
   kura-model or kura-engine, and kura-bench and kura-sim not rayon either (the router tokenizes, and
   the tokenizer library uses rayon). The engine links no model runtime (kura-model, kura-cuda): it
   defines the executor seam they implement; and the two executors do not link each other (both read
   checkpoints through kura-checkpoint).

Standard library only; reads `cargo metadata` (offline when the registry is already on this machine).
"""

import json
import os
import re
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ARCH = os.path.join(ROOT, "docs", "ARCHITECTURE.md")
MARKER = "<!-- crate-graph"

# (crate, what it must not reach, transitively through normal dependencies)
FORBIDDEN = [
    ("kura-router", ["kura-model", "kura-engine"]),
    ("kura-bench", ["kura-model", "kura-engine", "rayon"]),
    ("kura-sim", ["kura-model", "kura-engine", "rayon"]),
    # The engine defines the executor seam; the runtimes implement it.
    ("kura-engine", ["kura-model", "kura-cuda"]),
    # The two executors share the checkpoint reader, not each other.
    ("kura-cuda", ["kura-model"]),
    ("kura-model", ["kura-cuda"]),
]


def metadata(no_deps):
    cmd = ["cargo", "metadata", "--format-version", "1", "--locked"]
    if no_deps:
        cmd.append("--no-deps")
    for extra in (["--offline"], []):
        r = subprocess.run(cmd + extra, cwd=ROOT, capture_output=True, text=True)
        if r.returncode == 0:
            return json.loads(r.stdout)
    sys.exit(f"check-crates: cargo metadata failed:\n{r.stderr}")


def documented_graph(problems):
    """The crate table: {crate: set of workspace crates it depends on}."""
    with open(ARCH, encoding="utf-8") as f:
        lines = f.read().splitlines()
    try:
        start = next(i for i, l in enumerate(lines) if l.startswith(MARKER))
    except StopIteration:
        problems.append(f"{ARCH}: no '{MARKER}' marker before the crate table")
        return {}
    graph = {}
    rows = 0
    for n, line in enumerate(lines[start + 1 :], start + 2):
        if not line.startswith("|"):
            if rows:
                break
            continue
        rows += 1
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) < 3 or set(cells[0]) <= set("-: "):
            continue
        name = cells[0].strip("`")
        if name == "crate":
            continue
        deps = set(re.findall(r"kura(?:-[a-z]+)?", cells[2].replace("`", "")))
        if name in graph:
            problems.append(f"docs/ARCHITECTURE.md:{n}: {name} is listed twice")
        graph[name] = deps
    return graph


def lib_name(dep):
    return (dep.get("rename") or dep["name"]).replace("-", "_")


def sources(pkg_dir, subdirs):
    for sub in subdirs:
        path = os.path.join(pkg_dir, sub)
        if os.path.isfile(path):
            yield path
        for dirpath, _, files in os.walk(path):
            for f in files:
                if f.endswith(".rs"):
                    yield os.path.join(dirpath, f)


def used_names(files):
    """The text of `files` and of every file they include with `#[path = "..."]`."""
    text, seen, todo = [], set(), list(files)
    while todo:
        path = os.path.normpath(todo.pop())
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        with open(path, encoding="utf-8") as f:
            body = f.read()
        text.append(body)
        for inc in re.findall(r'#\[path\s*=\s*"([^"]+)"\]', body):
            todo.append(os.path.join(os.path.dirname(path), inc))
    return "\n".join(text)


def uses(text, name):
    return re.search(rf"(?<![A-Za-z0-9_:]){re.escape(name)}\s*::|\buse\s+{re.escape(name)}\b"
                     rf"|\bextern\s+crate\s+{re.escape(name)}\b", text) is not None


def main():
    problems = []
    meta = metadata(no_deps=True)
    members = {p["name"]: p for p in meta["packages"]}
    doc = documented_graph(problems)

    for name, pkg in sorted(members.items()):
        actual = {d["name"] for d in pkg["dependencies"]
                  if d["kind"] is None and d["name"] in members}
        if name not in doc:
            problems.append(f"docs/ARCHITECTURE.md: crate {name} is missing from the crate table "
                            f"(it depends on {', '.join(sorted(actual)) or 'no workspace crate'})")
        elif doc[name] != actual:
            extra = sorted(doc[name] - actual)
            missing = sorted(actual - doc[name])
            why = []
            if extra:
                why.append(f"the table says it depends on {', '.join(extra)}, its Cargo.toml does not")
            if missing:
                why.append(f"its Cargo.toml depends on {', '.join(missing)}, the table does not say so")
            problems.append(f"docs/ARCHITECTURE.md: {name}: {'; '.join(why)}")
    for name in sorted(set(doc) - set(members)):
        problems.append(f"docs/ARCHITECTURE.md: the crate table lists {name}, which is no workspace crate")

    for name, pkg in sorted(members.items()):
        pkg_dir = os.path.dirname(pkg["manifest_path"])
        main_text = used_names(sources(pkg_dir, ["src", "build.rs"]))
        all_text = main_text + used_names(sources(pkg_dir, ["tests", "benches", "examples"]))
        for dep in pkg["dependencies"]:
            lib = lib_name(dep)
            if dep["kind"] is None and not uses(main_text, lib):
                problems.append(f"{name}: declares dependency {dep['name']} but its src/ never uses {lib}")
            elif dep["kind"] == "dev" and not uses(all_text, lib):
                problems.append(f"{name}: declares dev-dependency {dep['name']} but never uses {lib}")

    full = metadata(no_deps=False)
    names = {p["id"]: p["name"] for p in full["packages"]}
    edges = {}
    for node in full["resolve"]["nodes"]:
        edges[names[node["id"]]] = {
            names[d["pkg"]] for d in node["deps"]
            if any(k["kind"] is None for k in d["dep_kinds"])
        }
    for crate, banned in FORBIDDEN:
        seen, stack = {crate}, [crate]
        while stack:
            for nxt in edges.get(stack.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    stack.append(nxt)
        for b in banned:
            if b in seen:
                problems.append(f"{crate} links {b} (through its dependencies; see `cargo tree -p {crate} -i {b}`)")

    for p in problems:
        print(f"check-crates: {p}", file=sys.stderr)
    if problems:
        sys.exit(1)
    kept = "; ".join(f"{c} not {' or '.join(b)}" for c, b in FORBIDDEN)
    print(f"check-crates: {len(members)} crates match docs/ARCHITECTURE.md; every declared dependency is "
          f"used; no crate links what it must not ({kept})", file=sys.stderr)


if __name__ == "__main__":
    main()
