"""The errors that mean "fix your input": their message names the file, row, tensor or field and
the fix, so entry points (train, convert, export) print them as one line and exit 2."""

from __future__ import annotations


def user_errors() -> tuple[type[Exception], ...]:
    from moe_sft.config import ConfigError
    from moe_sft.conversion.hf_reader import CheckpointError
    from moe_sft.conversion.mapping import MappingError
    from moe_sft.data.formats import DataFormatError
    from moe_sft.data.loader import DataPlanError
    from moe_sft.data.packing import PackingError
    from moe_sft.models.family import UnsupportedConfigError

    return (
        ConfigError,
        CheckpointError,
        MappingError,
        DataFormatError,
        DataPlanError,
        PackingError,
        UnsupportedConfigError,
        FileNotFoundError,
    )


def run_reporting_user_errors(run, args) -> int:
    """Run a CLI body: user errors become one `error:` line and exit 2, or the error's
    `exit_code` (--traceback shows all)."""
    import sys
    import warnings

    # megatron-core warns at import that TE/Apex are absent; the torch-native path is intended.
    warnings.filterwarnings("ignore", message=r".*(Transformer Engine|Apex).*not installed")
    if getattr(args, "traceback", False):
        return run(args)
    try:
        return run(args)
    except user_errors() as err:
        print("error: " + " ".join(str(err).split()), file=sys.stderr)
        return getattr(err, "exit_code", 2)  # an export's DiskFullError: 4
