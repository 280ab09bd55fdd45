"""Reversible replacement of attributes on live modules and classes: how every patch is applied.

A patch must be undoable (the tests install and remove the patches many times in one process), and
restoring has two traps this class handles: a class attribute may be a ``staticmethod`` whose
``getattr`` is a plain function (putting that back would turn it into a method), and an attribute
may be inherited rather than the class's own (putting it back would shadow the base class's).
"""

from __future__ import annotations

_MISSING = object()


class Replacements:
    """Attributes replaced on modules and classes, restored in reverse order by ``restore()``."""

    def __init__(self) -> None:
        self._saved: list[tuple[object, str, object]] = []

    def replace(self, owner: object, name: str, value: object) -> object:
        """Set ``owner.name = value``; returns what ``owner.name`` was (as ``getattr`` sees it)."""
        current = getattr(owner, name)
        own = vars(owner).get(name, _MISSING) if isinstance(owner, type) else current
        self._saved.append((owner, name, own))
        setattr(owner, name, value)
        return current

    def restore(self) -> None:
        while self._saved:
            owner, name, original = self._saved.pop()
            if original is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, original)
