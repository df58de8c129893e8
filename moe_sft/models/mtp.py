"""Multi-token prediction (DeepSeek-V3 MTP) on top of megatron-core's `MultiTokenPredictionBlock`.

megatron's GPTModel computes the MTP loss inside the model, normalised per micro-batch and over
the padded vocabulary. We want every loss term normalised like the main loss (by the global
assistant-token count, padded vocab rows masked: trainer/step.py), so `SFTGPTModel` returns the
logits of every depth instead, and the loss function does the rest.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from megatron.core.models.gpt import GPTModel
from megatron.core.tensor_parallel.mappings import gather_from_sequence_parallel_region
from megatron.core.transformer.multi_token_prediction import roll_tensor


class SFTGPTModel(GPTModel):
    """GPTModel whose output with MTP is the logits of every depth, concatenated along the sequence.

    `run_mtp` (set by the trainer) decides whether the MTP layers run: False for eval, for
    frozen MTP layers and for verification against HF, so the output is the main logits only.
    Output shape [b, (1 + depths) * s, V/tp]; depth k predicts the token k + 1 places further.

    Two per-family transforms of megatron's GPTModel live here too (SFTTransformerConfig fields):
    the embedding multiplier and the logits' soft cap.
    """

    run_mtp: bool = False
    _loss_rows = None  # the current forward's `loss_rows` argument, read by _postprocess

    def forward(self, *args, loss_rows=None, **kwargs):
        """GPTModel's forward; `loss_rows` (moe_sft/trainer/loss_rows.py): the output head runs over
        these rows alone and the output is [1, rows, V/tp]."""
        self._loss_rows = loss_rows
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._loss_rows = None

    def _preprocess(self, input_ids, position_ids, decoder_input=None, *args, **kwargs):
        """GPTModel's, with the word embeddings times `embedding_multiplier` (rounded to the
        embedding weight's dtype first, as transformers' Gemma4TextScaledWordEmbedding)."""
        embeds_here = decoder_input is None and self.pre_process
        out = super()._preprocess(input_ids, position_ids, decoder_input, *args, **kwargs)
        multiplier = getattr(self.config, "embedding_multiplier", None)
        if not embeds_here or multiplier is None:
            return out
        weight = self.embedding.word_embeddings.weight
        return (out[0] * torch.tensor(multiplier, dtype=weight.dtype, device=out[0].device), *out[1:])

    def _soft_capped(self, logits: torch.Tensor) -> torch.Tensor:
        """tanh(z / c) * c with c = `final_logit_softcapping` (transformers' Gemma 2-4 order)."""
        cap = getattr(self.config, "final_logit_softcapping", None)
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def mtp_depths(self) -> int:
        return self.config.mtp_num_layers if self.config.mtp_num_layers and self.run_mtp else 0

    def _postprocess(
        self,
        hidden_states,
        input_ids,
        position_ids,
        labels,
        rotary_pos_emb,
        rotary_pos_cos,
        rotary_pos_sin,
        mtp_in_postprocess=None,
        loss_mask=None,
        decoder_input=None,
        attention_mask=None,
        inference_params=None,
        packed_seq_params=None,
        sequence_len_offset=None,
        runtime_gather_output=None,
        extra_block_kwargs=None,
        inference_context=None,
    ):
        if labels is not None and getattr(self.config, "final_logit_softcapping", None) is not None:
            raise ValueError(
                "final_logit_softcapping: GPTModel's own loss (labels=) would skip the cap; pass no labels"
            )
        if (
            labels is not None
            or inference_context is not None
            or (not self.config.mtp_num_layers and self._loss_rows is None)
        ):
            out = super()._postprocess(
                hidden_states,
                input_ids,
                position_ids,
                labels,
                rotary_pos_emb,
                rotary_pos_cos,
                rotary_pos_sin,
                mtp_in_postprocess=mtp_in_postprocess,
                loss_mask=loss_mask,
                decoder_input=decoder_input,
                attention_mask=attention_mask,
                inference_params=inference_params,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                runtime_gather_output=runtime_gather_output,
                extra_block_kwargs=extra_block_kwargs,
                inference_context=inference_context,
            )
            return self._soft_capped(out) if self.post_process and labels is None else out
        depths = self.mtp_depths()
        if mtp_in_postprocess and depths:
            hidden_states = self.mtp(
                input_ids=input_ids,
                position_ids=position_ids,
                hidden_states=hidden_states,
                attention_mask=attention_mask,
                inference_params=inference_params,
                rotary_pos_emb=rotary_pos_emb,
                rotary_pos_cos=rotary_pos_cos,
                rotary_pos_sin=rotary_pos_sin,
                packed_seq_params=packed_seq_params,
                sequence_len_offset=sequence_len_offset,
                embedding=self.embedding,
                **(extra_block_kwargs or {}),
            )
        if not self.post_process:
            return hidden_states
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self._loss_rows is not None:  # one GEMM over the picked rows of [(1 + depths) s, 1, h]
            picked = _whole_sequences(hidden_states, depths, self.output_layer).index_select(0, self._loss_rows.rows)
            with _replicated_input(self.output_layer):
                logits = self.output_layer(picked, weight=weight, runtime_gather_output=runtime_gather_output)[0]
            return self._soft_capped(logits.transpose(0, 1))
        logits = [
            self.output_layer(h, weight=weight, runtime_gather_output=runtime_gather_output)[0]
            for h in torch.chunk(hidden_states, 1 + depths, dim=0)
        ]
        return self._soft_capped(torch.cat(logits, dim=0).transpose(0, 1).contiguous())


def _whole_sequences(hidden_states, depths: int, output_layer):
    """With sequence parallelism each depth's hidden states are [s / tp, b, h] on each TP rank; the
    output layer would gather them itself. Gathered here, depth by depth, so that rows index the
    whole sequence; the gather's backward reduce-scatters the partial input gradients of the TP
    ranks' vocabulary shards, as the output layer's own would."""
    if not output_layer.sequence_parallel:
        return hidden_states
    return torch.cat(
        [
            gather_from_sequence_parallel_region(h, True, group=output_layer.tp_group)
            for h in torch.chunk(hidden_states, 1 + depths, dim=0)
        ]
    )


@contextmanager
def _replicated_input(output_layer):
    """The output layer over an input that `_whole_sequences` gathered: no gather of its own and no
    all-reduce of the input gradient (the gather's reduce-scatter sums it)."""
    saved = output_layer.sequence_parallel, output_layer.disable_grad_reduce
    if output_layer.sequence_parallel:
        output_layer.sequence_parallel, output_layer.disable_grad_reduce = False, True
    try:
        yield
    finally:
        output_layer.sequence_parallel, output_layer.disable_grad_reduce = saved


def shift_targets(labels: torch.Tensor, loss_mask: torch.Tensor, packed_seq_params, cp_group=None):
    """Labels and loss mask one more token ahead, within each packed document (megatron's roll).

    The last position of every document gets label 0 and mask 0: no next-next token there.
    With context parallel (`cp_group`), megatron's roll exchanges chunk boundaries between ranks.
    """
    labels, _ = roll_tensor(labels, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    loss_mask, _ = roll_tensor(loss_mask, shifts=-1, dims=-1, cp_group=cp_group, packed_seq_params=packed_seq_params)
    return labels, loss_mask
