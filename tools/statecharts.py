#!/usr/bin/env python3
"""Generate the lifecycle statecharts from ``kvsm/lifecycle/table.py``.

For each lifecycle in ``kvsm.lifecycle.table.LIFECYCLES`` this writes
``<out>/<name>.mmd``: a Mermaid ``stateDiagram-v2`` produced by the
``transitions`` library's own mermaid engine from a real ``GraphMachine``
built by ``LifecycleSpec.machine`` (so the diagram shows exactly what the
declaration builds), and ``<out>/README.md``: an index page embedding every
diagram plus a table of every declared transition.

If Graphviz's ``dot`` and the ``graphviz`` Python package are both available
it also writes ``<out>/<name>.svg`` through transitions' graphviz engine.
SVGs are optional and not checked (their bytes vary with the Graphviz version).

Usage::

    python tools/statecharts.py            # (re)generate statecharts/
    python tools/statecharts.py --check    # exit 1 if the committed files are stale
    python tools/statecharts.py --out DIR  # another output folder
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing kvsm
    sys.path.insert(0, str(ROOT))

from kvsm.lifecycle.table import EFFECTS, LIFECYCLES, LifecycleSpec, names_of  # noqa: E402

DEFAULT_OUT = ROOT / "statecharts"
TABLE_SOURCE = "kvsm/lifecycle/table.py"

# Node styles, in transitions' ``style_attributes`` vocabulary (graphviz names;
# its mermaid engine turns ``fillcolor`` into ``fill`` and drops what Mermaid
# lacks). Replacing the defaults drops the run-time ``active``/``previous``
# highlighting: a static chart has no current state.
MERMAID_NODE_STYLES = {
    "default": {"fillcolor": "white", "color": "black"},
    "terminal": {"fillcolor": "#e6e6e6", "color": "black", "stroke": "black", "stroke-width": "3px"},
}
GRAPHVIZ_NODE_STYLES = {
    "default": {"style": "rounded,filled", "shape": "rectangle", "fillcolor": "white", "color": "black",
                "peripheries": "1"},
    "terminal": {"style": "rounded,filled", "shape": "rectangle", "fillcolor": "gray90", "color": "black",
                 "peripheries": "2"},
    # graphviz has no [*] start marker: the initial state gets a bold border.
    "initial": {"style": "rounded,filled,bold", "shape": "rectangle", "fillcolor": "white", "color": "black",
                "penwidth": "2", "peripheries": "1"},
}


class _Model:
    """A plain model object: GraphMachine binds the triggers and ``get_graph`` to it."""

    get_graph: Callable[..., Any]  # declared for mypy only; GraphMachine sets it


def _title(spec: LifecycleSpec) -> str:
    return f"kvsm {spec.name} lifecycle"


def _graph_machine(spec: LifecycleSpec, engine: str, node_styles: Mapping[str, Any]) -> tuple[Any, _Model]:
    from transitions.extensions import GraphMachine

    model = _Model()
    machine = spec.machine(model=model, machine_cls=GraphMachine, graph_engine=engine,
                           show_conditions=True, title=_title(spec))
    # Per-instance copy: never touch the class-level defaults.
    machine.style_attributes = {**GraphMachine.style_attributes, "node": dict(node_styles)}
    graph = machine.model_graphs[id(model)]
    graph.reset_styling()  # forget the "active" mark on the model's initial state
    for state in spec.states:
        if state in spec.terminal:
            graph.set_node_style(state, "terminal")
        elif state == spec.initial and "initial" in node_styles:
            graph.set_node_style(state, "initial")
    return machine, model


def render_mermaid(spec: LifecycleSpec) -> str:
    """The lifecycle as Mermaid text, deterministic (same bytes every run)."""
    _, model = _graph_machine(spec, "mermaid", MERMAID_NODE_STYLES)
    raw = model.get_graph().draw(None)
    return _postprocess_mermaid(raw, spec)


def _postprocess_mermaid(raw: str, spec: LifecycleSpec) -> str:
    """Minimal fixes to transitions' (0.9.3) mermaid output.

    * transitions writes the title bare between the ``---`` front-matter
      fences; Mermaid parses front matter as YAML and takes the title only from
      a ``title:`` key (a bare string is dropped), so it becomes ``title: ...``.
    * transitions writes ``Class <state> <style>``; Mermaid's state-diagram
      lexer is case-insensitive so it parses, but the documented keyword is
      ``class``, which is what we write.
    * the flat (non-nested) mermaid engine draws no final states, so each
      terminal state gets a ``<state> --> [*]`` edge, in declaration order.
    * trailing whitespace is stripped and the file ends with one newline.
    """
    lines = [line.rstrip() for line in raw.splitlines()]
    title = _title(spec)
    if lines[:3] != ["---", title, "---"]:
        raise SystemExit(f"statecharts: unexpected front matter from transitions: {lines[:3]!r}")
    lines[1] = f"title: {title}"
    out = []
    for line in lines:
        stripped = line.lstrip()
        if stripped.startswith("Class "):
            out.append(line[: len(line) - len(stripped)] + "class " + stripped[len("Class "):])
        else:
            out.append(line)
    indent = "  "
    out.extend(f"{indent}{state} --> [*]" for state in spec.states if state in spec.terminal)
    return "\n".join(out) + "\n"


def render_svg(spec: LifecycleSpec) -> bytes:
    _, model = _graph_machine(spec, "graphviz", GRAPHVIZ_NODE_STYLES)
    return model.get_graph().draw(None, format="svg", prog="dot")


def svg_unavailable_reason() -> str | None:
    """Why SVGs cannot be drawn here, or None when they can."""
    try:
        import graphviz  # noqa: F401
    except ImportError:
        return "the 'graphviz' Python package is not installed (pip install graphviz)"
    if shutil.which("dot") is None:
        return "Graphviz's 'dot' is not on PATH (Debian: apt-get install graphviz)"
    return None


# --- the index page ---------------------------------------------------------


def _code(names: Iterable[str], empty: str = "") -> str:
    names = list(names)
    return ", ".join(f"`{n}`" for n in names) if names else empty


def _transition_rows(spec: LifecycleSpec) -> list[str]:
    rows = ["| # | trigger | source | dest | conditions | effects (`after`) |",
            "|---|---|---|---|---|---|"]
    for i, t in enumerate(spec.transitions, 1):
        dest = "= (stays)" if t["dest"] == "=" else f"`{t['dest']}`"
        rows.append(
            f"| {i} | {_code(names_of(t['trigger']))} | {_code(names_of(t['source']))} | {dest} "
            f"| {_code(names_of(t.get('conditions')), '-')} | {_code(names_of(t.get('after')), '-')} |")
    return rows


def render_index(diagrams: Mapping[str, str]) -> str:
    lines = [
        "# kvsm request lifecycles",
        "",
        "<!-- Generated by `python tools/statecharts.py` from kvsm/lifecycle/table.py: do not edit."
        " tests/test_statecharts.py fails when these files are stale. -->",
        "",
        f"Generated from the lifecycle declarations in `{TABLE_SOURCE}` (`LIFECYCLES`) by",
        "`python tools/statecharts.py`; do not edit by hand. The diagrams are drawn by the",
        "`transitions` library's mermaid engine from the same `transitions.Machine` the",
        "declaration builds, so they show what the code runs. `python tools/statecharts.py --check`",
        "(run by the test suite) fails when anything here is stale.",
        "",
        "Conventions: `[*] --> s` marks the initial state; terminal states are drawn with a",
        "thick border and an edge to `[*]`; a label `trigger [condition]` is a conditional",
        "transition; `a | b` joins triggers that share an edge. Rules for the same",
        "(state, trigger) pair are tried in the order of the table below; the last is",
        "always unconditional, so a legal event always moves the machine.",
        "",
    ]
    for name in LIFECYCLES:
        lines.append(f"- [{name}](#{name}) ([{name}.mmd]({name}.mmd))")
    lines.append("")
    for name, spec in LIFECYCLES.items():
        others = [s for s in spec.entry_states if s != spec.initial]
        lines += [
            f"## {name}",
            "",
            f"States: {_code(spec.states)}.",
            f"Initial: `{spec.initial}`."
            + (f" Also created in: {_code(sorted(others))} (a process that learns of a request mid-way)."
               if others else ""),
            f"Terminal: {_code(s for s in spec.states if s in spec.terminal)}.",
            "",
            "```mermaid",
            diagrams[name].rstrip("\n"),
            "```",
            "",
            f"Transitions of `{name}`, in declaration order:",
            "",
            *_transition_rows(spec),
            "",
        ]
        if spec.named_violations:
            lines += ["Illegal events with a name of their own in reports:", "",
                      "| state | trigger | reported as |", "|---|---|---|"]
            for (state, trigger), label in sorted(spec.named_violations.items()):
                lines.append(f"| `{state}` | `{trigger}` | `{label}` |")
            lines.append("")
    used = {e for spec in LIFECYCLES.values() for t in spec.transitions for e in names_of(t.get("after"))}
    lines += [
        "## Effects",
        "",
        "What a transition asks the I/O layer to do (`kvsm.lifecycle.table.EFFECTS`);",
        "the core never performs them itself.",
        "",
        "| effect | meaning |",
        "|---|---|",
    ]
    for effect, meaning in EFFECTS.items():
        if effect in used:
            lines.append(f"| `{effect}` | {meaning} |")
    lines.append("")
    return "\n".join(lines)


def generate() -> dict[str, str]:
    """Every checked file: name (relative to the output folder) -> text."""
    logging.getLogger("transitions").setLevel(logging.WARNING)
    diagrams = {name: render_mermaid(spec) for name, spec in LIFECYCLES.items()}
    files = {f"{name}.mmd": text for name, text in diagrams.items()}
    files["README.md"] = render_index(diagrams)
    return files


def check(out: Path, files: Mapping[str, str]) -> int:
    stale = []
    for rel, text in files.items():
        path = out / rel
        if not path.is_file():
            stale.append(f"{path} (missing)")
        elif path.read_bytes() != text.encode():
            stale.append(f"{path} (differs)")
    for path in sorted(out.glob("*.mmd")) if out.is_dir() else []:
        if path.name not in files:
            stale.append(f"{path} (no lifecycle of that name any more)")
    if stale:
        print("statecharts are stale; regenerate with `python tools/statecharts.py`:", file=sys.stderr)
        for s in stale:
            print(f"  {s}", file=sys.stderr)
        return 1
    print(f"statecharts are fresh ({len(files)} files in {out})")
    return 0


def write(out: Path, files: Mapping[str, str], svg: bool) -> int:
    out.mkdir(parents=True, exist_ok=True)
    changed = False  # did a diagram (what an SVG shows) change?
    for rel, text in files.items():
        path = out / rel
        if path.is_file() and path.read_bytes() == text.encode():
            print(f"unchanged {path}")
            continue
        path.write_bytes(text.encode())
        changed = changed or rel.endswith(".mmd")
        print(f"wrote     {path}")
    expected_svgs = {f"{name}.svg" for name in LIFECYCLES}
    for path in sorted(out.glob("*.mmd")) + sorted(out.glob("*.svg")):
        if path.name not in files and path.name not in expected_svgs:
            path.unlink()
            print(f"removed   {path} (no lifecycle of that name any more)")
    reason = "--no-svg" if not svg else svg_unavailable_reason()
    if reason:
        print(f"note: SVGs skipped: {reason}; the .mmd files are the reference")
        old = sorted(p.name for p in out.glob("*.svg"))
        if changed and old:
            print(f"warning: {', '.join(old)} in {out} may now be stale (not redrawn); "
                  "redraw them with graphviz installed, or delete them", file=sys.stderr)
        return 0
    for name, spec in LIFECYCLES.items():
        path = out / f"{name}.svg"
        path.write_bytes(render_svg(spec))
        print(f"wrote     {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true",
                        help="regenerate in memory; exit 1 naming the stale files if any .mmd or README.md "
                             "differs from it or is missing (SVGs are not checked)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT,
                        help="output folder (default: the repository's statecharts/)")
    parser.add_argument("--no-svg", action="store_true", help="do not try to draw SVGs")
    args = parser.parse_args(argv)
    files = generate()
    if args.check:
        return check(args.out, files)
    return write(args.out, files, svg=not args.no_svg)


if __name__ == "__main__":
    sys.exit(main())
