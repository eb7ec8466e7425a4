"""A griffe extension for the API reference: Sphinx roles as code, no private bases.

The docstrings cross-reference in reST (``:class:`~asyncbatch.Batch```), which ``help()``
and IDEs show as written; the Markdown reference would print the role itself. Here each
becomes a code span of the name (``~`` keeps the last component, as in Sphinx).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|meth|func|attr|mod|exc|data|obj|const):`(~?)([^`]+)`")


def _plain(match: re.Match[str]) -> str:
    short, target = match.group(1), match.group(2)
    if "<" in target:  # :class:`text <target>`
        target = target.split("<", 1)[0].strip()
    elif short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


class SphinxRoles(griffe.Extension):
    """Rewrites every docstring's roles as code spans, and drops a class's private bases
    (``_LoaderBase``: an implementation detail), when griffe loads an object."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(_plain, obj.docstring.value)
        if isinstance(obj, griffe.Class):
            obj.bases = [b for b in obj.bases if not str(b).rsplit(".", 1)[-1].startswith("_")]
