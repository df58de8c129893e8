"""The reference HF checkpoint reader of the tests: tensors read through safetensors' `safe_open`
(a memory map), against which the converter's StreamingHFReader (plain file reads) is compared."""

from __future__ import annotations

import torch

from moe_sft.conversion.hf_reader import CheckpointError, HFCheckpointReader


class SafeOpenHFReader(HFCheckpointReader):
    """`HFCheckpointReader` whose tensors come from safetensors' own `get_tensor`."""

    def _read(self, name: str) -> torch.Tensor:
        file = self._name_to_file[name]
        try:
            return self._open(file).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as err:
            raise CheckpointError(
                f"{file}: reading tensor {name!r} failed ({err}); the file is truncated or corrupt"
            ) from err
