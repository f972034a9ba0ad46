"""The hidden-state codec (float32, float16, int8 with outliers) the device encodes with.

It lives in `hetero_pd.hidden_codec`, where the cloud's workers decode the same frames;
this module is the edge package's name for it.
"""

from hetero_pd.hidden_codec import (
    CODECS,
    DEFAULT_OUTLIERS,
    MAX_ELEMENTS,
    MAX_OUTLIERS,
    VERSION,
    CodecAccuracy,
    CodecError,
    accuracy,
    bytes_per_token,
    decode,
    encode,
    measure,
)

__all__ = [
    "CODECS",
    "DEFAULT_OUTLIERS",
    "MAX_ELEMENTS",
    "MAX_OUTLIERS",
    "VERSION",
    "CodecAccuracy",
    "CodecError",
    "accuracy",
    "bytes_per_token",
    "decode",
    "encode",
    "measure",
]
