"""What an aten op does to memory, read from its schema and tags (cached per OpOverload).

The runtime needs these facts per op: which arguments it writes (in-place and out= ops), whether
it draws random numbers (``torch.Tag.nondeterministic_seeded``: its RNG state must be captured so
that a recomputation draws the same numbers), whether a write changes only the shape, strides or
offset of its argument (``restrides``), and whether it has tensor outputs at all.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

aten = torch.ops.aten

# Schemas that do not declare every write. native_batch_norm updates running_mean and
# running_var in training mode although its schema has no (a!) on them; PyTorch's own
# functionalization works around it with _native_batch_norm_legit_functional. These writes
# are side effects: in training mode no output depends on them, so the op is recomputed with
# those arguments None (no write), and only the first run updates the statistics.
UNDECLARED_WRITES: dict[object, tuple[str, ...]] = {
    aten.native_batch_norm.default: ("running_mean", "running_var"),
    aten.cudnn_batch_norm.default: ("running_mean", "running_var"),
    aten.miopen_batch_norm.default: ("running_mean", "running_var"),
}
SIDE_EFFECT_FLAG = "training"  # the argument that must be true for the writes above to happen


@dataclass(frozen=True)
class OpInfo:
    """``writes``: (position, name) of every argument the op may write; ``passthrough``: a
    metadata query with no data (a fake tensor's ``prim::device``), run as it is;
    ``restrides``: its write changes only its argument's shape, strides or offset
    (``unsqueeze_``, ``transpose_``, ``as_strided_``...; not ``set_`` or ``resize_``, which
    change its storage)."""

    writes: tuple[tuple[int, str], ...]
    random: bool
    side_effects: int | None = None  # position of SIDE_EFFECT_FLAG if its writes are only that
    passthrough: bool = False
    restrides: bool = False

    def side_effects_only(self, args: tuple, kwargs: dict) -> bool:
        """Are this call's writes side effects no output depends on (see UNDECLARED_WRITES)?"""
        pos = self.side_effects
        if pos is None:
            return False
        flag = args[pos] if pos < len(args) else kwargs.get(SIDE_EFFECT_FLAG, False)
        return bool(flag)

    def written(self, args: tuple, kwargs: dict) -> list[object]:
        """The values passed for the written arguments (tensors, lists of tensors, None)."""
        out = []
        for pos, name in self.writes:
            if pos < len(args):
                out.append(args[pos])
            elif name in kwargs:
                out.append(kwargs[name])
        return out


# By id(): OpOverload hashes in Python. The hot path reads INFO directly and calls op_info
# only on a miss; each op is kept alive in _SEEN beside its info, so its id stays its own.
INFO: dict[int, OpInfo] = {}
_SEEN: list[torch._ops.OpOverload] = []


def op_info(func: torch._ops.OpOverload) -> OpInfo:
    """What ``func`` does to memory (worked out once per op: this runs on every op)."""
    info = INFO.get(id(func))
    if info is None:
        info = INFO[id(func)] = _classify(func)
        _SEEN.append(func)
    return info


def _classify(func: torch._ops.OpOverload) -> OpInfo:
    schema = func._schema
    undeclared = UNDECLARED_WRITES.get(func, ())
    writes = tuple((i, a.name) for i, a in enumerate(schema.arguments)
                   if (a.alias_info is not None and a.alias_info.is_write)
                   or a.name in undeclared)
    names = [a.name for a in schema.arguments]
    side = (names.index(SIDE_EFFECT_FLAG)
            if undeclared and SIDE_EFFECT_FLAG in names
            and all(name in undeclared for _, name in writes) else None)
    restrides = (torch.Tag.inplace_view in func.tags
                 and not schema.name.startswith(("aten::set_", "aten::resize")))
    return OpInfo(writes, torch.Tag.nondeterministic_seeded in func.tags, side,
                  func.namespace == "prim", restrides)
