"""The ``tcp`` transport: chunks streamed to any peer, on a data channel beside the ZMQ link.

=============  =====================================================================
module         concept
=============  =====================================================================
``stream``     the sender: chunks as frames (digests ahead or trailing), a send window
``channel``    ``DataChannel``: the data listener, connections both ways, fallbacks
``data_out``   ``DataOut``: our end of a connection (resolve, connect, queue, write)
``data_in``    ``DataIn``: the receiving end (``recv_into`` the destination blocks)
``frames``     the 48-byte frame header, PREFACE / MESSAGE / DATA, trailers
=============  =====================================================================

::

    Sender ─> stream.pump_stream ─> Outbox ─┬─> channel.DataChannel ─> data_out.DataOut ─> socket
                                            └─> ZMQ link (no data channel: zero-copy frames)
    socket ─> data_in.DataIn ─> Receiver (verify, commit) ─> ACK over the ZMQ link

Without a data channel (``data_channel=False``, no advertised address, or one that cannot be
connected) the same chunks go as ZMQ frames on the link. It reaches every peer, so it is
always available: the last resort of every transport order.
"""

from __future__ import annotations

from transfer.messages import RegionInfo
from transfer.region import KVRegion
from transfer.session import Session

NAME = "tcp"
SAME_HOST = False


def available(session: Session, src: KVRegion, desc: RegionInfo) -> bool:
    """Always: any authenticated peer can be streamed to."""
    return True
