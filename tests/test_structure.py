"""The package's shape: no import cycles between qwire's modules (lazy imports included), a training
loop whose functions each fit on a screen, and docs that name only options the commands have."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, tuple[Path, bool]]:
    mods = {}
    for p in (SRC / "qwire").rglob("*.py"):
        parts = list(p.relative_to(SRC).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        mods[".".join(parts[:-1] if is_pkg else parts)] = (p, is_pkg)
    return mods


def _import_graph() -> dict[str, set[str]]:
    """Module -> the qwire modules it imports anywhere in its source (a package means its __init__)."""
    mods = _modules()

    def resolve(name: str) -> str:
        while name and name not in mods:
            name = name.rsplit(".", 1)[0] if "." in name else ""
        return name

    graph = {}
    for m, (p, is_pkg) in mods.items():
        pkg = m if is_pkg else m.rsplit(".", 1)[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.Import):
                edges |= {resolve(a.name) for a in node.names if a.name.startswith("qwire")}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - (node.level - 1)]
                    mod = ".".join(base + ([node.module] if node.module else []))
                else:
                    mod = node.module or ""
                if mod.startswith("qwire"):
                    edges |= {f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else resolve(mod) for a in node.names}
        graph[m] = edges - {m, ""}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles() -> None:
    graph = _import_graph()
    assert "qwire.train" in graph and "qwire.netlab.launch" in graph
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_train_py_functions_fit_on_a_screen() -> None:
    tree = ast.parse((SRC / "qwire" / "train.py").read_text())
    long = {n.name: n.end_lineno - n.lineno + 1 for n in ast.walk(tree)
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and n.end_lineno - n.lineno + 1 > 80}
    assert long == {}


def test_train_help_states_each_default_once() -> None:
    """`qwire train --help`: every option's default is said once, either by the help text itself ("(default:
    even)") or by the value argparse appends, never both."""
    import argparse
    import dataclasses

    from qwire.config import TrainConfig
    from qwire.train_cli import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    helps = {a.dest: a.help for a in p._actions}
    for f in dataclasses.fields(TrainConfig):
        assert helps[f.name].count("default") <= 1 or "the corpus default" in helps[f.name], (f.name, helps[f.name])
    assert helps["split"].endswith("(default: even)") and helps["seq_len"].endswith("(default: 128)")


def test_train_help_does_not_load_torch() -> None:
    """`qwire train --help` and `qwire netlab --help` answer without importing torch, transformers or numba
    (seconds on a busy machine), and so do imports of ``qwire.config`` and ``qwire.netlab``: the modules that
    build those parsers import them where a run needs them."""
    import os
    import subprocess
    import sys

    code = ("import contextlib, io, sys\n"
            "from qwire.cli import main\n"
            "for argv in (['train', '--help'], ['netlab', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        main(argv)\n"
            "    assert '--fwd-codec' in out.getvalue() or 'netlab' in out.getvalue(), out.getvalue()\n"
            "import qwire.config, qwire.netlab\n"
            "print(sorted(m for m in ('torch', 'transformers', 'numba') if m in sys.modules))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(SRC)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout


def _options(module: str) -> set[str]:
    """Every option string of a verb's parser (and of its sub-commands)."""
    import argparse
    import importlib

    p = argparse.ArgumentParser()
    importlib.import_module(module).add_arguments(p)
    parsers = [p] + [sp for a in p._actions if isinstance(a, argparse._SubParsersAction) for sp in a.choices.values()]
    return {o for q in parsers for a in q._actions for o in a.option_strings}


def _unknown_doc_options(text: str, known: dict[str, set[str]]) -> list[tuple[int, str, str]]:
    """(line, command, option) for each ``--option`` in a ``qwire VERB ...`` command of ``text`` that VERB does
    not have; options after `` -- `` are ``qwire train``'s (as in ``qwire netlab compare ... -- --stages 2``)."""
    import re

    bad = []
    for m in re.finditer(r"qwire (bench [a-z0-9]+|train|netlab)\b([^`\n|]*)", text):
        verb, rest = m.group(1), m.group(2)
        own, _, passed = rest.partition(" -- ")
        line = text.count("\n", 0, m.start()) + 1
        if verb not in known:
            bad.append((line, verb, "(no such command)"))
            continue
        for opts, words in ((known[verb], own), (known["train"], passed)):
            bad += [(line, verb, o) for o in re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", words) if o not in opts]
    return bad


def test_every_option_the_docs_name_exists() -> None:
    """README.md and docs/*.md: each option of a ``qwire train/netlab/bench NAME`` command is one its parser has,
    so a renamed or removed option cannot live on in the docs."""
    from qwire.cli import BENCHES, VERBS

    known = {verb: _options(mod) for verb, (mod, _) in VERBS.items()}
    known |= {f"bench {name}": _options(mod) for name, (mod, _) in BENCHES.items()}
    assert _unknown_doc_options("run `qwire train --stages 2 --nosuch 1` or `qwire bench nosuch --out x`", known) == [
        (1, "train", "--nosuch"), (1, "bench nosuch", "(no such command)")]
    root = SRC.parent
    bad = {(str(f.relative_to(root)), *b) for f in [root / "README.md", *sorted((root / "docs").glob("*.md"))]
           for b in _unknown_doc_options(f.read_text(), known)}
    assert not bad, sorted(bad)
