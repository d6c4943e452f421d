"""flashcl as an attention implementation of Hugging Face transformers.

    import flashcl.integrations.transformers as fcl_hf
    model = AutoModelForCausalLM.from_pretrained(name, attn_implementation=fcl_hf.register())

Every attention layer then runs ``flashcl.prefill`` (or ``flashcl.decode`` for one new token per
sequence): torch CPU tensors on an OpenCL device (``$FLASHCL_DEVICE``, else flashcl's default),
CUDA tensors on the Triton kernels. Inference only: dropout, attention weights and gradients are
refused with an error.

The mask is transformers' own SDPA mask (boolean, True = attend, or None where a plain causal or
full pattern holds), so padding, sliding windows and any custom pattern are honoured exactly. Each
layer's mask is reduced to the tightest ``causal``/``window`` that contains it, which lets the
kernels skip key tiles outside the band; the mask itself is passed on only when it hides keys
inside that band (padding, packed sequences, custom patterns). A decode step whose mask shows each
sequence a suffix of its keys (a left-padded batch) runs as ``flashcl.decode`` with each
sequence's first key (``key_start``), which never reads the padding. Softcap (Gemma 2) and sinks
(gpt-oss's ``s_aux``) map to flashcl's variants; GQA runs without repeating K/V.

``quantized_cache(fmt)`` is a transformers cache that keeps each layer's K and V quantized
(``flashcl.quantize``: q8_0, q4_0 or int8), which the attention reads in place: pass it to
``generate(..., past_key_values=quantized_cache("q8_0", model.config))`` (``cache=`` in the
transformers releases that renamed it). A q8_0 cache holds 34 bytes per 32 values (float32:
128), a full layer's buffers up to a quarter more (a sliding layer's, after a long prompt, up to
twice the room its window needs); the attention sees the values ``flashcl.dequantize`` gives,
within the exceptions of docs/quantized-formats.md. Given the config, sliding-window layers keep
only their window's keys, as transformers' own cache.

Only models whose attention goes through transformers' attention interface run flashcl.
transformers accepts the name for the others too (Bloom, MPT, ...), which then never call flashcl
and misread the SDPA-style mask registered with it: ``check(model)`` raises for them.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass, replace
from typing import Any, Optional, Tuple

from .. import api, quant

# transformers sends any implementation whose name contains "flash" to its flash-attention loader.
NAME = "fcl"

# Keywords that describe inputs flashcl would otherwise misread: packed varlen batches (FA's
# cu_seqlens), additive position biases (T5-style), sparse attention's selected keys
# (DeepSeek-V3.2's indexer: indices, block_indices) and per-token sinks (Inkling2's `sinks`;
# gpt-oss's per-head ones come as s_aux) carry structure the mask does not show.
_UNSUPPORTED = ("position_bias", "cu_seq_lens_q", "cu_seq_lens_k", "cu_seqlens_q", "cu_seqlens_k",
                "indices", "block_indices", "sinks")


def register() -> str:
    """Register flashcl with transformers' ``AttentionInterface`` and ``AttentionMaskInterface``;
    returns the name to pass as ``attn_implementation=``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(NAME, attention_forward)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    return NAME


def check(model) -> None:
    """Raise ValueError unless ``model``'s attention runs through transformers' attention
    interface, where ``attn_implementation=register()`` takes effect: its class says so
    (``_supports_attention_backend``), or one of its modules' methods looks the attention function
    up in ``ALL_ATTENTION_FUNCTIONS`` (many models that do so, StableLM, BART, Qwen3.5, lack the
    flag). A model with its own attention code otherwise computes wrong results silently."""
    if not (getattr(type(model), "_supports_attention_backend", False) or _calls_interface(model)):
        raise ValueError(f"{type(model).__name__} computes attention with its own code, not through "
                         f"transformers' attention interface: flashcl ({NAME!r}) would not run and its "
                         "mask would be misread; load it with attn_implementation='eager' or 'sdpa'")


def _calls_interface(model) -> bool:
    """Whether a method of one of ``model``'s module classes reads the global
    ``ALL_ATTENTION_FUNCTIONS`` (the names its bytecode loads, under any decorators)."""
    methods = (inspect.unwrap(fn) for cls in {type(m) for m in model.modules()}
               for fn in vars(cls).values() if callable(fn))
    return any("ALL_ATTENTION_FUNCTIONS" in fn.__code__.co_names for fn in methods if hasattr(fn, "__code__"))


# The formats a growing cache takes: fp8_e4m3's one scale per tensor cannot take new tokens.
CACHE_FORMATS = ("q8_0", "q4_0", "int8")


def quantized_cache(fmt: str = "q8_0", config=None, value_fmt: Optional[str] = None):
    """A transformers ``Cache`` whose layers keep K and V as ``flashcl.QuantizedTensor`` (format
    ``fmt``, one of CACHE_FORMATS; V in ``value_fmt`` where given, as llama.cpp's -ctk / -ctv),
    each step's new tokens quantized and written into buffers with room for more
    (``flashcl.quant.write_tokens``), which decode reads in place.

    Given the model's ``config``, the layers follow its layer types as ``DynamicCache(config=)``'s
    do: a sliding-window (or chunked) layer keeps only the keys its window can still reach.
    Without it every layer keeps its whole history (the masks still limit what each attends).
    Beam search, cropping (assisted decoding) and batch reshaping work as on transformers' own
    cache. Only flashcl's attention (``register()``) reads it: other implementations take
    tensors. transformers 5 (tested: 5.17, 5.24); attention layers only: a config whose layers
    DynamicCache makes other than attention layers (linear-attention, state-space, sparse) raises
    NotImplementedError."""
    import transformers

    formats = (fmt, fmt if value_fmt is None else value_fmt)
    for name, value in zip(("fmt", "value_fmt"), formats):
        if value not in CACHE_FORMATS:
            raise ValueError(f"quantized_cache: {name} must be one of {CACHE_FORMATS}, got {value!r}")
    if int(transformers.__version__.split(".")[0]) < 5:
        raise RuntimeError(f"quantized_cache needs transformers 5 or later (its Cache layers), got "
                           f"{transformers.__version__}")
    cache_class, layer_class, window_class = _cache_classes()
    if config is None:
        return cache_class(formats, layer_class_to_replicate=functools.partial(layer_class, formats))
    from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

    layers = []
    for plain in DynamicCache(config=config).layers:
        if type(plain) is DynamicLayer:
            layers.append(layer_class(formats))
        elif type(plain) is DynamicSlidingWindowLayer:
            layers.append(window_class(formats, plain.sliding_window))
        elif type(plain).__name__ == "DummyLayer":  # transformers 5.24's holder of no K/V (MoE, shared K/V)
            layers.append(plain)
        else:
            raise NotImplementedError(f"flashcl's quantized cache holds attention layers only; this model's "
                                      f"config has {type(plain).__name__} layers")
    return cache_class(formats, layers=layers)


def _refused(what: str):
    """A cache method that raises NotImplementedError naming ``what`` the quantized cache lacks."""
    def method(self, *args, **kwargs):
        raise NotImplementedError(f"flashcl's quantized cache does not support {what}")
    return method


@functools.lru_cache(maxsize=None)
def _cache_classes():
    """(QuantizedKVCache, QuantizedKVLayer, QuantizedWindowLayer): built on first use,
    transformers being optional."""
    import torch
    from transformers.cache_utils import Cache, DynamicLayer

    class QuantizedKVLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are CachedTokens: each step's tokens quantized and
        written into buffers with room for more (a quarter more than they hold, so a step copies
        no history). The layer holds the buffers' tokens [start, end); this one keeps them all."""

        is_croppable = True

        def __init__(self, formats: Tuple[str, str]):
            super().__init__()
            self.formats = formats  # of K and of V
            self._buffers, self._start, self._end = None, 0, 0

        def lazy_initialization(self, key_states, value_states) -> None:
            self.device = key_states.device
            self.is_initialized = True

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            states, t = (key_states, value_states), key_states.shape[-2]
            if self._buffers is None:  # empty buffers of the states' format, shape, dtype and device
                self._buffers = [quant.with_room(quant.quantize(x[..., :0, :], fmt), _room(t))
                                 for x, fmt in zip(states, self.formats)]
            elif self._end + t > self._buffers[0].shape[-2]:
                self._move(self._end - self._start + t)
            for buf, x in zip(self._buffers, states):
                quant.write_tokens(buf, self._end, x)
            self._end += t
            return self._visible_after_write(t)

        def _visible_after_write(self, t: int):
            """The tokens this step's queries see (after ``t`` new ones), as (keys, values)."""
            self._refresh_views()
            return self.keys, self.values

        def _refresh_views(self) -> None:
            """Point ``keys``/``values`` at the tokens held."""
            self.keys, self.values = (CachedTokens.of(buf, self._start, self._end) for buf in self._buffers)

        def _move(self, tokens: int) -> None:
            """The tokens held to the front of new buffers with room for ``tokens``."""
            self._buffers = [quant.with_room(quant.tokens(buf, self._start, self._end, copy=False), _room(tokens))
                             for buf in self._buffers]
            self._start, self._end = 0, self._end - self._start

        def get_seq_length(self) -> int:
            return self._end

        def reset(self) -> None:
            # dropped, not zeroed in place (transformers 5.17's reset zeroes keys it finds initialized)
            self._buffers, self._start, self._end = None, 0, 0
            self.keys = self.values = None
            self.is_initialized = False
            super().reset()

        def crop(self, tokens_to_remove: int) -> None:
            """Drop the last -``tokens_to_remove`` tokens; a positive value is the length to keep
            (transformers 5.17's older form, which 5.24 refuses)."""
            tokens_to_remove = self._removed(tokens_to_remove)
            if self._buffers is not None and tokens_to_remove:
                self._end = max(self._start, self._end + tokens_to_remove)
                self._refresh_views()

        def _removed(self, tokens_to_remove) -> int:
            """crop's argument as the negative number of tokens to drop (generate() may pass a 0-d tensor)."""
            tokens_to_remove = int(tokens_to_remove)
            return min(tokens_to_remove - self.get_seq_length(), 0) if tokens_to_remove > 0 else tokens_to_remove

        def reorder_cache(self, beam_idx) -> None:
            self._take(beam_idx)

        def batch_select_indices(self, indices) -> None:
            indices = torch.as_tensor(indices)
            self._take(indices.nonzero().reshape(-1) if indices.dtype == torch.bool else indices.reshape(-1))

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self._buffers is not None:
                self._take(torch.arange(self._buffers[0].shape[0]).repeat_interleave(repeats))

        def _take(self, index) -> None:
            """Keep the sequences ``index`` of the batch, in that order (repeats allowed)."""
            if self._buffers is not None:
                index = index.to(device=self._buffers[0].data.device, dtype=torch.int64)
                self._buffers = [quant.select_batch(buf, index) for buf in self._buffers]
                self._refresh_views()

    class QuantizedWindowLayer(QuantizedKVLayer):
        """A sliding-window (or chunked) layer, as transformers' DynamicSlidingWindowLayer: it
        keeps the last ``sliding_window - 1`` tokens, and a step's queries see those and the
        step's own. ``activate_past_recording`` (assisted decoding) keeps the rest until the
        next ``crop``, which can then roll back past the window."""

        is_sliding = True

        def __init__(self, formats: Tuple[str, str], sliding_window: int):
            super().__init__(formats)
            self.sliding_window = sliding_window
            self.cumulative_length = 0
            self.record_past = False

        def activate_past_recording(self) -> None:
            self.record_past = True

        def _visible_after_write(self, t: int):
            self.cumulative_length += t
            first = max(self._start, self._end - t - (self.sliding_window - 1))
            seen = tuple(CachedTokens.of(buf, first, self._end) for buf in self._buffers)
            self._keep_from(self._start if self.record_past else self._end - (self.sliding_window - 1))
            return seen

        def _keep_from(self, first: int) -> None:
            """Hold the tokens from buffer index ``first`` on, and move them to smaller buffers
            once theirs hold more than twice the room they need (after a long prompt)."""
            self._start = max(self._start, first)
            held = self._end - self._start
            if self._buffers[0].shape[-2] > 2 * _room(held):
                self._move(held)
            self._refresh_views()

        def get_mask_sizes(self, query_length: int) -> Tuple[int, int]:
            past = min(self.cumulative_length, self.sliding_window - 1)
            return past + query_length, max(self.cumulative_length - self.sliding_window + 1, 0)

        def get_seq_length(self) -> int:
            return self.cumulative_length

        def get_max_length(self) -> int:
            return self.sliding_window

        def crop(self, tokens_to_remove: int) -> None:
            past = self.cumulative_length >= self.sliding_window
            if past and (not self.record_past or int(tokens_to_remove) > 0):
                raise RuntimeError("crop: this sliding-window layer has dropped the tokens before its window; "
                                   "call activate_past_recording() before the steps to be rolled back, and "
                                   "crop by the negative number of tokens to remove")
            tokens_to_remove = self._removed(tokens_to_remove)
            super().crop(tokens_to_remove)
            if self._buffers is not None:
                self.cumulative_length = max(self.cumulative_length + tokens_to_remove, 0)
                self._keep_from(self._end - (self.sliding_window - 1))

    class QuantizedKVCache(Cache):
        """transformers' Cache over QuantizedKVLayers (quantized_cache)."""

        def __init__(self, formats: Tuple[str, str], **layers):
            super().__init__(**layers)
            self.formats = formats  # of K and of V

    # a hybrid model's linear-attention / state-space layers, or a sparse indexer, keep other states
    for name in ("get_conv_state", "update_conv_state", "get_recurrent_state", "update_recurrent_state",
                 "has_previous_state", "update_indexer"):
        if hasattr(Cache, name):
            setattr(QuantizedKVCache, name, _refused("a model's linear-attention or indexer layers"))
    return QuantizedKVCache, QuantizedKVLayer, QuantizedWindowLayer


# A layer's buffers are made for a quarter more tokens than they must hold, and _ROOM // 4 at least.
_ROOM = 256


def _room(tokens: int) -> int:
    """The tokens a layer's buffers are made for when they must hold ``tokens``."""
    return tokens + max(tokens, _ROOM) // 4


@dataclass(frozen=True)
class CachedTokens(quant.QuantizedTensor):
    """Tokens [start, start + shape[-2]) of ``buffer`` (a QuantizedTensor with room for more),
    viewed: what a quantized cache's layer hands the attention, which decodes on the buffer
    itself (from ``start`` to the end) rather than copying the tokens out."""

    buffer: Any = None
    start: int = 0

    @classmethod
    def of(cls, buffer: quant.QuantizedTensor, start: int, stop: int) -> "CachedTokens":
        view = quant.tokens(buffer, start, stop, copy=False)
        return cls(view.data, view.scales, view.fmt, view.shape, view.dtype, buffer, start)


def _first_keys(x, n: int):
    """Keys (or values) ``x`` (B, H_kv, N, D), a tensor or a QuantizedTensor, cut to their first ``n``."""
    return quant.tokens(x, 0, n) if isinstance(x, quant.QuantizedTensor) else x[:, :, :n]


@dataclass(frozen=True)
class Plan:
    """How one layer's mask maps onto flashcl: ``causal`` and ``window`` (keys visible to row i at
    position p = i + N_kv - N_q, docs/design.md §2) contain every key the mask shows; ``mask`` is
    None when they, and ``key_start`` where given, show exactly those keys, else a bool mask or a
    float32 additive one. ``key_start``: one query row whose mask shows each sequence, in every
    head, the keys from its first visible one on (the band's, a left-padded batch's): those
    first keys, int32 (B or 1,), for decode. ``keys``: where no row sees a key from some point on
    (a static cache's unwritten slots), the keys before it, which the plan is of; else None."""

    causal: bool
    window: Optional[Tuple[int, int]]
    mask: Any
    key_start: Any = None
    keys: Optional[int] = None


def plan_for_mask(mask, n_q: int, n_kv: int) -> Plan:
    """The Plan of a 4-D (B or 1, H or 1, N_q, >= N_kv) mask, bool (True = attend) or additive
    float (the dtype's minimum or -inf hides, as transformers' eager masks do)."""
    import torch

    if mask.dtype != torch.bool and not mask.dtype.is_floating_point:
        raise TypeError(f"attention_mask: expected bool (True = attend) or an additive float mask, got {mask.dtype}")
    if mask.dim() != 4 or mask.shape[-2] != n_q:
        raise ValueError(f"attention_mask: expected (B, 1 or H, {n_q}, >= {n_kv}), got {tuple(mask.shape)}")
    if mask.shape[-1] < n_kv:  # eager and SDPA would stretch it over the keys it does not cover
        raise ValueError(f"attention_mask: covers {mask.shape[-1]} keys, the layer attends {n_kv} (shape "
                         f"{tuple(mask.shape)}): the model built it for another layer's cache")
    mask = mask[..., :n_kv]  # a static cache's mask covers all of its slots
    if mask.dtype == torch.bool:
        visible, bias = mask, None
    else:
        visible = mask > torch.finfo(mask.dtype).min
        has_bias = bool(torch.where(visible, mask, torch.zeros((), dtype=mask.dtype, device=mask.device)).any())
        bias = torch.where(visible, mask.float(), float("-inf")) if has_bias else None
    count = visible.sum(-1)
    seen = count > 0
    if not bool(seen.any()):
        return Plan(causal=False, window=None, mask=visible)
    keys = n_kv - int(visible.flatten(0, 2).any(0).flip(0).to(torch.uint8).argmax())
    if keys < n_kv:  # the keys no row sees are left out, so a static cache's step is a decode too
        return replace(plan_for_mask(mask[..., :keys], n_q, keys), keys=keys)

    # Per row: first and last visible key, relative to the row's bottom-right position p.
    pos = torch.arange(n_q, device=mask.device) + (n_kv - n_q)
    first = visible.to(torch.uint8).argmax(-1)
    last = (n_kv - 1) - visible.flip(-1).to(torch.uint8).argmax(-1)
    behind = int(torch.where(seen, pos - first, torch.iinfo(torch.int64).min).max())
    ahead = int(torch.where(seen, last - pos, torch.iinfo(torch.int64).min).max())

    causal = ahead <= 0
    left = max(behind, 0) if behind < n_kv - 1 else -1
    right = 0 if causal else (ahead if ahead < n_q - 1 else -1)
    window = None if left == -1 and right == (0 if causal else -1) else (left, right)

    # The band holds every visible key, so the mask adds nothing iff each row shows the whole band.
    lo = (pos - left).clamp(min=0) if left >= 0 else torch.zeros_like(pos)
    hi = (pos + right).clamp(max=n_kv - 1) if right >= 0 else torch.full_like(pos, n_kv - 1)
    band = (hi - lo + 1).clamp(min=0)
    exact = bias is None and bool((count == band).all())
    if exact or bias is not None:
        return Plan(causal=causal, window=window, mask=None if exact else bias)
    if n_q == 1:
        # each row's visible keys [start, N_kv): a left-padded row, cut by the band's left side
        start = torch.where(seen, first, n_kv)[:, :, 0]
        if bool((count[:, :, 0] == n_kv - start).all()) and bool((start == start[:, :1]).all()):
            return Plan(causal=causal, window=window, mask=None, key_start=start[:, 0].to(torch.int32))
    return Plan(causal=causal, window=window, mask=visible)


def _cached_plan(mask, n_q: int, n_kv: int) -> Plan:
    """plan_for_mask, kept on the mask tensor itself: every layer of a kind gets the same mask
    object in one forward, and the plan dies with it. An in-place change invalidates it: seen by
    the version counter, or (inference tensors keep none) by a copy compared with the mask."""
    import torch

    try:
        version = mask._version
    except RuntimeError:
        version = None
    key = (version, n_q, n_kv)
    held = getattr(mask, "_flashcl_plan", None)
    if held is not None and held[0] == key and (held[2] is None or torch.equal(held[2], mask)):
        return held[1]
    plan = plan_for_mask(mask, n_q, n_kv)
    mask._flashcl_plan = (key, plan, mask.clone() if version is None else None)
    return plan


def attention_forward(module, query, key, value, attention_mask, dropout: float = 0.0,
                      scaling: Optional[float] = None, softcap: Optional[float] = None,
                      s_aux=None, is_causal: Optional[bool] = None, sliding_window=None, **kwargs):
    """transformers' attention-function signature: query (B, H_q, N_q, D), key/value
    (B, H_kv, N_kv, D) -> ((B, N_q, H_q, DV), None).

    ``sliding_window`` is not read: the layer's mask already holds the window, which is what
    eager and SDPA attend through too.
    """
    import torch

    if dropout:
        raise ValueError(f"flashcl attention has no dropout (got {dropout}); call model.eval() or set "
                         "the config's attention_dropout to 0")
    if kwargs.get("output_attentions"):
        raise ValueError("flashcl attention does not return attention weights; use attn_implementation='eager'")
    for name in _UNSUPPORTED:
        if kwargs.get(name) is not None:
            raise ValueError(f"flashcl attention does not take {name}; use attn_implementation='sdpa' or 'eager'")
    learned = (query, key, value, s_aux, attention_mask)  # sinks and a float mask may be trained too
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in learned):
        raise ValueError("flashcl attention computes no gradients; run inference under torch.no_grad() "
                         "or torch.inference_mode()")

    n_q, n_kv = query.shape[2], key.shape[2]
    if attention_mask is None:
        # SDPA's convention for a mask it skipped: a top-left causal (or full) pattern.
        causal = bool(is_causal if is_causal is not None else getattr(module, "is_causal", True)) and n_q > 1
        if causal and n_q > n_kv:
            raise ValueError(f"causal attention without a mask needs N_q <= N_kv, got {n_q} > {n_kv}")
        if causal and n_q < n_kv:
            key, value, n_kv = _first_keys(key, n_q), _first_keys(value, n_q), n_q
        plan = Plan(causal=causal, window=None, mask=None)
    else:
        plan = _cached_plan(attention_mask, n_q, n_kv)

    variants = {"scale": scaling, "window": plan.window, "softcap": softcap, "sinks": s_aux}
    in_buffer = isinstance(key, CachedTokens) and isinstance(value, CachedTokens)
    if n_q == 1 and plan.mask is None:
        starts, lens, keys = plan.key_start, None, plan.keys
        if starts is not None:
            starts = starts.expand(query.shape[0]).contiguous()  # a mask of batch 1 serves every row
        if in_buffer:  # the quantized cache's buffers, read in place from its first key to its last
            first = key.start
            key, value, keys = key.buffer, value.buffer, first + (n_kv if keys is None else keys)
            if first:
                starts = (torch.full((query.shape[0],), first, dtype=torch.int32, device=query.device)
                          if starts is None else starts + first)
        if keys is not None:  # the cache's leading keys, read in place
            lens = torch.full((query.shape[0],), keys, dtype=torch.int32, device=query.device)
        out = api.decode(query[:, :, 0], key, value, key_start=starts, context_lens=lens, **variants)[:, :, None]
    else:
        if plan.keys is not None or in_buffer:  # contiguous copies of the tokens the rows see
            keys = n_kv if plan.keys is None else plan.keys
            key, value = _first_keys(key, keys), _first_keys(value, keys)
        out = api.prefill(query, key, value, causal=plan.causal, mask=plan.mask, **variants)
    return out.transpose(1, 2).contiguous(), None
