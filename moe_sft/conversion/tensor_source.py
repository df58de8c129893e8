"""Megatron tensors made on demand from HF tensors: any element range of one parameter at a time.

The streaming converter writes a checkpoint chunk by chunk; each chunk needs an element range of
one megatron parameter (its flat, contiguous storage). `TensorSource.flat_range` makes exactly that
range from the family's mapping entry, reading as little as the transform allows:

* Expert-stacked entries (`Transform.expert_separable`) are separable: expert
  e's HF tensors alone give elements [e·B, (e+1)·B) of the megatron tensor (B = numel / experts;
  GroupedMLP keeps each expert's block contiguous, see transforms.py). A range needs only the HF
  tensors of the experts it touches; the last experts made are kept for the next chunk (megatron
  writes a layer's gate and up halves as two items over the same experts). The buffer assignment
  casts to the parameter's dtype as `copy_` does.
* Row-separable entries (`Transform.row_separable`): megatron row r is HF
  row r (or a zero padding row), so a range reads only its rows from the file (`get_rows`); the
  MTP copies of the embedding are compared row range by row range.
* Anything else (fused QKV, gate/up of dense MLPs, FP8-quantised tensors) is produced whole and
  kept until a different parameter is asked for; the writer asks for a parameter's ranges in a row.

Values are produced exactly as `mapping.load_hf_into_state` does (same transform, cast to the
parameter's dtype as `copy_` does), and fail with the same messages.
"""

from __future__ import annotations

import torch

from moe_sft.conversion.mapping import Entry, MappingError
from moe_sft.models import transforms as T
from moe_sft.models.transforms import CopiesDifferError


def _copies_differ(entry: Entry, err) -> MappingError:
    return MappingError(
        f"{entry.mcore}: HF tensors {list(entry.hf)} should be copies of one tensor "
        f"but are not ({err}); moe-sft keeps one, so converting would lose the others"
    )


def _wrong_shape(entry: Entry, got, expected, via: str = "") -> MappingError:
    return MappingError(
        f"{entry.mcore}: HF tensors {list(entry.hf)[:3]} give shape {tuple(got)}{via} "
        f"via {entry.transform.name}, model expects {tuple(expected)}"
    )


class TensorSource:
    """Element ranges of megatron parameters, produced from HF tensors fetched on demand.

    `reader` needs `get(name)`; with `row_shape(name)` and `get_rows(name, start, stop)` too
    (StreamingHFReader) row-separable tensors are read a row range at a time.
    """

    def __init__(self, entries: list[Entry], reader, ctx: dict, shapes: dict[str, tuple[torch.Size, torch.dtype]]):
        self._entries = {e.mcore: e for e in entries}
        self._reader, self._ctx, self._shapes = reader, ctx, shapes
        self._whole: tuple[str, torch.Tensor] | None = None
        self._experts: tuple[str, int, int, torch.Tensor] | None = None
        self._row_checked: dict[str, bool] = {}

    def flat_range(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of parameter `name`'s contiguous storage, in its dtype."""
        entry = self._entries[name]
        if entry.transform.expert_separable:
            self._whole = None
            return self._expert_range(entry, start, stop)
        self._experts = None
        if self._rows_readable(entry):
            self._whole = None
            return self._row_range(entry, start, stop)
        if self._whole is None or self._whole[0] != name:
            self._whole = None  # free the previous parameter before making the next
            self._whole = (name, self._produce_whole(entry))
        return self._whole[1].view(-1)[start:stop]

    def release(self) -> None:
        self._whole, self._experts = None, None

    # -- whole tensors ------------------------------------------------------------------------
    def _produce_whole(self, entry: Entry) -> torch.Tensor:
        shape, dtype = self._shapes[entry.mcore]
        try:
            value = entry.transform.from_hf([self._reader.get(n) for n in entry.hf], self._ctx)
        except CopiesDifferError as err:
            raise _copies_differ(entry, err) from err
        if tuple(value.shape) != tuple(shape):
            raise _wrong_shape(entry, value.shape, shape)
        return value.to(dtype).contiguous()

    # -- row ranges -----------------------------------------------------------------------------
    def _rows_readable(self, entry: Entry) -> bool:
        if entry.mcore not in self._row_checked:
            ok = entry.transform.row_separable and hasattr(self._reader, "get_rows")
            hf_shapes = [self._reader.row_shape(n) for n in entry.hf] if ok else []
            ok = ok and all(s is not None for s in hf_shapes)
            if ok:  # the whole path's shape check, on shapes from the file headers
                first = torch.empty(hf_shapes[0], device="meta")
                value = T.PAD_VOCAB.from_hf([first], self._ctx) if entry.transform is not T.IDENTITY else first
                if tuple(value.shape) != tuple(self._shapes[entry.mcore][0]) or any(
                    s != hf_shapes[0] for s in hf_shapes[1:]
                ):
                    raise _wrong_shape(entry, value.shape, self._shapes[entry.mcore][0])
            self._row_checked[entry.mcore] = ok
        return self._row_checked[entry.mcore]

    def _row_range(self, entry: Entry, start: int, stop: int) -> torch.Tensor:
        shape, dtype = self._shapes[entry.mcore]
        per_row = max(1, shape[1:].numel())
        first, last = start // per_row, -(-stop // per_row)
        stored = self._reader.row_shape(entry.hf[0])[0]  # rows past it are vocab padding (zeros)
        parts = []
        if first < min(last, stored):
            rows = self._reader.get_rows(entry.hf[0], first, min(last, stored))
            for position, copy in enumerate(entry.hf[1:], 1):  # DeepSeek-V3 MTP copies
                if not torch.equal(self._reader.get_rows(copy, first, min(last, stored)), rows):
                    raise _copies_differ(
                        entry,
                        f"copies at positions [{position}] differ from the "
                        f"first tensor in rows {first}:{min(last, stored)}",
                    )
            parts.append(rows.to(dtype))
        if last > stored:
            parts.append(torch.zeros((last - max(first, stored),) + tuple(shape[1:]), dtype=dtype))
        flat = (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(-1)
        return flat[start - first * per_row : stop - first * per_row]

    # -- expert blocks ------------------------------------------------------------------------
    def _expert_range(self, entry: Entry, start: int, stop: int) -> torch.Tensor:
        """Blocks of the experts the range touches, made into one buffer and kept for the next
        range over the same experts (megatron's gate and up halves of a layer are two items)."""
        shape, dtype = self._shapes[entry.mcore]
        experts = self._ctx["num_experts"]
        block = shape.numel() // experts
        first, last = start // block, (stop - 1) // block
        if self._experts is None or self._experts[:3] != (entry.mcore, first, last):
            self._experts = None  # free the previous experts first
            buffer = torch.empty((last + 1 - first) * block, dtype=dtype)
            for e in range(first, last + 1):
                buffer[(e - first) * block : (e + 1 - first) * block] = self._expert_block(entry, e, experts, block)
            self._experts = (entry.mcore, first, last, buffer)
        return self._experts[3][start - first * block : stop - first * block]

    def _expert_block(self, entry: Entry, e: int, experts: int, block: int) -> torch.Tensor:
        if len(entry.hf) % experts:
            raise MappingError(f"{entry.mcore}: {len(entry.hf)} HF tensors do not split into {experts} experts")
        per = len(entry.hf) // experts
        names = entry.hf[e * per : (e + 1) * per]
        value = entry.transform.from_hf([self._reader.get(n) for n in names], self._ctx)
        if value.numel() != block:
            raise _wrong_shape(entry, value.shape, self._shapes[entry.mcore][0], f" for expert {e} of {experts}")
        return value.reshape(-1)
