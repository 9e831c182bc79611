"""Errors a user can act on.

Every error mlxinfer raises for bad input is a :class:`MlxInferError` whose
message is one line naming the file, key or field, and the expected and found
values. The CLI prints it as ``error: <message>`` and exits non-zero.
"""


class MlxInferError(Exception):
    """Base class: a one-line, user-facing message."""


class ConfigError(MlxInferError):
    """config.json is missing, unreadable, or lacks / mistypes a key."""


class WeightsError(MlxInferError):
    """Weight files are missing, truncated, unsafe (pickle) or mis-shaped."""


class TokenizerError(MlxInferError):
    """No usable tokenizer files, or a chat template that fails to render."""


class TokenIdError(MlxInferError, ValueError):
    """A token id (in a prompt given as ids, or one a tokenizer adds) that is not a row of the
    model's embedding: an int in 0..rows-1."""


class PromptTooLongError(MlxInferError):
    """The prompt does not fit in the model's context."""


class DraftError(MlxInferError):
    """A speculative-decoding draft that cannot serve this target: another
    vocabulary, too many layers, or a KV cache that cannot be rewound."""


class ConstraintError(MlxInferError, ValueError):
    """A structured-output constraint (JSON Schema, regex, choices, grammar) that is invalid
    or that the grammar library does not support; raised before any token is generated."""


class InsufficientMemoryError(WeightsError):
    """A model whose weights and KV budget exceed the memory the machine can give (loading/memory.py);
    a WeightsError, as the working-set refusal it replaces was."""


class DistributedError(MlxInferError):
    """A distributed run that cannot go on: a bad hostfile or environment, a rank that died,
    stalled past the rank timeout, or fed other tokens than rank 0 (mlxinfer/distributed)."""


class QualityError(MlxInferError, ValueError):
    """A perplexity comparison that cannot be made: models with different vocabularies, or a
    text too short for one chunk (mlxinfer/quality)."""


class MediaError(MlxInferError, ValueError):
    """An image that cannot be used: not a file, bad base64 or data URL, a format outside the
    allow-list, over the byte or pixel caps (a decompression bomb), undecodable, a remote URL not
    allowed, or prompts whose image markers do not match the images given (mlxinfer/vision)."""


class MediaLimitError(MediaError):
    """An image over one of the caps it must fit (``vision.MediaLimits``): ``limit`` names
    which, ``"max_bytes"`` (its encoded size) or ``"max_pixels"`` (its declared size)."""

    def __init__(self, message: str, limit: str):
        super().__init__(message)
        self.limit = limit
