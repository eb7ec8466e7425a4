"""A griffe extension (mkdocs.yml loads it): ``**options: Unpack[LoaderOptions]`` in a
signature of the API reference becomes one keyword-only parameter per option, with the type
and default that ``LoaderConfig`` declares, as ``help()`` shows them (asyncbatch/_options.py).

griffe's own ``unpack_typeddict`` extension expands the TypedDict too, but a TypedDict has no
defaults: it would show every option as ``= ...``.
"""

from __future__ import annotations

from typing import Any

import griffe

#: The TypedDict of ``**options`` -> the dataclass that declares the same fields with their
#: defaults.
DEFAULTS = {"asyncbatch._options.LoaderOptions": "asyncbatch._options.LoaderConfig"}


class LoaderOptionsExtension(griffe.Extension):
    """Expands ``**options: Unpack[<TypedDict>]`` from its dataclass of defaults."""

    def __init__(self, defaults: dict[str, str] | None = None) -> None:
        super().__init__()
        self.defaults = DEFAULTS if defaults is None else defaults

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        for function in functions(pkg):
            self.expand(function)

    def expand(self, function: griffe.Function) -> None:
        for parameter in function.parameters:
            annotation = parameter.annotation
            if (
                parameter.kind is griffe.ParameterKind.var_keyword
                and isinstance(annotation, griffe.ExprSubscript)
                and annotation.canonical_path in {"typing.Unpack", "typing_extensions.Unpack"}
            ):
                typed = str(getattr(annotation.slice, "canonical_path", ""))
                if typed in self.defaults:
                    break
        else:
            return
        source = function.modules_collection[self.defaults[typed]]
        del function.parameters[parameter.name]
        for field in source.attributes.values():
            function.parameters[field.name] = griffe.Parameter(
                field.name,
                annotation=field.annotation,
                kind=griffe.ParameterKind.keyword_only,
                default=field.value,
                docstring=field.docstring,
            )


def functions(obj: griffe.Object) -> list[griffe.Function]:
    """Every function defined in ``obj`` (a module or class) and the objects inside it."""
    found: list[griffe.Function] = []
    for member in obj.members.values():
        if member.is_alias:
            continue
        if isinstance(member, griffe.Function):
            found.append(member)
        elif isinstance(member, griffe.Module | griffe.Class):
            found.extend(functions(member))
    return found
