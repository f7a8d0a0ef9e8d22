"""The one rule every registry by name follows (engines, drafters, acceptance rules, head types): a name is claimed
once. Registering the same object again is allowed (a module imported twice); another object under a taken name is
an error that names both, module-qualified, so the clash can be found from the message alone."""

from __future__ import annotations


def qualified_name(obj) -> str:
    """``module.QualName`` of a class or function."""
    return f"{getattr(obj, '__module__', '?')}.{getattr(obj, '__qualname__', repr(obj))}"


def claim(table: dict, name: str, obj, kind: str) -> None:
    """Put ``obj`` into ``table`` under ``name``.

    Args:
        table: the registry (name -> object), in registration order.
        name: the name claimed.
        obj: what is registered (a class or a factory function).
        kind: what the registry holds, for the message (``"engine"``, ``"drafter"``, ...).

    Raises:
        ValueError: ``name`` is registered to another object (both named).
    """
    existing = table.get(name, obj)
    if existing is not obj:
        raise ValueError(f"{kind} name {name!r} is already registered to {qualified_name(existing)}; cannot register "
                         f"{qualified_name(obj)} under it too (choose another name)")
    table[name] = obj
