"""Dataset names: validated once, before they reach a queue name, a Redis key or a path."""

from __future__ import annotations

import re

from common.errors import InputError

_NAME = re.compile(r"[A-Za-z0-9_.-]{1,100}")


def validate_dataset_name(name: str, *, source: str = "") -> str:
    """Return ``name`` if it is safe everywhere datagen uses it, else raise InputError.

    Allowed: letters, digits, ``_``, ``-`` and ``.``, 1-100 characters, not starting with
    a dot (a dot-file stem would be hidden and ``..`` walks paths).
    """
    if _NAME.fullmatch(name) and not name.startswith("."):
        return name
    where = f"{source}: " if source else ""
    raise InputError(
        f"{where}dataset name {name!r} is not allowed: use 1-100 letters, digits, '_', '-' "
        "or '.', not starting with '.'"
    )
