"""The one registry of every attribute moe-sft replaces in megatron-core (and, for the CPU emulation,
in torch): `swap` records what it replaced, `restore(group)` puts back exactly that, `active()` lists
what is replaced now and why.

Groups (docs/patches.md): "megatron_fixes" (runtime/megatron_fixes.py, bug fixes gated on the
megatron-core version), "cpu_compat" (runtime/cpu_compat.py, CUDA emulation on CPU machines),
"kernels" (kernels/install.py, the speed replacements behind `kernels.fused`) and
"fp8_placeholders" (peft/fp8_loading.py, while a model with an FP8 base is built). One attribute
belongs to one group at a time: a second group swapping it is an error, since restoring either
would then undo the other's.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

MEGATRON_FIXES, CPU_COMPAT, KERNELS, FP8_PLACEHOLDERS = "megatron_fixes", "cpu_compat", "kernels", "fp8_placeholders"

_ABSENT = object()  # the owner had no attribute of its own: restore deletes the one swap set


@dataclass(frozen=True)
class Patch:
    owner: object
    attr: str
    own: object  # the owner's own value before the swap (_ABSENT: inherited or missing)
    before: object  # what `getattr(owner, attr)` returned before the swap (None when missing)
    new: object
    group: str
    reason: str


# (id(owner), attr) -> Patch, in the order of the swaps; the Patch keeps its owner alive
_patches: dict[tuple[int, str], Patch] = {}


def mcore_version() -> str:
    """The installed megatron-core version (`megatron.core.package_info.__version__`)."""
    from megatron.core import package_info

    return package_info.__version__


def _own_value(owner, attr: str):
    if isinstance(owner, type):  # a class: only its own __dict__, not what it inherits
        return owner.__dict__.get(attr, _ABSENT)
    return getattr(owner, attr, _ABSENT)


def _name(owner, attr: str) -> str:
    return f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"


def swap(owner, attr: str, new, *, group: str, reason: str):
    """Set `owner.attr = new`, recorded under `group`; returns the value it replaced (what the
    replacement may fall back to). Swapping an attribute again in the same group keeps the first
    recorded original; another group's swap of it is an error."""
    key = (id(owner), attr)
    old = _patches.get(key)
    if old is not None and old.group != group:
        raise RuntimeError(
            f"patches.swap: {_name(owner, attr)} is already replaced by group {old.group!r} ({old.reason}); "
            f"group {group!r} may not replace it too: restore {old.group!r} first"
        )
    replaced = getattr(owner, attr, None)
    if old is None:
        _patches[key] = Patch(owner, attr, _own_value(owner, attr), replaced, new, group, reason)
    else:
        _patches[key] = Patch(owner, attr, old.own, old.before, new, group, reason)
    setattr(owner, attr, new)
    return replaced


def _put_back(patch: Patch) -> None:
    if patch.own is _ABSENT:
        if isinstance(patch.owner, type) and patch.attr not in patch.owner.__dict__:
            return
        with contextlib.suppress(AttributeError):
            delattr(patch.owner, patch.attr)
    else:
        setattr(patch.owner, patch.attr, patch.own)


def restore(group: str) -> int:
    """Put back every attribute `group` replaced (latest swap first); returns how many."""
    mine = [key for key, patch in _patches.items() if patch.group == group]
    for key in reversed(mine):
        _put_back(_patches.pop(key))
    return len(mine)


def active(group: str | None = None) -> list[Patch]:
    """The swaps in place now (of `group`, or of every group), in the order they were made."""
    return [patch for patch in _patches.values() if group is None or patch.group == group]


def original(owner, attr: str):
    """`owner.attr` as it was before any swap replaced it (the current value when none did)."""
    patch = _patches.get((id(owner), attr))
    return patch.before if patch is not None else getattr(owner, attr, None)


@contextlib.contextmanager
def suspended(group: str):
    """Run the body with `group`'s originals in place, then put its replacements back."""
    mine = active(group)
    for patch in mine:
        _put_back(patch)
    try:
        yield
    finally:
        for patch in mine:
            setattr(patch.owner, patch.attr, patch.new)
