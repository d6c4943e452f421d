"""flashcl: exact flash-attention kernels for mobile/desktop GPUs (OpenCL) and CUDA (Triton).

    out = flashcl.prefill(q, k, v, causal=True)
    out = flashcl.decode(q, k_cache, v_cache, block_table=bt, context_lens=lens)

See README.md and docs/design.md for shapes and semantics. Nothing here touches a device at import.
"""

from ._version import __version__
from . import reference
from .api import decode, merge_states, prefill
from .errors import FlashCLError, KernelBuildError, KernelLaunchError, TuningDatabaseError
from .quant import QuantizedTensor, dequantize, quantize, quantize_into

__all__ = ["prefill", "decode", "merge_states", "reference", "FlashCLError", "KernelBuildError",
           "KernelLaunchError", "TuningDatabaseError", "quantize", "dequantize", "quantize_into", "QuantizedTensor",
           "__version__"]
