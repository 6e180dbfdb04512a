"""A standalone PyTorch API for people building their own models.

- `create_attention(kind, **config)` returns an `Attention`: a callable
  `attn(q, k, v, *, is_causal=True, attention_mask=None, position_ids=None, scale=None, dropout_p=0.0)`
  over the layout of docs/contract.md 1 (q (batch, q_heads, q_len, head_dim), k/v (batch, kv_heads,
  kv_len, head_dim)) that computes one of our variants.
- `DilatedMultiheadAttention`: a drop-in for `torch.nn.MultiheadAttention` (same constructor
  arguments, same parameter names, so its state_dict loads) that computes the attention with any
  of those variants.

Kinds and their configuration (anything else is a TypeError naming the key; REQUIRED: no default),
read from the kinds' table (kinds.py) when this module is imported:

{kinds_table}

For the ring kinds, q/k/v are this rank's shards of the sequence; `group=None` means the
sequence-parallel group set by `hf_dilated.distributed.setup_sequence_parallel` (a single process
when none is set) and `layout=None` that group's layout.

The defaults shown are those of `hf_dilated.config` (DilatedConfig's fields), which the kinds'
table (kinds.py) reads; the checks of the settings are config's too, and what each kind supports
(causal only, attention dropout) is checked against its row of kinds.py on every call.
"""
from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from .config import (REQUIRED, check_band, check_block_sparse, check_dilated_config, check_int, check_mode, check_ring_layout,
                     default_schedule, field_defaults)
from .kinds import KINDS as _KINDS

KINDS = (*_KINDS, "auto")

# "auto": the longest sequence computed with exact dense attention when no segment_lengths are
# given; beyond it, dilated attention whose first segment is this length (so documents no longer
# than it still get exact dense attention). See create_attention for the figures behind them.
AUTO_DENSE_MAX_LEN = {"cpu": 4096, "cuda": 16384}
_SHARDING = {"group": None, "layout": None}
_AUTO = {"segment_lengths": None, "dilation_rates": None, **field_defaults("mode"), "dense_max_len": None, **_SHARDING}


def _settings(kind: str) -> dict:
    """The configuration a kind takes, with defaults (None: required, except for "auto")."""
    if kind == "auto":
        return _AUTO
    row = _KINDS[kind]
    return {**row.settings, **(_SHARDING if row.sequence_parallel else {})}


def _kinds_table() -> str:
    def setting(name, default):
        return name if default is REQUIRED else f"{name}={default!r}"

    return "\n".join(textwrap.fill(", ".join(setting(*item) for item in _settings(kind).items()) or "(none)", 100,
                                   initial_indent=f"    {kind!r:20} ", subsequent_indent=" " * 25)
                     for kind in KINDS)


if __doc__:  # None under python -OO
    __doc__ = __doc__.format(kinds_table=_kinds_table())


@dataclass(frozen=True)
class Attention:
    """One configured attention variant; call it like a kernel. Build it with `create_attention`."""

    kind: str
    config: dict = field(default_factory=dict)

    def __call__(self, q, k, v, *, is_causal: bool = True, attention_mask=None, position_ids=None, scale=None,
                 dropout_p: float = 0.0, sliding_window: int | None = None, rope_frequencies=None, state=None):
        kind, config = self.kind, self.config
        if kind == "auto":
            kind, config = self.choose(k.shape[2], k.device, position_ids=position_ids)
        row = _KINDS[kind]
        row.check_call(is_causal=is_causal, dropout_p=dropout_p, entry=f"{kind!r} attention")
        group, layout = None, None
        if row.sequence_parallel:
            group, layout = _group_layout(config["group"], config["layout"])
        return row.run(q, k, v, config, is_causal=is_causal, attention_mask=attention_mask, position_ids=position_ids,
                       scale=scale, dropout_p=dropout_p, group=group, layout=layout, sliding_window=sliding_window,
                       rope_frequencies=rope_frequencies, state=state)

    def choose(self, kv_len: int, device, *, position_ids=None) -> tuple[str, dict]:
        """What "auto" runs for a call with `kv_len` keys (this rank's shard under sequence
        parallelism) on `device`: (kind, config). Other kinds return themselves."""
        if self.kind != "auto":
            return self.kind, self.config
        cfg = self.config
        group, layout = _group_layout(cfg["group"], cfg["layout"])
        world = _world(group)
        seq_len = kv_len * world
        seg, dil = cfg["segment_lengths"], cfg["dilation_rates"]
        if seg is None:
            dense_max = cfg["dense_max_len"] or AUTO_DENSE_MAX_LEN.get(torch.device(device).type, 4096)
            seg, dil = default_schedule(dense_max, seq_len)
        # The pattern is dense on this input when every position lies in the first segment and
        # that level has no dilation ("union" only: "longnet" counts keys once per level).
        if position_ids is None:
            span = seq_len
        elif world == 1 and position_ids.numel():  # (local shards do not show the global positions)
            low, high = torch.stack([position_ids.min(), position_ids.max()]).tolist()  # (one read back)
            span = high + 1 if low >= 0 else None  # (a negative position lies before the first segment)
        else:
            span = None
        dense = cfg["mode"] == "union" and dil[0] == 1 and span is not None and span <= seg[0]
        if world > 1:
            if dense:
                return "ring", {"group": group, "layout": layout}
            return "dilated_ring", {**_settings("dilated_ring"), "segment_lengths": seg, "dilation_rates": dil,
                                    "mode": cfg["mode"], "group": group, "layout": layout}
        if dense:
            return "dense", {}
        return "dilated", {**_settings("dilated"), "segment_lengths": seg, "dilation_rates": dil, "mode": cfg["mode"]}


def create_attention(kind: str, **config) -> Attention:
    """An attention variant by name (see the module docstring for each kind's configuration).

    "auto" decides per call, from the sequence length, the device and whether a
    sequence-parallel process group is active:

    1. The pattern is dilated attention in "union" mode: `segment_lengths` / `dilation_rates` when
       given; otherwise the first segment is `dense_max_len` (default by device: 4096 on CPU,
       16384 on CUDA) with dilation 1, and each further level doubles both until a segment covers
       the (global) sequence. So documents no longer than the first segment get exact dense
       attention and the cost beyond it grows linearly.
    2. A sequence-parallel group with more than one rank (`group`, or the one set by
       `hf_dilated.distributed.setup_sequence_parallel`): "ring" when the whole global sequence
       fits in the first segment (the pattern is dense there), else "dilated_ring".
    3. A single process: "dense" (sdpa) when the sequence fits in the first segment, else "dilated".

    Why 4096 on CPU (`hf-dilated bench kernels --variants union --segment-lengths 4096,8192,16384
    --dilation-rates 1,2,4`, 2 shared cores, float32, batch 1, 8 heads, head_dim 64): at 4096
    tokens the pattern is dense and the kernels tie (union 704 ms vs sdpa 770 ms forward); at 8192
    the dilated pattern already takes 0.79x sdpa's forward time and 0.95x its forward+backward,
    at 16384 0.48x and 0.40x. So the first doubling past 4096 pays. The CUDA default (16384) is
    not measured in this project yet: dense flash attention is far cheaper there relative to the
    gathers of the dilated kernel, so the crossover is expected later; check it with
    `hf-dilated bench kernels --device cuda --variants auto`.
    """
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {', '.join(map(repr, KINDS))}, got {kind!r}")
    allowed = _settings(kind)
    unknown = sorted(set(config) - set(allowed))
    if unknown:
        raise TypeError(f"create_attention({kind!r}) got unknown config {unknown}; it takes {sorted(allowed) or 'none'}")
    missing = [key for key, default in allowed.items() if default is REQUIRED and config.get(key) is None]
    if missing:
        raise TypeError(f"create_attention({kind!r}) needs {missing}")
    cfg = {**allowed, **config}
    if cfg.get("segment_lengths") is not None or cfg.get("dilation_rates") is not None or "mode" in cfg:
        if kind == "auto" and (cfg["segment_lengths"] is None) != (cfg["dilation_rates"] is None):
            raise ValueError("create_attention('auto'): give both segment_lengths and dilation_rates, or neither")
        if cfg.get("segment_lengths") is not None:
            seg, dil = check_dilated_config(cfg["segment_lengths"], cfg["dilation_rates"], cfg["mode"])
            cfg["segment_lengths"], cfg["dilation_rates"] = seg, dil
        else:
            check_mode(cfg["mode"])
    if "far_group" in cfg:
        check_band(cfg["mode"], cfg["local_window"], cfg["far_group"], cfg["far_window"], cfg["far_band"],
                   cfg["far_top_k"], cfg["far_block_size"], cfg["far_sinks"])
    if "pattern" in cfg:
        cfg["pattern"] = check_block_sparse(cfg["pattern"], cfg["block_size"])
    if kind == "auto":
        if cfg["mode"] != "union" and cfg["segment_lengths"] is None:
            raise ValueError("create_attention('auto'): mode other than 'union' needs explicit segment_lengths")
        d = cfg["dense_max_len"]
        check_int("dense_max_len", d, optional=True)
        if d is not None and cfg["segment_lengths"] is not None:
            raise ValueError("create_attention('auto'): dense_max_len sets the first segment; do not also give "
                             "segment_lengths")
    if "layout" in cfg:
        check_ring_layout(cfg["layout"], optional=True)
    return Attention(kind, cfg)


def _group_layout(group, layout):
    from .distributed.groups import resolve_group_layout  # torch.distributed: only for the ring kinds

    return resolve_group_layout(group, layout)


def _world(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    return dist.get_world_size(group)


# --- the drop-in module -----------------------------------------------------------------------


def _keep_off_fused_fast_path(module, args):
    return None


class DilatedMultiheadAttention(nn.Module):
    """Drop-in for `torch.nn.MultiheadAttention` computing one of our attention variants.

    The constructor takes nn.MultiheadAttention's arguments (embed_dim, num_heads, dropout, bias,
    kdim, vdim, batch_first, device, dtype) and has the same parameters (`in_proj_weight`,
    `in_proj_bias` or `q/k/v_proj_weight`, `out_proj`), so a state_dict of one loads into the
    other. The variant: `attention` = a kind name with its configuration as keyword arguments
    (see `create_attention`), or an `Attention`; the default "auto".

    forward(query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
    average_attn_weights=True, is_causal=False, *, position_ids=None) -> (output, None):
    - `is_causal=True` needs no `attn_mask` (one may be given if it is exactly the causal mask);
      with q_len < kv_len the queries are the last q_len tokens (decode alignment). A non-causal
      call with more queries than keys is cross-attention (a decoder's target over its memory),
      computed where the attention is dense over the keys: padding honoured, no `position_ids`.
    - `key_padding_mask` (batch, kv_len), True (or -inf) = ignore that key, as in PyTorch. The
      pattern is laid over token indices, as nn.MultiheadAttention's causal mask is; pass
      `position_ids` (batch, kv_len) to lay it over real-token positions or packed documents.
      Outputs at padded query positions are unspecified (docs/contract.md 3.1), where
      nn.MultiheadAttention still computes them.
    - Attention weights are never materialised: `need_weights=True` is a ValueError (the default
      here is False; nn.MultiheadAttention's default True would be a silent O(N^2) matrix).
    - `add_bias_kv`, `add_zero_attn` and arbitrary `attn_mask`s have no place in a positional
      sparse pattern and raise ValueError.
    """

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, attention="auto",
                 **attention_config):
        super().__init__()
        if not isinstance(embed_dim, int) or embed_dim <= 0 or not isinstance(num_heads, int) or num_heads <= 0:
            raise ValueError(f"embed_dim and num_heads must be positive ints, got {embed_dim!r} and {num_heads!r}")
        if embed_dim % num_heads:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads ({num_heads})")
        if add_bias_kv or add_zero_attn:
            raise ValueError("add_bias_kv / add_zero_attn: an extra key at no sequence position has no place in a "
                             "positional attention pattern; they are not supported")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout!r}")
        if isinstance(attention, Attention):
            if attention_config:
                raise TypeError(f"attention is an Attention already; unexpected config {sorted(attention_config)}")
            self.attention = attention
        else:
            self.attention = create_attention(attention, **attention_config)
        if (self.attention.config.get("far_group") or 1) > 1:
            raise ValueError(f"far_group={self.attention.config['far_group']}: far keys at grouped positions move "
                             "keys the model rotated by RoPE, and this module applies none; set far_group to 1")
        if dropout and self.attention.kind in _KINDS:  # (one without dropout failed at the first training forward;
            # "auto" chooses among kinds that have it)
            _KINDS[self.attention.kind].check_call(is_causal=True, dropout_p=dropout,
                                                   entry=f"{self.attention.kind!r} attention")
        factory = {"device": device, "dtype": dtype}
        self.embed_dim, self.num_heads, self.dropout = embed_dim, num_heads, dropout
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.batch_first = batch_first
        self.head_dim = embed_dim // num_heads
        if self._qkv_same_embed_dim:
            self.in_proj_weight = nn.Parameter(torch.empty(3 * embed_dim, embed_dim, **factory))
            self.register_parameter("q_proj_weight", None)
            self.register_parameter("k_proj_weight", None)
            self.register_parameter("v_proj_weight", None)
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(embed_dim, embed_dim, **factory))
            self.k_proj_weight = nn.Parameter(torch.empty(embed_dim, self.kdim, **factory))
            self.v_proj_weight = nn.Parameter(torch.empty(embed_dim, self.vdim, **factory))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = nn.Parameter(torch.empty(3 * embed_dim, **factory))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = nn.modules.linear.NonDynamicallyQuantizableLinear(embed_dim, embed_dim, bias=bias, **factory)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()
        # nn.TransformerEncoderLayer in eval mode skips self_attn.forward and computes dense attention
        # from in_proj_weight itself (its "fast path") unless a module has a forward hook: this one
        # keeps our attention in use wherever the module is dropped in.
        self.register_forward_pre_hook(_keep_off_fused_fast_path)

    def _reset_parameters(self):
        # nn.MultiheadAttention's initialisation.
        if self._qkv_same_embed_dim:
            nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            nn.init.xavier_uniform_(self.q_proj_weight)
            nn.init.xavier_uniform_(self.k_proj_weight)
            nn.init.xavier_uniform_(self.v_proj_weight)
        if self.in_proj_bias is not None:
            nn.init.constant_(self.in_proj_bias, 0.0)
            nn.init.constant_(self.out_proj.bias, 0.0)

    def extra_repr(self) -> str:
        return f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, attention={self.attention.kind!r}"

    def forward(self, query, key, value, key_padding_mask=None, need_weights=False, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, position_ids=None):
        if need_weights:
            raise ValueError("need_weights=True: DilatedMultiheadAttention never materialises attention weights "
                             "(that is an O(N^2) matrix); call with need_weights=False")
        if not isinstance(is_causal, bool):
            raise TypeError(f"is_causal must be a bool, got {is_causal!r}")
        if any(t.is_nested for t in (query, key, value)):
            raise ValueError("nested tensors are not supported (nn.TransformerEncoder makes them from a padding "
                             "mask in eval mode): build it with enable_nested_tensor=False")
        batched = query.dim() == 3
        if not batched:
            if query.dim() != 2 or key.dim() != 2 or value.dim() != 2:
                raise ValueError(f"query, key, value must be 2-D (unbatched) or 3-D, got {query.dim()}-D, "
                                 f"{key.dim()}-D, {value.dim()}-D")
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
            if position_ids is not None:
                position_ids = position_ids.unsqueeze(0) if position_ids.dim() == 1 else position_ids
        elif key.dim() != 3 or value.dim() != 3:
            raise ValueError(f"key and value must be 3-D like query, got {key.dim()}-D and {value.dim()}-D")
        if self.batch_first and batched:
            query, key, value = (x.transpose(0, 1) for x in (query, key, value))
        # now (seq, batch, dim)
        q_len, batch, _ = query.shape
        kv_len = key.shape[0]
        if key.shape[:2] != value.shape[:2] or key.shape[1] != batch:
            raise ValueError(f"key and value must share (seq, batch) with query's batch, got key "
                             f"{tuple(key.shape)}, value {tuple(value.shape)}, query {tuple(query.shape)}")
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's last dimension must be embed_dim ({self.embed_dim}), got {query.shape[-1]}")
        mask = self._key_mask(key_padding_mask, batch, kv_len, query.device)
        self._check_attn_mask(attn_mask, is_causal, q_len, kv_len)
        if mask is not None and position_ids is None and q_len <= kv_len:
            # Index-based pattern (as nn.MultiheadAttention): the mask only hides keys.
            position_ids = torch.arange(kv_len, device=query.device).expand(batch, kv_len)

        q, k, v = self._project(query, key, value)
        dropout_p = self.dropout if self.training else 0.0
        if q_len > kv_len:
            out = self._cross_attention(q, k, v, mask, position_ids, is_causal, dropout_p)
        else:
            out = self.attention(q, k, v, is_causal=is_causal, attention_mask=mask, position_ids=position_ids,
                                 dropout_p=dropout_p)
        out = out.permute(2, 0, 1, 3).reshape(q_len, batch, self.embed_dim)  # (seq, batch, embed)
        out = self.out_proj(out)
        if self.batch_first and batched:
            out = out.transpose(0, 1)
        if not batched:
            out = out.squeeze(1)
        return out, None

    def _cross_attention(self, q, k, v, mask, position_ids, is_causal, dropout_p):
        """More queries than keys (a decoder's target over a shorter memory, as nn.TransformerDecoderLayer
        passes): the queries are not tokens of the key sequence, which no variant's pattern places
        (docs/contract.md: q_len <= kv_len). Where the configured attention is dense over these keys,
        this is plain attention over them, padding honoured, and computed here; else an error."""
        kind = self.attention.choose(k.shape[2], k.device)[0]
        if is_causal or position_ids is not None or kind != "dense":
            raise ValueError(f"query: {q.shape[2]} queries over {k.shape[2]} keys is cross-attention, computed only "
                             f"non-causal, without position_ids, where the attention is dense over the keys (this "
                             f"module's {self.attention.kind!r} runs {kind!r} here)")
        keep = None if mask is None else mask.bool()[:, None, None, :]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p,
                                             enable_gqa=bool(q.shape[1] != k.shape[1]))
        # a row without a real key reads nothing (0, as the kernels give it), where sdpa's softmax gives NaN
        return out if keep is None else out.masked_fill(~keep.any(-1, keepdim=True), 0.0)

    def _project(self, query, key, value):
        e = self.embed_dim
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(e)
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(e)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        heads = []
        for x, w, b in ((query, w_q, b_q), (key, w_k, b_k), (value, w_v, b_v)):
            y = F.linear(x, w, b)  # (seq, batch, embed)
            heads.append(y.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).permute(1, 2, 0, 3))
        return heads  # each (batch, heads, seq, head_dim)

    @staticmethod
    def _key_mask(key_padding_mask, batch, kv_len, device):
        """(batch, kv_len) bool, True = real key, or None."""
        if key_padding_mask is None:
            return None
        kpm = key_padding_mask
        if kpm.shape != (batch, kv_len):
            raise ValueError(f"key_padding_mask must have shape (batch, kv_len) = ({batch}, {kv_len}), "
                             f"got {tuple(kpm.shape)}")
        if kpm.dtype == torch.bool:
            return ~kpm.to(device)
        if kpm.is_floating_point():
            hidden = torch.isneginf(kpm)
            if not bool((hidden | (kpm == 0)).all()):
                raise ValueError("key_padding_mask: a float mask must hold only 0 (keep) and -inf (ignore); "
                                 "other additive biases are not supported")
            return ~hidden.to(device)
        raise TypeError(f"key_padding_mask must be bool or float, got {kpm.dtype}")

    @staticmethod
    def _check_attn_mask(attn_mask, is_causal, q_len, kv_len):
        if attn_mask is None:
            return
        if attn_mask.shape != (q_len, kv_len):
            raise ValueError(f"attn_mask: only the causal mask of shape (q_len, kv_len) = ({q_len}, {kv_len}) is "
                             f"supported, got shape {tuple(attn_mask.shape)}")
        i = torch.arange(q_len, device=attn_mask.device)[:, None] + (kv_len - q_len)
        j = torch.arange(kv_len, device=attn_mask.device)[None, :]
        hidden = attn_mask if attn_mask.dtype == torch.bool else torch.isneginf(attn_mask)
        exact = attn_mask.dtype == torch.bool or bool((hidden | (attn_mask == 0)).all())
        if not (is_causal and exact and torch.equal(hidden, j > i)):
            raise ValueError("attn_mask: only the causal mask is supported, together with is_causal=True (pass "
                             "is_causal=True alone; padding goes in key_padding_mask)")
