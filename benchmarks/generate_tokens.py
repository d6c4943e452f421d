"""Greedy generation of a small random-weight Llama through flashcl's transformers integration,
against transformers' eager and SDPA attention in the same process: milliseconds per new token.

    python benchmarks/generate_tokens.py [--device cpu|cuda] [--dtype D] [--layers 8] [--prompt 256]
        [--new 32] [--padded-batch B] [--kv-format q8_0|q4_0|int8] [--window W]

cpu: torch CPU tensors, attention on flashcl's OpenCL device ($FLASHCL_DEVICE, else its
default); cuda: the Triton kernels. float32 on the CPU, float16 on CUDA unless --dtype says
otherwise (float32, float16 or bfloat16); nothing is downloaded.
Each implementation generates once to warm up, then three times; the median is printed.
``--padded-batch B``: B prompts at once, sequence i left-padded by i * prompt / (2 B) tokens (its
attention mask hides them: what batched generation of prompts of unequal lengths does).
``--kv-format FMT``: flashcl also with its quantized cache (integrations.transformers.quantized_cache,
given the model's config), and the K/V bytes each cache's memory holds at the end: transformers'
own, the quantized one, and the quantized one without the config (every layer's whole history).
``--window W``: a Qwen3 of the same sizes whose layers slide over W keys, every sixth global
(Gemma 3's pattern). Run it from two trees (PYTHONPATH) to compare them.
docs/notes/opencl-host.md and pocl-prefill.md cite it.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import time

import torch
import transformers

from flashcl.integrations import transformers as fcl_hf


def model_for(layers: int, device: str, dtype: torch.dtype, window=None) -> transformers.PreTrainedModel:
    sizes = dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                 num_hidden_layers=layers, intermediate_size=1024, vocab_size=1000, max_position_embeddings=4096)
    torch.manual_seed(0)
    if window is None:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**sizes))
    else:
        kinds = ["full_attention" if i % 6 == 5 else "sliding_attention" for i in range(layers)]
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **sizes, sliding_window=window, use_sliding_window=True, layer_types=kinds))
    return model.to(device=device, dtype=dtype).eval()


def ms_per_token(model, ids, new: int, device: str, attention_mask=None, cache=None) -> float:
    """Median ms a new token over three generations (one more first, to warm up); ``cache``: a
    function making the cache each generation starts with (None: transformers' default)."""
    def run():
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        kwargs = {} if cache is None else {"past_key_values": cache()}
        with torch.no_grad():
            model.generate(ids, attention_mask=attention_mask, max_new_tokens=new, min_new_tokens=new,
                           do_sample=False, pad_token_id=0, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t) / new

    run()
    return statistics.median(run() for _ in range(3))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                    help="the model's dtype (default: float32 on the CPU, float16 on CUDA)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    ap.add_argument("--new", type=int, default=32, help="new tokens")
    ap.add_argument("--padded-batch", type=int, default=0, help="B left-padded prompts at once (0: one prompt)")
    ap.add_argument("--kv-format", choices=fcl_hf.CACHE_FORMATS, help="also flashcl on its quantized cache")
    ap.add_argument("--window", type=int, help="a Qwen3 whose layers slide over this many keys, every sixth global")
    opt = ap.parse_args()
    dtype = getattr(torch, opt.dtype or ("float16" if opt.device == "cuda" else "float32"))
    model = model_for(opt.layers, opt.device, dtype, opt.window)
    batch = max(opt.padded_batch, 1)
    ids = torch.randint(1, 1000, (batch, opt.prompt), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for i in range(batch if opt.padded_batch else 0):
        pad = i * opt.prompt // (2 * batch)
        ids[i, :pad], mask[i, :pad] = 0, 0
    ids, mask = ids.to(opt.device), mask.to(opt.device)
    family = "Llama" if opt.window is None else f"Qwen3 of sliding windows of {opt.window} (every sixth layer global)"
    print(f"# {family}, {opt.layers} layers, 8/2 heads of 64, prompt {opt.prompt}, {opt.new} new tokens, {opt.device}, "
          f"{str(dtype).removeprefix('torch.')}"
          + (f", {batch} left-padded prompts" if opt.padded_batch else ""))
    runs = [(name, name, None) for name in (fcl_hf.register(), "sdpa", "eager")]
    if opt.kv_format:
        quantized = functools.partial(fcl_hf.quantized_cache, opt.kv_format, model.config)
        runs.insert(1, (f"{fcl_hf.NAME} {opt.kv_format}", fcl_hf.register(), quantized))
    for label, name, cache in runs:
        model.set_attn_implementation(name)
        ms = ms_per_token(model, ids, opt.new, opt.device, mask if opt.padded_batch else None, cache)
        print(f"{label:11s} {ms:8.2f} ms a token", flush=True)
    if opt.kv_format:
        with torch.no_grad():
            model.set_attn_implementation(fcl_hf.register())
            caches = (("plain", transformers.DynamicCache(config=model.config)), (opt.kv_format, quantized()),
                      (f"{opt.kv_format} without the config", fcl_hf.quantized_cache(opt.kv_format)))
            for label, cache in caches:
                model.generate(ids, attention_mask=mask, max_new_tokens=opt.new, min_new_tokens=opt.new,
                               do_sample=False, pad_token_id=0, past_key_values=cache)
                print(f"K/V cache {label}: {_cache_bytes(cache) / 1e6:.2f} MB")


def _cache_bytes(cache) -> int:
    """The bytes of memory behind a cache's K and V (each tensor's whole storage, counted once:
    a quantized cache's buffers with their room, a sliding layer's window inside its last step's)."""
    storages = {}
    for layer in cache.layers:
        for x in (layer.keys, layer.values):
            for t in (x,) if isinstance(x, torch.Tensor) else (x.data, x.scales):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


if __name__ == "__main__":
    main()
