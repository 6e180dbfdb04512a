"""Dilated attention (LongNet): placeholder while the kernel is written."""


def dilated_attention(q, k, v, segment_lengths, dilation_rates, *, mode="union", is_causal=True, scale=None,
                      dropout_p=0.0, attention_mask=None, position_ids=None):
    raise NotImplementedError("dilated_attention kernel is being written")
