"""SFT data: files → rows → conversations → token ids + loss weights (cached on disk) → packed micro-batches.

    formats.py   files (jsonl/json/parquet/HF save_to_disk) and row formats → validated conversations
    chat.py      chat template → token ids + per-token loss weights (spans from the rendered text)
    turn_ends.py where a turn ends: an end-of-turn string, or the next role tag (GLM)
    cache.py     per-file pre-tokenized memory-mapped cache, built once (worker processes), shared by ranks
    sampling.py  per-epoch order, mixture weights, held-out split (computed permutations, O(1) memory)
    packing.py   best-fit-decreasing packing, THD micro-batches with cu_seqlens (pure functions)
    loader.py    step → this DP rank's micro-batches; exact resume (also across DP sizes); prefetch
    pipeline.py  the recipe's data section → train loader + eval batches + start-of-run summary
    stats.py     counts, skipped rows by category, length histogram; the start-of-run summary text

Names are imported lazily (PEP 562), so the tokenizer worker processes do not import torch.
"""

from importlib import import_module

_EXPORTS = {
    "ALLOWED_ROLES": "formats",
    "Conversation": "formats",
    "DataFormatError": "formats",
    "RowError": "formats",
    "RowFormat": "formats",
    "iter_conversations": "formats",
    "read_conversations": "formats",
    "ChatOptions": "chat",
    "TokenizedDoc": "chat",
    "tokenize_conversation": "chat",
    "tokenize_files": "chat",
    "DataStats": "stats",
    "DataPlanError": "loader",
    "PackedLoader": "loader",
    "EvalBatches": "loader",
    "PackedMicroBatch": "packing",
    "PackingError": "packing",
    "build_micro_batch": "packing",
    "pack_documents": "packing",
    "best_fit_decreasing": "packing",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moe_sft.data' has no attribute {name!r}")
    return getattr(import_module(f"moe_sft.data.{_EXPORTS[name]}"), name)
