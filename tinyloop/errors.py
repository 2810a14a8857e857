"""TinyLoop's exception family.

Every error the library raises on purpose derives from :class:`TinyLoopError`, so a caller can
catch the whole family with one ``except``. Subclasses also derive from the closest builtin
(``ValueError``, ``MemoryError``, ...) so generic code keeps working.
"""

from __future__ import annotations


class TinyLoopError(Exception):
    """Base class of every error TinyLoop raises on purpose.

    ``partial``: when the error ends a generation part-way (``generate`` or ``stream``, after
    its arguments were accepted), the GenerationResult of what was generated before it
    (``token_ids`` and ``text`` so far, ``finish_reason`` "error"); otherwise None.
    """

    partial = None

    def __reduce__(self):
        # copy and pickle without calling __init__, whose keyword-only arguments (kind=, ...)
        # the default reduction does not pass: the arguments and every attribute as they are
        # (an OSError's filename lives outside args: its own reduction has it)
        args = OSError.__reduce__(self)[1] if isinstance(self, OSError) else self.args
        return _restore_error, (type(self), args, dict(self.__dict__))


_HEAPTYPE = 1 << 9          # Py_TPFLAGS_HEAPTYPE: a class defined in Python


def _restore_error(cls, args: tuple, state: dict) -> TinyLoopError:
    """A TinyLoopError of class ``cls`` with ``args`` and the attributes ``state``, made
    without its ``__init__`` (``TinyLoopError.__reduce__``), by the ``__new__`` of the
    builtin its layout comes from (``__base__`` chain: OSError for FileWriteError, Exception
    for the others; Python refuses another builtin's)."""
    base = cls
    while base.__flags__ & _HEAPTYPE:
        base = base.__base__
    e = base.__new__(cls, *args)            # sets args (an OSError's: errno, strerror, file)
    e.__dict__.update(state)
    return e


class ConfigError(TinyLoopError, ValueError):
    """A model configuration, argument or environment variable is invalid."""


# --- .tlm format -----------------------------------------------------------------------------
class FormatError(TinyLoopError, ValueError):
    """A .tlm file is malformed. The subclasses name the exact cause."""


class BadMagicError(FormatError):
    """The file does not start with the .tlm MAGIC bytes."""


class UnsupportedVersionError(FormatError):
    """The file's VERSION is newer than this reader's VERSION_MAX (or older than supported)."""


class InconsistentDimsError(FormatError):
    """The header's dims contradict each other (e.g. n_heads not a multiple of n_kv_heads)."""


class TensorBoundsError(FormatError):
    """A tensor entry points outside the file's data section."""


class TensorOverlapError(FormatError):
    """Two tensor entries share bytes."""


class TensorShapeError(FormatError):
    """A tensor's shape or dtype does not match what the dims require, or one is missing."""


class TruncatedFileError(FormatError):
    """The file ends before the header or the data it declares."""


class SizeOverflowError(FormatError):
    """A size read from the file is absurd (overflows, negative, or larger than any file)."""


class NonFiniteWeightError(FormatError):
    """A norm weight, quantization scale or zero in the file is NaN or infinite."""


# --- conversion / tokenizer ------------------------------------------------------------------
class ConversionError(TinyLoopError, ValueError):
    """A source checkpoint (GGUF, safetensors, ...) cannot be converted."""


class TokenizerError(TinyLoopError, ValueError):
    """The tokenizer data is missing or invalid, or a token id is out of range."""


# --- files ------------------------------------------------------------------------------------
class FileWriteError(TinyLoopError, OSError):
    """Writing a file failed in the operating system (disk full, file-size limit, no
    permission, the destination is a directory, ...). ``filename`` is the destination the
    caller gave (never a temporary name), ``errno`` and ``strerror`` are the OS error's, and
    ``__cause__`` is the original OSError. Nothing was written: the destination keeps its old
    content (see ``tinyloop.fileio.atomic_write``)."""


# --- runtime ---------------------------------------------------------------------------------
class BackendUnavailableError(TinyLoopError, RuntimeError):
    """The requested backend (e.g. "cuda") cannot run on this machine."""


class ModelFreedError(TinyLoopError, RuntimeError):
    """A Model was used after :func:`tinyloop.free_model`."""


class HandleError(TinyLoopError, RuntimeError):
    """An opaque handle (PrefixCache, ResumeHandle, PrefixPool) was misused."""


class QueueFullError(TinyLoopError, RuntimeError):
    """The serving engine's queue of waiting requests is full (``tinyloop.serve.Engine``:
    ``max_queue``): the request was not taken; try again later (HTTP 429)."""


class EngineStoppedError(TinyLoopError, RuntimeError):
    """A request was submitted to a serving engine that is stopped or stopping (HTTP 503)."""


class GraphCaptureError(TinyLoopError, RuntimeError):
    """A decode-step graph capture broke a rule (it allocated from the memory pool); the
    capture is discarded (tinyloop/graphs.py)."""


class NonFiniteLogitsError(TinyLoopError, FloatingPointError):
    """The logits to sample from are not usable: some are NaN or +inf, or all are -inf.

    Attributes: ``kind`` ("nan" | "+inf" | "all -inf"); ``step`` (int: 0 for the token
    sampled after the prompt, k for the (k+1)-th new token) and ``position`` (int: the
    sequence position whose next-token logits these are), both None when the sampler was
    called directly.
    """

    def __init__(self, message: str, *, kind: str, step: int | None = None,
                 position: int | None = None):
        super().__init__(message)
        self.kind = kind
        self.step = step
        self.position = position


class OutOfMemoryError(TinyLoopError, MemoryError):
    """An allocation would cross the memory budget or the device has no room.

    Attributes (all ints, bytes): ``requested_bytes`` (a batch's total), ``allocated_bytes``,
    ``reserved_bytes``, ``limit_bytes`` (None if no limit), ``device_free_bytes``,
    ``largest_free_bytes`` (the pool's largest free range), ``room_bytes`` (what the limit
    leaves for new segments, None without a limit); ``blocks`` (int: 1, or a batch's block
    count); ``tag`` (str); ``device`` (str).
    When it ends a generation: ``step`` and ``position`` as in NonFiniteLogitsError (the token
    being computed and the position it is sampled from), and ``partial`` (TinyLoopError);
    None otherwise.
    """

    def __init__(self, message: str, *, requested_bytes: int = 0, tag: str = "other",
                 allocated_bytes: int = 0, reserved_bytes: int = 0,
                 limit_bytes: int | None = None, device_free_bytes: int | None = None,
                 device: str = "host", blocks: int = 1, largest_free_bytes: int = 0,
                 room_bytes: int | None = None, step: int | None = None,
                 position: int | None = None):
        super().__init__(message)
        self.step = step
        self.position = position
        self.requested_bytes = requested_bytes
        self.tag = tag
        self.allocated_bytes = allocated_bytes
        self.reserved_bytes = reserved_bytes
        self.limit_bytes = limit_bytes
        self.device_free_bytes = device_free_bytes
        self.device = device
        self.blocks = blocks
        self.largest_free_bytes = largest_free_bytes
        self.room_bytes = room_bytes


# --- warnings --------------------------------------------------------------------------------
class ArtificialLoopWarning(UserWarning):
    """A request runs deeper than the default depth on a model whose loop is artificial (its
    recurrent block was cut from a plain transformer, never trained to loop): the text
    degrades. Given once per model (``Model.loop_is_artificial``)."""
