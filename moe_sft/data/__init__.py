"""SFT data: jsonl rows → validated conversations → token ids + assistant masks → packed micro-batches."""

from moe_sft.data.chat import TokenizedDoc, TokenizeStats, tokenize_conversation, tokenize_files
from moe_sft.data.formats import ALLOWED_ROLES, Conversation, DataFormatError, iter_conversations, read_conversations
from moe_sft.data.loader import DataPlanError, PackedBatchPlan
from moe_sft.data.packing import PackedMicroBatch, PackingError, build_micro_batch, pack_documents

__all__ = [
    "ALLOWED_ROLES",
    "Conversation",
    "DataFormatError",
    "DataPlanError",
    "PackedBatchPlan",
    "PackedMicroBatch",
    "PackingError",
    "TokenizeStats",
    "TokenizedDoc",
    "build_micro_batch",
    "iter_conversations",
    "pack_documents",
    "read_conversations",
    "tokenize_conversation",
    "tokenize_files",
]
