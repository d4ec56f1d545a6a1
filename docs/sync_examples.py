"""Copy tested example code into the docs: ``python docs/sync_examples.py [--check]``.

A block between ``<!-- include: PATH -->`` and ``<!-- end include -->`` is replaced
by the file at PATH, or by one function of it with ``PATH::function``, fenced as its
kind of file (``.py``: Python, ``.cfg``: an HAProxy configuration).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "docs" / "writing-plugins.md", ROOT / "docs" / "writing-quirk-plugins.md",
        ROOT / "docs" / "several-servers.md"]
FENCES = {".py": "python", ".cfg": "haproxy"}
BLOCK = re.compile(r"(<!-- include: (?P<ref>\S+) -->\n)(?P<body>.*?)(<!-- end include -->)", re.S)


def source_of(ref: str) -> str:
    path, _, name = ref.partition("::")
    text = (ROOT / path).read_text()
    if not name:
        return text
    lines = text.splitlines(keepends=True)
    for node in ast.parse(text).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            # Decorators belong to the example (a hook without @hookimpl is not a hook).
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "".join(lines[first - 1 : node.end_lineno])
    raise LookupError(f"{ref}: no function {name}")


def render(markdown: str) -> str:
    def block(m: re.Match[str]) -> str:
        ref = m.group("ref")
        fence = FENCES[Path(ref.partition("::")[0]).suffix]
        return f"{m.group(1)}```{fence}\n{source_of(ref)}```\n{m.group(4)}"

    return BLOCK.sub(block, markdown)


def main(argv: list[str]) -> int:
    stale = []
    for doc in DOCS:
        current = doc.read_text()
        fresh = render(current)
        if fresh != current:
            stale.append(doc)
            if "--check" not in argv:
                doc.write_text(fresh)
    if stale and "--check" in argv:
        print("out of date:", ", ".join(str(d) for d in stale))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
