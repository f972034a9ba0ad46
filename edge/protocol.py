"""The edge session protocol, under the edge package's name: it lives in
`hetero_pd.serving.edge_protocol`, which the router serves."""

from hetero_pd.serving.edge_protocol import (
    MAX_MESSAGE_BYTES,
    MODES,
    PATH,
    VERSION,
    ProtocolError,
    pack,
    unpack,
)

__all__ = ["MAX_MESSAGE_BYTES", "MODES", "PATH", "VERSION", "ProtocolError", "pack", "unpack"]
