"""Formats: how a sample maps to byte spans and how bytes decode into fields.

``base`` holds the types a format implements (:class:`~asyncbatch.formats.base.Source`,
:class:`~asyncbatch.formats.base.Opener`); each format's reader and writer are separate
modules (``documents`` and ``documents_write``, ...); ``registry`` registers them all with
:func:`~asyncbatch.formats.registry.register_format`. This package imports none of them.
"""
