"""flashcl inside transformers (flashcl/integrations/transformers.py): tiny random models of each
attention family run through flashcl and are compared with transformers' eager attention, on a
left-padded batch whose sequences outrun the sliding window; plus the mask -> (causal, window,
mask) reduction on its own, and the calls the integration refuses."""

from __future__ import annotations

from typing import Optional

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

import flashcl.api  # noqa: E402
from flashcl.integrations import transformers as fcl_hf  # noqa: E402
from flashcl.reference import rel_err  # noqa: E402

WINDOW = 6           # sliding window of the tiny models; the sequences below are longer
LENGTHS = (19, 11)   # a left-padded batch of two
NEW_TOKENS = 8
PAD = 0
TOL = 1e-4           # float32 logits after two layers of flashcl vs eager

_COMMON = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               num_hidden_layers=2, intermediate_size=128, vocab_size=128, pad_token_id=PAD,
               max_position_embeddings=128)
_ALTERNATING = ["sliding_attention", "full_attention"]


def _llama(**extra):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_COMMON, **extra}))


def _qwen3(**extra):
    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**_COMMON, **extra}))


def _mistral(**extra):
    return transformers.MistralForCausalLM(transformers.MistralConfig(**{**_COMMON, **extra}, sliding_window=WINDOW))


def _gemma2(**extra):
    # A softcap near the scores' size, so that it changes them.
    cfg = transformers.Gemma2Config(**{**_COMMON, **extra}, sliding_window=WINDOW, layer_types=_ALTERNATING,
                                    attn_logit_softcapping=0.5, query_pre_attn_scalar=16)
    return transformers.Gemma2ForCausalLM(cfg)


def _gemma3(**extra):
    cfg = transformers.Gemma3TextConfig(**{**_COMMON, **extra}, sliding_window=WINDOW, layer_types=_ALTERNATING,
                                        query_pre_attn_scalar=16)
    return transformers.Gemma3ForCausalLM(cfg)


def _gpt_oss(**extra):
    # max_position_embeddings = YaRN's factor x its original length, as the real model has them
    cfg = transformers.GptOssConfig(**{**_COMMON, "intermediate_size": 32, "max_position_embeddings": 131072, **extra},
                                    sliding_window=WINDOW,
                                    layer_types=_ALTERNATING, num_local_experts=4, num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # the sinks start at zero; make them matter
        for layer in model.model.layers:
            layer.self_attn.sinks.normal_(0.0, 2.0)
    return model


MODELS = {"llama": _llama, "qwen3": _qwen3, "mistral": _mistral, "gemma2": _gemma2,
          "gemma3": _gemma3, "gpt_oss": _gpt_oss}


# --------------------------------------------------------------------------- fixtures

@pytest.fixture(params=["cpu", "cuda"])
def torch_device(request, monkeypatch):
    """"cpu": torch CPU tensors on the first OpenCL CPU device; "cuda": the Triton kernels."""
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        return "cuda"
    monkeypatch.setenv("FLASHCL_DEVICE", request.getfixturevalue("cpu_device"))
    return "cpu"


@pytest.fixture
def flashcl_calls(monkeypatch):
    """Every flashcl call the integration makes, as (function, keywords): proof that the model ran
    through flashcl, and what it asked for."""
    calls = []

    def spy(name, fn):
        def wrapped(*args, **kwargs):
            calls.append((name, kwargs))
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(flashcl.api, "prefill", spy("prefill", flashcl.api.prefill))
    monkeypatch.setattr(flashcl.api, "decode", spy("decode", flashcl.api.decode))
    return calls


def _build(family: str, implementation: str, device: str, **config):
    torch.manual_seed(0)
    model = MODELS[family](**config)
    model.set_attn_implementation(implementation)
    return model.eval().to(device)


def _padded_batch(device: str, lengths=LENGTHS):
    gen = torch.Generator().manual_seed(1)
    n = max(lengths)
    ids = torch.full((len(lengths), n), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), n), dtype=torch.long)
    for row, length in enumerate(lengths):
        ids[row, n - length:] = torch.randint(1, _COMMON["vocab_size"], (length,), generator=gen)
        mask[row, n - length:] = 1
    return ids.to(device), mask.to(device)


# --------------------------------------------------------------------------- models

@pytest.mark.parametrize("family", sorted(MODELS))
def test_logits_match_eager_on_a_left_padded_batch(family, torch_device, flashcl_calls):
    ids, mask = _padded_batch(torch_device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        want = _build(family, "eager", torch_device)(ids, attention_mask=mask, position_ids=position_ids).logits
        assert not flashcl_calls
        got = _build(family, fcl_hf.register(), torch_device)(
            ids, attention_mask=mask, position_ids=position_ids).logits
    assert len(flashcl_calls) == _COMMON["num_hidden_layers"], flashcl_calls
    # Padded query rows see no key: eager averages over everything there, flashcl returns zeros.
    # Real rows never see a padded key, so only they are compared.
    real = mask.bool().cpu()
    err = rel_err(got.cpu()[real].numpy(), want.cpu()[real].numpy())
    assert err <= TOL, f"{family}: logits differ from eager by {err:.2e}"


@pytest.mark.parametrize("family", ["llama", "gemma2", "gpt_oss"])
def test_bfloat16_models_are_as_close_to_float32_as_eager(family, torch_device, flashcl_calls):
    """A bfloat16 model (CPU devices read bfloat16 K/V as OpenCL ushort bits) against the float32
    run of the same rounded weights: flashcl's attention, float32 inside and its output rounded
    once, must stay as close to it as transformers' own bfloat16 eager attention."""
    ids, mask = _padded_batch(torch_device)
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)
    real = mask.bool().cpu()
    logits = {}
    with torch.no_grad():
        for name, implementation, dtype in (("float32", "eager", torch.float32), ("eager", "eager", None),
                                            ("flashcl", fcl_hf.register(), None)):
            model = _build(family, implementation, torch_device).to(torch.bfloat16)
            out = model.to(dtype or torch.bfloat16)(ids, attention_mask=mask, position_ids=position_ids).logits
            logits[name] = out.float().cpu()[real].numpy()
    assert len(flashcl_calls) == _COMMON["num_hidden_layers"] and flashcl_calls[0][0] == "prefill", flashcl_calls
    eager, ours = (rel_err(logits[n], logits["float32"]) for n in ("eager", "flashcl"))
    assert ours <= 1.25 * eager + 1e-3, f"{family}: flashcl {ours:.2e} from float32, eager bfloat16 {eager:.2e}"


@pytest.mark.parametrize("family", sorted(MODELS))
def test_greedy_generation_matches_eager(family, torch_device, flashcl_calls):
    ids, mask = _padded_batch(torch_device)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                  pad_token_id=PAD)
    with torch.no_grad():
        want = _build(family, "eager", torch_device).generate(ids, **kwargs)
        got = _build(family, fcl_hf.register(), torch_device).generate(ids, **kwargs)
    assert torch.equal(got.cpu(), want.cpu()), f"{family}:\n flashcl {got.tolist()}\n eager   {want.tolist()}"
    assert len(flashcl_calls) == NEW_TOKENS * _COMMON["num_hidden_layers"]
    # every step after the prompt is a decode; a global layer's starts the padded row after its
    # padding (a sliding layer's cache holds only the window, here past the padding; Mistral's
    # layers all slide)
    steps = [kw for name, kw in flashcl_calls if name == "decode"]
    assert len(steps) == (NEW_TOKENS - 1) * _COMMON["num_hidden_layers"], flashcl_calls
    pad = max(LENGTHS) - min(LENGTHS)
    started = [kw for kw in steps if kw["key_start"] is not None]
    assert all(int(kw["key_start"][1]) >= pad for kw in started) and (started or family == "mistral"), steps


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # renamed `cache` in 5.x
@pytest.mark.parametrize("family", ["mistral", "gemma2", "gpt_oss"])
def test_chunked_prefill_through_the_cache_matches_eager(family, torch_device, flashcl_calls):
    """A second chunk of queries against a cache that holds the first (N_q < N_kv, and sliding
    layers whose cache keeps only the window)."""
    ids, mask = _padded_batch(torch_device)
    cut = max(LENGTHS) - 7
    logits = []
    with torch.no_grad():
        for implementation in ("eager", fcl_hf.register()):
            model = _build(family, implementation, torch_device)
            cache = model(ids[:, :cut], attention_mask=mask[:, :cut], use_cache=True).past_key_values
            logits.append(model(ids[:, cut:], attention_mask=mask, past_key_values=cache).logits)
    assert any(kw["mask"] is not None and kw["causal"] for name, kw in flashcl_calls)
    real = mask[:, cut:].bool().cpu()
    err = rel_err(logits[1].cpu()[real].numpy(), logits[0].cpu()[real].numpy())
    assert err <= TOL, f"{family}: second-chunk logits differ from eager by {err:.2e}"


def _values_cache(fmt: str, value_fmt: Optional[str] = None):
    """A transformers cache of the values a quantized cache of ``fmt`` (V: ``value_fmt``) holds,
    dequantized: what eager attention must see to match flashcl's attention reading it."""
    from transformers.cache_utils import Cache, DynamicLayer

    class Layer(DynamicLayer):
        def update(self, key_states, value_states, *args, **kwargs):
            k, v = (flashcl.dequantize(flashcl.quantize(x.contiguous(), f))
                    for x, f in ((key_states, fmt), (value_states, value_fmt or fmt)))
            return super().update(k, v, *args, **kwargs)

    return Cache(layer_class_to_replicate=Layer)


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # renamed `cache` in 5.x
@pytest.mark.parametrize("family, fmt, value_fmt, by_config, lengths", [
    ("llama", "q8_0", None, False, LENGTHS), ("llama", "q4_0", None, False, LENGTHS),
    ("llama", "int8", None, False, LENGTHS), ("llama", "q8_0", "q4_0", False, LENGTHS),
    ("gemma2", "q8_0", None, False, LENGTHS), ("gemma2", "q8_0", None, True, LENGTHS),
    ("gemma2", "int8", None, True, (19, 3)), ("gpt_oss", "q4_0", None, True, LENGTHS),
    ("mistral", "int8", "q8_0", True, LENGTHS)])
def test_quantized_cache_generation_matches_eager_on_its_values(family, fmt, value_fmt, by_config, lengths,
                                                                 torch_device, flashcl_calls):
    """quantized_cache(fmt) on a left-padded batch (head dim 32, ggml's block): flashcl reads the
    quantized K/V in place and matches eager attention over the same values dequantized, token for
    token and in every step's logits. The cache holds QuantizedTensors of every token (V in
    ``value_fmt`` where given), or, built from the model's config, only the window's on a sliding
    layer; a row shorter than the window starts each sliding decode past its padding (key_start
    within the window's buffer)."""
    ids, mask = _padded_batch(torch_device, lengths)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                  pad_token_id=PAD, output_logits=True, return_dict_in_generate=True)
    model = _build(family, fcl_hf.register(), torch_device, head_dim=32)
    cache = fcl_hf.quantized_cache(fmt, model.config if by_config else None, value_fmt=value_fmt)
    with torch.no_grad():
        want = _build(family, "eager", torch_device, head_dim=32).generate(
            ids, past_key_values=_values_cache(fmt, value_fmt), **kwargs)
        got = model.generate(ids, past_key_values=cache, **kwargs)
    assert torch.equal(got.sequences.cpu(), want.sequences.cpu()), f"{family} {fmt}"
    err = max(rel_err(g.cpu().numpy(), w.cpu().numpy()) for g, w in zip(got.logits, want.logits))
    assert err <= TOL, f"{family} {fmt}: logits differ from eager on the dequantized values by {err:.2e}"
    steps = [kw for name, kw in flashcl_calls if name == "decode"]
    assert len(steps) == (NEW_TOKENS - 1) * _COMMON["num_hidden_layers"], flashcl_calls
    assert all(kw["context_lens"] is not None for kw in steps)  # the buffers read in place, to their length
    tokens = max(lengths) + NEW_TOKENS - 1
    for layer in cache.layers:
        assert (layer.keys.fmt, layer.values.fmt) == (fmt, value_fmt or fmt)
        held = WINDOW - 1 if by_config and layer.is_sliding else tokens
        assert layer.keys.shape == (len(lengths), _COMMON["num_key_value_heads"], held, 32)
    if min(lengths) < WINDOW - 1:  # the sliding layers' first steps: row 1 starts after row 0, past 0
        assert any(kw["key_start"] is not None and 0 < int(kw["key_start"][0]) < int(kw["key_start"][1])
                   for kw in steps), steps
    assert by_config == any(layer.is_sliding for layer in cache.layers) or family == "llama"


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # renamed `cache` in 5.x
@pytest.mark.filterwarnings("ignore:A custom logits processor:UserWarning")
@pytest.mark.parametrize("search", ["beams", "assisted"])
def test_quantized_cache_under_beam_search_and_assisted_decoding(search, torch_device, flashcl_calls, monkeypatch):
    """Beam search (the cache's sequences reordered each step) and assisted decoding (drafted
    tokens verified, the rejected ones cropped, past the sliding layer's window) through a
    quantized cache built from Gemma 2's config: token for token as eager attention over the
    same values dequantized."""
    ids, mask = _padded_batch(torch_device)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, pad_token_id=PAD)
    if search == "beams":
        kwargs.update(attention_mask=mask, num_beams=3)
    else:  # assisted generation takes one sequence; the assistant drafts a fixed 5 tokens a step
        ids = ids[:1]
        torch.manual_seed(5)
        assistant = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 1}))
        assistant.generation_config.update(num_assistant_tokens=5, num_assistant_tokens_schedule="constant",
                                           assistant_confidence_threshold=0.0)
        kwargs.update(assistant_model=assistant.eval().to(torch_device))
    window_layer = fcl_hf._cache_classes()[2]
    calls = []  # (method, argument, whether the sliding layer was past its window)

    def spy(method):
        real = getattr(window_layer, method)

        def wrapped(self, arg):
            past = self.cumulative_length >= self.sliding_window
            calls.append((method, int(arg) if method == "crop" else None, past))
            return real(self, arg)
        monkeypatch.setattr(window_layer, method, wrapped)

    spy("crop")
    spy("reorder_cache")
    model = _build("gemma2", fcl_hf.register(), torch_device, head_dim=32)
    with torch.no_grad():
        want = _build("gemma2", "eager", torch_device, head_dim=32).generate(
            ids, past_key_values=_values_cache("q8_0"), **kwargs)
        got = model.generate(ids, past_key_values=fcl_hf.quantized_cache("q8_0", model.config), **kwargs)
    assert torch.equal(got.cpu(), want.cpu()), f"{search}:\n flashcl {got.tolist()}\n eager   {want.tolist()}"
    assert any(name == "decode" for name, _ in flashcl_calls)
    if search == "beams":
        assert any(method == "reorder_cache" and past for method, _, past in calls), calls
    else:  # drafts rejected and rolled back past the window
        assert any(method == "crop" and arg < 0 and past for method, arg, past in calls), calls


@pytest.mark.filterwarnings("ignore:`past_key_values` is deprecated:FutureWarning")  # renamed `cache` in 5.x
def test_a_quantized_prompt_cache_copied_continues_as_a_fresh_one(flashcl_calls, cpu_device, monkeypatch):
    """transformers' prompt reuse: a cache filled with a prompt, deep-copied (its views follow
    their copied buffers) and handed to generate() twice, gives a fresh generation's tokens."""
    import copy

    monkeypatch.setenv("FLASHCL_DEVICE", cpu_device)
    ids = _padded_batch("cpu")[0][:1]
    model = _build("gemma2", fcl_hf.register(), "cpu", head_dim=32)
    kwargs = dict(max_new_tokens=6, min_new_tokens=6, do_sample=False, pad_token_id=PAD)
    with torch.no_grad():
        prompt = fcl_hf.quantized_cache("q8_0", model.config)
        model(ids[:, :12], past_key_values=prompt)
        copied = copy.deepcopy(prompt)
        layer = copied.layers[1]
        assert layer.keys.buffer is layer._buffers[0]
        runs = [model.generate(ids, past_key_values=copy.deepcopy(prompt), **kwargs) for _ in range(2)]
        fresh = model.generate(ids, past_key_values=fcl_hf.quantized_cache("q8_0", model.config), **kwargs)
    assert all(torch.equal(run, fresh) for run in runs), (runs, fresh)
    assert prompt.get_seq_length() == 12  # the copies grew, not the prompt's cache


def test_quantized_cache_refuses_what_it_cannot_hold():
    """fp8_e4m3 (one scale per tensor), unknown formats and configs with layers other than
    attention are refused when the cache is made; a hybrid model's linear-attention states by
    name, not by a failure inside a QuantizedTensor."""
    for fmt in ("fp8_e4m3", "q5_1"):
        with pytest.raises(ValueError, match="quantized_cache: fmt must be one of"):
            fcl_hf.quantized_cache(fmt)
        with pytest.raises(ValueError, match="quantized_cache: value_fmt must be one of"):
            fcl_hf.quantized_cache("q8_0", value_fmt=fmt)
    if hasattr(transformers.cache_utils.Cache, "get_conv_state"):
        with pytest.raises(NotImplementedError, match="linear-attention"):
            fcl_hf.quantized_cache("int8").get_conv_state(0)
    hybrid = transformers.LlamaConfig(**_COMMON)
    hybrid.layer_types = ["linear_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="attention layers only"):
        fcl_hf.quantized_cache("int8", hybrid)


def _dequantized(states):
    return tuple(flashcl.dequantize(flashcl.quant.tokens(x, 0, x.shape[-2])) for x in states)


_CACHE_STEPS = st.lists(st.one_of(
    st.tuples(st.just("update"), st.sampled_from([1, 2, 5, 6, 7, 12, 300])),  # around the window; a long prompt
    st.tuples(st.just("crop"), st.integers(-3, 0)),
    st.tuples(st.just("record"), st.just(0)),
    st.tuples(st.just("reorder"), st.integers(0, 5)),
    st.tuples(st.just("select"), st.integers(0, 2)),
    st.tuples(st.just("repeat"), st.integers(1, 2))), min_size=1, max_size=14)


@pytest.mark.parametrize("fmt", ["q4_0", "int8"])
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=_CACHE_STEPS)
def test_quantized_cache_acts_as_transformers_own_on_its_values(fmt, steps):
    """Any run of updates (longer and shorter than the window), crops (assisted decoding's
    rollback, past the window once recording), beam reorders and batch selections or repeats
    leaves a quantized cache built from a Gemma 2 config (a sliding and a global layer) holding
    what DynamicCache(config=) holds when fed the same values dequantized: the states each update
    returns, every layer's keys and values, lengths and mask sizes, and the same errors."""
    cfg = _gemma2(head_dim=32).config
    ours, theirs = fcl_hf.quantized_cache(fmt, cfg), transformers.DynamicCache(config=cfg)
    gen, batch = torch.Generator().manual_seed(len(steps)), 3
    recorded = None  # tokens written since recording began: what a crop may take back

    def same_lengths(op, arg):
        for layer in range(2):
            assert ours.get_seq_length(layer) == theirs.get_seq_length(layer), (op, arg, layer)
            assert ours.get_mask_sizes(1, layer) == theirs.get_mask_sizes(1, layer), (op, arg, layer)

    for op, arg in steps:
        if op == "update":
            for layer in range(2):
                k, v = (torch.randn(batch, 2, arg, 32, generator=gen) for _ in range(2))
                visible = theirs.get_mask_sizes(arg, layer)[0]  # 5.17's recording layers return more
                got = _dequantized(ours.update(k, v, layer))
                want = theirs.update(*(flashcl.dequantize(flashcl.quantize(x, fmt)) for x in (k, v)), layer)
                assert all(torch.equal(g, w[:, :, -visible:]) for g, w in zip(got, want)), (op, arg, layer)
            recorded = None if recorded is None else recorded + arg
            same_lengths(op, arg)
            continue
        if not theirs.layers[0].is_initialized:
            continue  # transformers' own layers take nothing before the first update
        if op == "crop":
            if -arg >= theirs.get_seq_length() or (recorded is not None and -arg > recorded):
                continue  # transformers' own layers then lose track of their batch, or of their length
            recorded = None if recorded is None else recorded + arg
        if op == "record":
            recorded = 0
        kept = torch.arange(min(arg, batch - 1), batch)  # "select"'s sequences, as indices or (arg 2) a bool mask
        order = torch.randperm(batch, generator=torch.Generator().manual_seed(arg))  # "reorder"'s beams
        call = {"crop": lambda c: c.crop(arg), "record": lambda c: c.activate_past_recording(),
                "reorder": lambda c: c.reorder_cache(order),
                "select": lambda c: c.batch_select_indices(kept if arg < 2 else torch.isin(torch.arange(batch), kept)),
                "repeat": lambda c: c.batch_repeat_interleave(arg)}[op]
        outcomes = []
        for cache in (ours, theirs):
            try:
                call(cache)
                outcomes.append(None)
            except RuntimeError as e:
                outcomes.append(type(e))
        assert outcomes[0] == outcomes[1], (op, arg, outcomes)
        batch = {"select": batch - min(arg, batch - 1), "repeat": batch * arg}.get(op, batch)
        for mine, real in zip(ours.layers, theirs.layers):
            if real.is_initialized and real.keys.numel():
                assert all(torch.equal(g, w) for g, w in zip(_dequantized((mine.keys, mine.values)),
                                                              (real.keys, real.values))), (op, arg)
        same_lengths(op, arg)


def test_quantized_cache_resets_and_crops_to_a_length():
    """reset() leaves layers that start again as new ones (transformers 5.17 zeroed K/V in place);
    crop(n) with n > 0 keeps the first n tokens (5.17's older form), under and past the window."""
    cfg = _gemma2(head_dim=32).config
    cache, fresh = fcl_hf.quantized_cache("q8_0", cfg), fcl_hf.quantized_cache("q8_0", cfg)
    k = torch.randn(2, 2, 9, 32)
    for layer in range(2):
        cache.update(k, k, layer)
    cache.reset()
    for layer in range(2):
        got, want = cache.update(k[:, :, :3], k[:, :, :3], layer), fresh.update(k[:, :, :3], k[:, :, :3], layer)
        assert all(torch.equal(g.data, w.data) and g.shape == w.shape for g, w in zip(got, want))
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == 3
    cache.crop(2)
    assert cache.get_seq_length(0) == cache.get_seq_length(1) == 2 and cache.layers[1].keys.shape[-2] == 2
    for layer in range(2):
        cache.update(k, k, layer)
    with pytest.raises(RuntimeError, match="crop by the negative number"):
        cache.crop(4)  # the sliding layer is past its window


def test_static_cache_generation_matches_eager(torch_device, flashcl_calls):
    """A static cache passes keys for all its slots, the unwritten ones hidden by the mask only."""
    ids, mask = _padded_batch(torch_device)
    kwargs = dict(attention_mask=mask, do_sample=False, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS,
                  pad_token_id=PAD, cache_implementation="static")
    with torch.no_grad():
        want = _build("gemma2", "eager", torch_device).generate(ids, **kwargs)
        got = _build("gemma2", fcl_hf.register(), torch_device).generate(ids, **kwargs)
    assert torch.equal(got.cpu(), want.cpu()), f"flashcl {got.tolist()}\n eager   {want.tolist()}"
    steps = [kw for name, kw in flashcl_calls if name == "decode"]  # not masked one-row prefills
    assert len(steps) == (NEW_TOKENS - 1) * _COMMON["num_hidden_layers"], flashcl_calls
    cut = [kw for kw in steps if kw["context_lens"] is not None]  # the global layers' unwritten slots
    assert cut
    if torch_device == "cpu":  # on CUDA generate() compiles the steps into CUDA graphs that reuse them
        assert all(int(kw["context_lens"][0]) < max(LENGTHS) + NEW_TOKENS for kw in cut)


@pytest.mark.filterwarnings("ignore:A custom logits processor:UserWarning")
@pytest.mark.parametrize("family", ["gemma2", "gpt_oss"])
def test_assisted_generation_matches_eager(family, torch_device, flashcl_calls, monkeypatch):
    """Speculative decoding (an assistant model drafts 5 tokens a step, the model verifies them):
    the verification steps are prefills of 2 to 6 causal rows through the cache, windowed on the
    sliding layers, with softcap (Gemma 2) or sinks (gpt-oss); greedy output token for token as
    eager's. On a CPU device those steps run as a decode of the rows (QUERY_ROWS)."""
    from flashcl.opencl import prefill as cl_prefill

    routed, rows = [], []  # the few-row route's variants; each prefill's (N_q, window)
    real_route, real_prefill = cl_prefill._prefill_rows_as_decode, flashcl.api.prefill
    monkeypatch.setattr(cl_prefill, "_prefill_rows_as_decode",
                        lambda *a, **kw: routed.append(kw["variants"]) or real_route(*a, **kw))
    monkeypatch.setattr(flashcl.api, "prefill",
                        lambda q, *a, **kw: rows.append((q.shape[2], kw["window"])) or real_prefill(q, *a, **kw))
    ids = _padded_batch(torch_device)[0][:1]   # assisted generation takes one sequence
    torch.manual_seed(5)
    assistant = transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**_COMMON, "num_hidden_layers": 1}))
    assistant = assistant.eval().to(torch_device)
    # a random assistant is never confident: draft a fixed 5 tokens a step anyway
    assistant.generation_config.update(num_assistant_tokens=5, num_assistant_tokens_schedule="constant",
                                       assistant_confidence_threshold=0.0)
    kwargs = dict(do_sample=False, max_new_tokens=NEW_TOKENS + 4, min_new_tokens=NEW_TOKENS + 4, pad_token_id=PAD)
    with torch.no_grad():
        want = _build(family, "eager", torch_device).generate(ids, **kwargs)
        rows.clear()
        got = _build(family, fcl_hf.register(), torch_device).generate(ids, assistant_model=assistant, **kwargs)
    assert torch.equal(got.cpu(), want.cpu()), f"{family}:\n flashcl {got.tolist()}\n eager   {want.tolist()}"
    verified = {n for n, window in rows if window is not None and 1 < n <= 6}
    assert {2, 6} <= verified, rows  # a step that keeps one draft, and one that keeps all five
    if torch_device == "cpu":
        assert any(v is not None and v.window is not None for v in routed), routed


@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_unpadded_layers_pass_causal_and_window_not_a_mask(family, torch_device, flashcl_calls):
    """Without padding a sliding layer's mask is exactly causal + window (W - 1, 0): flashcl gets
    those (and skips tiles by them) rather than the mask; a global layer is plain causal."""
    ids = _padded_batch(torch_device)[0][:1]   # the full-length row: no padding
    with torch.no_grad():
        want = _build(family, "eager", torch_device)(ids).logits
        got = _build(family, fcl_hf.register(), torch_device)(ids).logits
    err = rel_err(got.cpu().numpy(), want.cpu().numpy())
    assert err <= TOL, f"{family}: logits differ from eager by {err:.2e}"
    asked = {(kw["causal"], kw["window"], kw["mask"] is None) for name, kw in flashcl_calls}
    expected = {(True, (WINDOW - 1, 0), True)} if family == "mistral" else {
        (True, (WINDOW - 1, 0), True), (True, None, True)}
    assert asked == expected, flashcl_calls


# --------------------------------------------------------------------------- the mask reduction

def _eager_like(visible: np.ndarray) -> "torch.Tensor":
    """An additive float mask as transformers' eager mask writes it (0 or the dtype's minimum)."""
    vis = torch.from_numpy(visible)
    return torch.where(vis, torch.zeros(()), torch.tensor(torch.finfo(torch.float32).min))


def _band(n_q, n_kv, left, right):
    p = np.arange(n_q)[:, None] + n_kv - n_q
    j = np.arange(n_kv)[None, :]
    vis = np.ones((n_q, n_kv), dtype=bool)
    if left >= 0:
        vis &= j >= p - left
    if right >= 0:
        vis &= j <= p + right
    return vis[None, None]


@pytest.mark.parametrize("n_q, n_kv", [(1, 9), (7, 7), (5, 12), (12, 12)])
@pytest.mark.parametrize("left, right", [(-1, 0), (0, 0), (3, 0), (-1, -1), (2, 3), (-1, 2), (4, -1)])
def test_a_band_reduces_to_causal_and_window_exactly(n_q, n_kv, left, right):
    band = _band(n_q, n_kv, left, right)
    for mask in (torch.from_numpy(band), _eager_like(band)):
        plan = fcl_hf.plan_for_mask(mask, n_q, n_kv)
        assert plan.mask is None, (left, right, plan)
        shown = _band(n_q, n_kv, *(plan.window or (-1, -1)))
        if plan.causal:
            shown = shown & _band(n_q, n_kv, -1, 0)
        np.testing.assert_array_equal(shown, band)


def test_padding_keeps_the_mask_and_the_band_still_holds_it():
    n = 10
    band = np.repeat(_band(n, n, 3, 0), 2, axis=0)
    band[1, :, :, :4] = False            # the second sequence is left-padded by 4
    plan = fcl_hf.plan_for_mask(torch.from_numpy(band), n, n)
    assert plan.causal and plan.window == (3, 0)
    np.testing.assert_array_equal(plan.mask.numpy(), band)


def test_a_static_cache_mask_leaves_out_the_keys_no_row_sees():
    """A mask over more slots than the keys passed is cut to them (as eager does), and keys that
    no row sees from some point on (a static cache's unwritten slots) are left out of the plan:
    the written keys' causal pattern remains, and a decode step needs no mask; a key hidden
    before the last seen one keeps the mask."""
    vis = np.zeros((1, 1, 4, 16), dtype=bool)
    vis[0, 0, :, :4] = np.tril(np.ones((4, 4), dtype=bool))   # 4 tokens in a 16-slot cache
    plan = fcl_hf.plan_for_mask(torch.from_numpy(vis), 4, 8)
    assert plan == fcl_hf.Plan(causal=True, window=None, mask=None, keys=4)
    step = np.zeros((2, 1, 1, 16), dtype=bool)
    step[0, 0, 0, :6], step[1, 0, 0, 2:6] = True, True       # the next token; row 1 left-padded
    plan = fcl_hf.plan_for_mask(torch.from_numpy(step), 1, 10)
    assert plan.keys == 6 and plan.mask is None and plan.key_start.tolist() == [0, 2]
    vis[0, 0, :, 1] = False
    plan = fcl_hf.plan_for_mask(torch.from_numpy(vis), 4, 8)
    assert plan.keys == 4 and plan.causal
    np.testing.assert_array_equal(plan.mask.numpy()[0, 0], vis[0, 0, :, :4])


def test_masks_the_plan_cannot_read_are_named():
    """An integer 4-D mask (eager would add its 0/1 values) and a mask narrower than the layer's
    keys (MiniMax builds a padded batch's mask from a linear-attention layer's empty cache)."""
    with pytest.raises(TypeError, match="attention_mask: expected bool .* got torch.int64"):
        fcl_hf.plan_for_mask(torch.ones((1, 1, 2, 4), dtype=torch.int64), 2, 4)
    with pytest.raises(ValueError, match="covers 1 keys, the layer attends 10"):
        fcl_hf.plan_for_mask(torch.ones((2, 1, 1, 1), dtype=torch.bool), 1, 10)


def test_a_float_bias_is_kept_additive_and_hidden_keys_become_minus_inf():
    vis = _band(4, 6, -1, 0)
    bias = torch.where(torch.from_numpy(vis), torch.full((), 0.25), torch.tensor(torch.finfo(torch.float32).min))
    plan = fcl_hf.plan_for_mask(bias, 4, 6)
    assert plan.causal and plan.mask.dtype == torch.float32
    assert torch.isneginf(plan.mask[~torch.from_numpy(vis)]).all()
    assert (plan.mask[torch.from_numpy(vis)] == 0.25).all()


@pytest.mark.parametrize("additive", [False, True])
def test_a_left_padded_decode_row_becomes_each_sequences_first_key(additive):
    """One query row per sequence whose mask shows a suffix of the keys (left padding, under a
    window or not; all hidden: the row's first key is N_kv) needs no mask: its first keys do."""
    n = 12
    pads = [0, 4, 11, n]
    for left in (-1, 3):
        vis = np.repeat(_band(1, n, left, 0), len(pads), axis=0)
        for row, pad in enumerate(pads):
            vis[row, :, :, :pad] = False
        plan = fcl_hf.plan_for_mask(_eager_like(vis) if additive else torch.from_numpy(vis), 1, n)
        assert plan.mask is None and plan.key_start.dtype == torch.int32, plan
        first = [max(pad, n - 1 - left) if left >= 0 else pad for pad in pads]
        assert plan.key_start.tolist() == [min(f, n) for f in first]
        assert plan.window == ((left, 0) if left >= 0 else None)


def test_a_decode_row_with_a_hole_or_per_head_starts_keeps_the_mask():
    n = 12
    hole = np.ones((2, 1, 1, n), dtype=bool)
    hole[1, :, :, 5] = False
    heads = np.ones((1, 2, 1, n), dtype=bool)
    heads[0, 1, :, :3] = False
    for vis in (hole, heads):
        plan = fcl_hf.plan_for_mask(torch.from_numpy(vis), 1, n)
        assert plan.key_start is None
        np.testing.assert_array_equal(plan.mask.numpy(), vis)


def test_a_mask_that_hides_everything_is_passed_on():
    plan = fcl_hf.plan_for_mask(torch.zeros((1, 1, 3, 5), dtype=torch.bool), 3, 5)
    assert plan.mask is not None and not plan.mask.any()


# --------------------------------------------------------------------------- refusals

class _Module(torch.nn.Module):
    is_causal = True


def _qkv(requires_grad=False):
    q, k, v = (torch.randn(1, 2, 4, 16, requires_grad=requires_grad) for _ in range(3))
    return q, k, v


@pytest.mark.parametrize("kwargs, match", [
    ({"dropout": 0.1}, "dropout"),
    ({"position_bias": torch.zeros(1, 2, 4, 4)}, "position_bias"),
    ({"cu_seq_lens_q": torch.tensor([0, 4])}, "cu_seq_lens_q"),
    ({"output_attentions": True}, "attention weights"),
    ({"indices": torch.zeros(1, 4, 2, dtype=torch.long)}, "indices"),  # sparse attention's top-k keys
    ({"block_indices": torch.zeros(1, 4, 1, dtype=torch.long)}, "block_indices"),
    ({"sinks": torch.zeros(1, 2, 4, 1)}, "sinks"),  # Inkling2's per-token sinks
])
def test_unsupported_calls_raise_before_any_kernel(kwargs, match, flashcl_calls):
    with torch.no_grad(), pytest.raises(ValueError, match=match):
        fcl_hf.attention_forward(_Module(), *_qkv(), None, **kwargs)
    assert not flashcl_calls


def test_gradients_are_refused(flashcl_calls):
    with pytest.raises(ValueError, match="no_grad"):
        fcl_hf.attention_forward(_Module(), *_qkv(requires_grad=True), None)
    sinks = torch.zeros(2, requires_grad=True)  # gpt-oss's learned sinks
    with pytest.raises(ValueError, match="no_grad"):
        fcl_hf.attention_forward(_Module(), *_qkv(), None, s_aux=sinks)
    bias = torch.zeros(1, 1, 4, 4, requires_grad=True)  # a learned additive mask
    with pytest.raises(ValueError, match="no_grad"):
        fcl_hf.attention_forward(_Module(), *_qkv(), bias)
    assert not flashcl_calls


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_mask_edited_in_place_is_read_again(mode, flashcl_calls):
    """A preallocated mask buffer reused with new contents (tree or speculative decoding) gets a
    new plan, inference tensors (no version counter) included."""
    q, k, v = _qkv()
    with getattr(torch, mode)():
        mask = torch.tril(torch.ones(1, 1, 4, 4, dtype=torch.bool))
        fcl_hf.attention_forward(_Module(), q, k, v, mask)
        assert flashcl_calls[-1][1]["mask"] is None  # a plain causal plan
        mask[..., 2:, 0] = False
        out, _ = fcl_hf.attention_forward(_Module(), q, k, v, mask)
    assert flashcl_calls[-1][1]["mask"] is not None
    s = (q @ k.transpose(-1, -2)) / 4.0
    ref = torch.softmax(s.masked_fill(~mask, float("-inf")), -1) @ v
    assert rel_err(out.transpose(1, 2).numpy(), ref.numpy()) < 1e-5


def test_registration_names_flashcl_for_both_interfaces():
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    name = fcl_hf.register()
    assert "flash" not in name   # transformers would route it to its flash-attention loader
    assert AttentionInterface()[name] is fcl_hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS[name] is ALL_MASK_ATTENTION_FUNCTIONS["sdpa"]


def test_check_names_models_that_would_not_run_flashcl():
    """Every model family above runs through the attention interface, and so does StableLM, whose
    class lacks the _supports_attention_backend flag; a model with its own attention code (Bloom)
    is named by check(), since transformers accepts the name for it too."""
    for build in MODELS.values():
        fcl_hf.check(build())
    fcl_hf.check(transformers.StableLmForCausalLM(transformers.StableLmConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2)))
    bloom = transformers.BloomForCausalLM(transformers.BloomConfig(vocab_size=128, hidden_size=32, n_head=2, n_layer=1))
    with pytest.raises(ValueError, match="BloomForCausalLM computes attention with its own code"):
        fcl_hf.check(bloom)
