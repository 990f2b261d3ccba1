"""A digest of Python modules' code, so that what was built by that code is rebuilt when it changes.

A task image built by one version of Polar's build logic or stand-ins was found by its tag and
reused after that logic changed (the tag hashed only the task's own Dockerfile and context). The
tag now also carries :func:`code_digest` of the modules that build it. Docstrings and comments are
left out (the code's AST is hashed, docstrings removed), so rewording a docstring rebuilds nothing;
a change of any statement, name or constant does.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import threading
from pathlib import Path

#: CPython 3.11 keeps the AST converter's recursion depth per interpreter, not per thread: two
#: rollout threads parsing at once raised "AST constructor recursion depth mismatch (before=48,
#: after=46)" in a docker `polar tasks check` under load (CPython gh-106905). One parse at a time.
_AST_LOCK = threading.Lock()


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return tree


@functools.lru_cache(maxsize=None)
def _one(path: str, mtime_ns: int, size: int) -> str:
    source = Path(path).read_text()
    with _AST_LOCK:
        tree = _strip_docstrings(ast.parse(source, filename=path))
        dumped = ast.dump(tree, annotate_fields=False)
    return hashlib.sha256(dumped.encode()).hexdigest()


def code_digest(*paths: Path, length: int = 12) -> str:
    """The digest of the code of ``paths`` (Python files), in order; ``length`` hex digits."""
    h = hashlib.sha256()
    for p in paths:
        st = p.stat()
        h.update(p.name.encode() + b"\0" + _one(str(p), st.st_mtime_ns, st.st_size).encode() + b"\0")
    return h.hexdigest()[:length]
