"""Offline converters: a source checkpoint -> a .tlm file (docs/format.md).

``convert(src, dst, **opts)`` picks the converter from the source's suffix:

- ``.gguf``: :func:`tinyloop.convert.gguf.convert_gguf` (llama architecture).
- ``.safetensors`` (or a folder holding an HF Llama checkpoint): not implemented yet. This is
  the open seam for it: a future ``tinyloop/convert/safetensors.py`` would provide
  ``convert_safetensors(src, dst, **opts) -> ModelConfig`` with the same options as
  ``convert_gguf``, reading ``config.json`` for the dims and ``tokenizer.json`` as is. One
  difference to mind: HF Llama checkpoints store Q/K rows in "rotate-half" (NeoX) order, so that
  converter must permute Q and K rows to the interleaved-pair order of TinyLoop's RoPE (the
  inverse of llama.cpp's ``convert_hf_to_gguf.py`` ``permute``), which GGUF files already have.

Every converter returns the ModelConfig it wrote and raises ConversionError on bad input.
"""

from __future__ import annotations

import os

from ..config import ModelConfig
from ..errors import ConversionError


def convert(src, dst, **opts) -> ModelConfig:
    """Convert ``src`` into the .tlm file ``dst``, dispatching on the source's suffix.

    ``opts`` go to the converter (see :func:`tinyloop.convert.gguf.convert_gguf`).
    Raises ConversionError for an unknown or not-yet-supported source.
    """
    path = os.fspath(src)
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".gguf":
        from .gguf import convert_gguf
        return convert_gguf(path, dst, **opts)
    if suffix == ".safetensors" or (os.path.isdir(path) and any(
            f.endswith(".safetensors") for f in os.listdir(path))):
        raise ConversionError("safetensors conversion is not implemented yet (planned: HF "
                              "Llama checkpoints, see tinyloop/convert/__init__.py); convert "
                              "the checkpoint to GGUF with llama.cpp's convert_hf_to_gguf.py "
                              f"and pass the .gguf file instead: {path}")
    raise ConversionError(f"do not know how to convert {path!r}: expected a .gguf file")


__all__ = ["convert"]
