"""Offline converters: a source checkpoint -> a .tlm file (docs/format.md).

``convert(src, dst, **opts)`` picks the converter from the source's suffix:

- ``.gguf``: :func:`tinyloop.convert.gguf.convert_gguf` (llama architecture).
- a folder (Hugging Face config.json + .safetensors: Ouro, Huginn, Nanbeige):
  :func:`tinyloop.convert.hf.convert_hf` (options ``bits``, ``group_size``, ``state_seed``,
  ``max_depth``).

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
    if os.path.isdir(path):
        from .hf import convert_hf
        return convert_hf(path, dst, **opts)
    if suffix == ".safetensors":
        raise ConversionError(f"{path}: pass the folder that holds the .safetensors files and "
                              "config.json, not one file")
    raise ConversionError(f"do not know how to convert {path!r}: expected a .gguf file or a "
                          "Hugging Face folder")


__all__ = ["convert"]
