#!/usr/bin/env python3
"""Import circles between the source files of each crate.

For every crate under libs/, services/, tools/ and bindings/python, map each source file to the
files of the same crate that it imports: `use crate::a::b`, `use super::x`, `use child::y`, and
`crate::a::f(...)` / `super::g` paths written in code. Declaring a child (`mod x;`) is not an
import: a parent names its children, and a child that uses its parent's items does not make a
circle by that alone. A file that re-exports or calls into its child while the child uses the
parent does.

Prints every strongly connected component of more than one file, with one import edge of the
circle per line as `file:line -> file`, and exits 1 when there is any. Usage:

    tools/check-imports.py [DIR ...]      # default: libs services tools bindings/python

Names are followed through `use` and `pub use` to the file that defines them, so a child that
uses `crate::Error` depends on the file that defines `Error`, not on the lib.rs that re-exports
it; `pub use` itself is the module's face and no edge. A glob import (`use super::*`) depends on
the files defining the names the importing module writes. `#[cfg(test)]` modules and imports are
skipped: unit tests may reach anywhere in their crate.

Python 3, standard library only; a lexer good enough for Rust paths (comments, strings, raw
strings and char literals are skipped), not a parser: `#[path]` is honoured, macros are read
as ordinary tokens, and a name defined in a function body is not seen.
"""

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_DIRS = ["libs", "services", "tools", "bindings/python"]

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def lex(text):
    """Yields (token, line): identifiers, `::`, and single punctuation characters."""
    i, n, line = 0, len(text), 1
    while i < n:
        c = text[i]
        if c == "\n":
            line += 1
            i += 1
        elif c.isspace():
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif text.startswith("/*", i):
            depth, i = 1, i + 2
            while i < n and depth:
                if text.startswith("/*", i):
                    depth, i = depth + 1, i + 2
                elif text.startswith("*/", i):
                    depth, i = depth - 1, i + 2
                else:
                    line += text[i] == "\n"
                    i += 1
        elif c in "rb" and re.match(r'(br|r|b)?#*"', text[i:i + 8]) and (
            i == 0 or not (text[i - 1].isalnum() or text[i - 1] == "_")
        ):
            m = re.match(r'(br|r|b)?(#*)"', text[i:])
            raw = "r" in m.group(1) if m.group(1) else False
            i += m.end()
            if raw:
                end = '"' + m.group(2)
                j = text.find(end, i)
                j = n if j < 0 else j
                line += text.count("\n", i, j)
                i = j + len(end)
            else:
                j = skip_string(text, i, n)
                line += text.count("\n", i, j)
                i = j
        elif c == '"':
            j = skip_string(text, i + 1, n)
            line += text.count("\n", i, j)
            i = j
        elif c == "'":
            # A char literal ('a', '\n', '\u{..}') or a lifetime ('a): a literal closes within a
            # few characters, a lifetime does not.
            m = re.match(r"'(\\.[^']*|[^\\'])'", text[i:i + 12])
            if m:
                i += m.end()
            else:
                i += 1
        elif c.isalpha() or c == "_":
            m = IDENT.match(text, i)
            yield m.group(0), line
            i = m.end()
        elif text.startswith("::", i):
            yield "::", line
            i += 2
        else:
            yield c, line
            i += 1


def skip_string(text, i, n):
    while i < n:
        if text[i] == "\\":
            i += 2
        elif text[i] == '"':
            return i + 1
        else:
            i += 1
    return n


class Crate:
    def __init__(self, name):
        self.name = name
        self.modules = {}  # module path (tuple) -> file
        self.children = {}  # module path -> set of child module names
        self.refs = []  # (file, line, module path of the context, path segments)
        self.defs = {}  # module path -> names of the items it defines
        self.imports = {}  # module path -> {name: path segments}, globs under "*"
        self.used = {}  # module path -> identifiers written in it
        self.globs = []  # (file, line, module path of the context, glob path segments)


def crate_roots(crate_dir):
    roots = []
    for rel in ("src/lib.rs", "src/main.rs"):
        p = os.path.join(crate_dir, rel)
        if os.path.isfile(p):
            roots.append(p)
    for sub in ("src/bin", "tests", "benches", "examples"):
        d = os.path.join(crate_dir, sub)
        if not os.path.isdir(d):
            continue
        for e in sorted(os.listdir(d)):
            p = os.path.join(d, e)
            if e.endswith(".rs") and os.path.isfile(p):
                roots.append(p)
            elif os.path.isfile(os.path.join(p, "main.rs")):
                roots.append(os.path.join(p, "main.rs"))
    return roots


def read_crate(root_file):
    crate = Crate(os.path.relpath(root_file, ROOT))
    todo = [(root_file, (), True)]
    seen = set()
    while todo:
        path, modpath, mod_rs = todo.pop()
        if path in seen or not os.path.isfile(path):
            continue
        seen.add(path)
        crate.modules[modpath] = path
        read_file(crate, path, modpath, mod_rs, todo)
    return crate


def read_file(crate, path, modpath, mod_rs, todo):
    with open(path, encoding="utf-8") as f:
        toks = list(lex(f.read()))
    base = os.path.dirname(path)
    if not mod_rs:
        base = os.path.join(base, os.path.splitext(os.path.basename(path))[0])
    # Stack of (module path, directory of its children, brace depth it closes at).
    stack = [(modpath, base, -1)]  # a file's top level is depth 0, so it "opens" at -1
    crate.children.setdefault(modpath, set())
    depth = 0
    pending_path = None  # a #[path = "..."] attribute for the next `mod`
    cfg_test = False  # a #[cfg(test)] attribute for the next item
    test_depth = None  # inside a #[cfg(test)] inline module until depth falls back to this
    i, n = 0, len(toks)
    while i < n:
        t, line = toks[i]
        cur, cur_dir, open_depth = stack[-1]
        at_top = depth == open_depth + 1
        if IDENT.fullmatch(t) and test_depth is None:
            crate.used.setdefault(cur, set()).add(t)
        if t == "#" and toks[i + 1 : i + 6] and [x for x, _ in toks[i + 1 : i + 6]] == ["[", "cfg", "(", "test", ")"]:
            cfg_test = True
            i += 6
            continue
        if t == "use" and cfg_test:
            # A test-only import, like a test module, is not the crate's structure.
            cfg_test = False
            while i < n and toks[i][0] != ";":
                i += 1
            continue
        if t == "mod" and cfg_test:
            # Unit tests may reach anywhere in their crate; their imports are not the crate's
            # structure. Skip the module: a `mod tests;` file is never read, an inline one is
            # skipped to its closing brace.
            cfg_test = False
            if i + 2 < n and toks[i + 2][0] == "{":
                d, j = 0, i + 2
                while j < n:
                    if toks[j][0] == "{":
                        d += 1
                    elif toks[j][0] == "}":
                        d -= 1
                        if d == 0:
                            break
                    j += 1
                i = j + 1
            else:
                i += 3
            continue
        if t in (";", "{") or (t == "fn" and cfg_test):
            cfg_test = False
        if t == "#" and i + 2 < n and toks[i + 1][0] == "[" and toks[i + 2][0] == "path":
            # The lexer dropped the string: read it from the source line instead.
            with open(path, encoding="utf-8") as f:
                src_line = f.read().split("\n")[line - 1]
            m = re.search(r'#\[path\s*=\s*"([^"]+)"', src_line)
            pending_path = m.group(1) if m else None
        elif t == "{":
            depth += 1
        elif t == "}":
            depth -= 1
            if len(stack) > 1 and depth == stack[-1][2]:
                stack.pop()
        elif t == "mod" and i + 2 < n and IDENT.fullmatch(toks[i + 1][0]):
            name, nxt = toks[i + 1][0], toks[i + 2][0]
            crate.children.setdefault(cur, set()).add(name)
            child = cur + (name,)
            if nxt == ";":
                if pending_path:
                    p = os.path.normpath(os.path.join(cur_dir if len(stack) > 1 else os.path.dirname(path), pending_path))
                    todo.append((p, child, os.path.basename(p) == "mod.rs"))
                else:
                    flat = os.path.join(cur_dir, name + ".rs")
                    nested = os.path.join(cur_dir, name, "mod.rs")
                    if os.path.isfile(flat):
                        todo.append((flat, child, False))
                    else:
                        todo.append((nested, child, True))
                i += 3
                pending_path = None
                continue
            if nxt == "{":
                crate.modules[child] = path
                crate.children.setdefault(child, set())
                stack.append((child, os.path.join(cur_dir, name), depth))
                depth += 1
                i += 3
                pending_path = None
                continue
        elif t == "use":
            # `pub use` is the module's face, not a use of what it names: it resolves paths
            # through it (below) but is no edge of its own.
            public = i > 0 and (toks[i - 1][0] == "pub" or (toks[i - 1][0] == ")" and "pub" in [x for x, _ in toks[max(0, i - 6):i]]))
            j = i + 1
            tree, j = parse_use_tree(toks, j)
            imports = crate.imports.setdefault(cur, {})
            for segs, alias in tree:
                if segs and segs[-1] == "*":
                    imports.setdefault("*", []).append(segs[:-1])
                    if not public:
                        crate.globs.append((path, line, cur, segs[:-1]))
                    continue
                if segs:
                    imports[alias or segs[-1]] = segs
                if not public:
                    crate.refs.append((path, line, cur, segs))
            i = j
            continue
        elif t in ("fn", "struct", "enum", "trait", "type", "const", "static", "union") and i + 1 < n and at_top:
            if IDENT.fullmatch(toks[i + 1][0]):
                crate.defs.setdefault(cur, set()).add(toks[i + 1][0])
        elif t == "macro_rules" and i + 2 < n and toks[i + 1][0] == "!":
            crate.defs.setdefault(cur, set()).add(toks[i + 2][0])
        elif t in ("crate", "super", "self") and i + 1 < n and toks[i + 1][0] == "::":
            # A path in code: `crate::a::f(..)`, `super::T`. Preceded by `::` it is the tail of
            # another path (e.g. `$crate::`), which is not ours.
            if not (i > 0 and toks[i - 1][0] in ("::", "$")):
                segs, j = [t], i + 1
                while j + 1 < n and toks[j][0] == "::" and IDENT.fullmatch(toks[j + 1][0]):
                    segs.append(toks[j + 1][0])
                    j += 2
                crate.refs.append((path, line, cur, segs))
                i = j
                continue
        i += 1


def parse_use_tree(toks, j, prefix=()):
    """Parses a `use` tree from toks[j]; returns (list of paths, index after it)."""
    out = []
    segs = list(prefix)
    n = len(toks)
    if j < n and toks[j][0] == "::":
        j += 1
    while j < n:
        t = toks[j][0]
        if t == "{":
            j += 1
            while j < n and toks[j][0] != "}":
                sub, j = parse_use_tree(toks, j, tuple(segs))
                out.extend(sub)
                if j < n and toks[j][0] == ",":
                    j += 1
            j += 1
            return out, skip_to_end(toks, j)
        if t == "*":
            out.append((segs + ["*"], None))
            return out, skip_to_end(toks, j + 1)
        if IDENT.fullmatch(t):
            segs.append(t)
            j += 1
            if j < n and toks[j][0] == "::":
                j += 1
                continue
            alias = None
            if j < n and toks[j][0] == "as":
                alias = toks[j + 1][0]
                j += 2
            if segs[-1] == "self":
                segs = segs[:-1]
                alias = alias or (segs[-1] if segs else None)
            out.append((segs, alias))
            return out, skip_to_end(toks, j)
        return out, j
    return out, j


def skip_to_end(toks, j):
    # Inside a group the caller reads the `,` or `}`; at the top the `;` ends the use.
    if j < len(toks) and toks[j][0] == ";":
        return j + 1
    return j


def resolve(crate, cur, segs, depth=0):
    """The module path of the file that defines what a path names, or None when it leaves the
    crate. Names a module re-exports or imports are followed to their definition."""
    if not segs or depth > 16:
        return None
    head = segs[0]
    if head == "crate":
        mod, rest = (), segs[1:]
    elif head in ("super", "self"):
        mod, rest = cur, segs
        while rest and rest[0] in ("super", "self"):
            if rest[0] == "super":
                mod = mod[:-1]
            rest = rest[1:]
    elif head in crate.children.get(cur, ()):
        mod, rest = cur, segs
    else:
        return None
    # Walk down through modules, then follow the first remaining name through the imports of
    # the module it is looked up in.
    for k, name in enumerate(rest):
        if mod + (name,) in crate.modules:
            mod = mod + (name,)
            continue
        if name in crate.defs.get(mod, ()):
            return mod
        imports = crate.imports.get(mod, {})
        if name in imports:
            target = resolve(crate, mod, list(imports[name]) + list(rest[k + 1:]), depth + 1)
            return target if target is not None else mod
        for glob in imports.get("*", []):
            target = resolve(crate, mod, list(glob) + list(rest[k:]), depth + 1)
            if target is not None and target != mod and name in crate.defs.get(target, ()):
                return target
        return mod
    return mod


def edges(crate):
    out = {}
    for path, line, cur, segs in crate.refs:
        mod = resolve(crate, cur, segs)
        if mod is None:
            continue
        target = crate.modules.get(mod)
        if target and target != path:
            out.setdefault(path, {}).setdefault(target, line)
    # A glob import depends on the files that define the names the importing module uses.
    for path, line, cur, segs in crate.globs:
        for name in crate.used.get(cur, ()):
            mod = resolve(crate, cur, list(segs) + [name])
            target = crate.modules.get(mod) if mod is not None else None
            if target and target != path and (name in crate.defs.get(mod, ()) or mod + (name,) in crate.modules):
                out.setdefault(path, {}).setdefault(target, line)
    return out


def sccs(graph):
    """Tarjan's algorithm, iterative."""
    index, low, on, stack, result = {}, {}, set(), [], []
    counter = [0]
    nodes = set(graph) | {t for ts in graph.values() for t in ts}
    for start in sorted(nodes):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, {}))))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on.add(start)
        while work:
            v, it = work[-1]
            for w in it:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, {})))))
                    break
                if w in on:
                    low[v] = min(low[v], index[w])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[v])
                if low[v] == index[v]:
                    comp = []
                    while True:
                        w = stack.pop()
                        on.discard(w)
                        comp.append(w)
                        if w == v:
                            break
                    if len(comp) > 1:
                        result.append(sorted(comp))
    return result


def crates(dirs):
    for d in dirs:
        top = os.path.join(ROOT, d)
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = sorted(x for x in dirnames if x not in ("target", ".venv", "node_modules") and not x.startswith("."))
            if "Cargo.toml" in filenames and dirpath != ROOT:
                yield dirpath


def main(argv):
    dirs = argv[1:] or DEFAULT_DIRS
    found = 0
    for crate_dir in crates(dirs):
        for root in crate_roots(crate_dir):
            crate = read_crate(root)
            graph = edges(crate)
            for comp in sccs(graph):
                found += 1
                members = set(comp)
                rel = lambda p: os.path.relpath(p, ROOT)
                print(f"circle in {rel(crate_dir)}: " + ", ".join(rel(p) for p in comp))
                for src in comp:
                    for dst, line in sorted(graph.get(src, {}).items()):
                        if dst in members:
                            print(f"    {rel(src)}:{line} -> {rel(dst)}")
    if found:
        print(f"{found} import circle(s) between files; move the shared item where both sides can use it")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
