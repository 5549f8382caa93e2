"""The ZeroMQ request side of the KV transport, without torch: a decode engine's pulls and releases, and the
router's releases (router/disaggregation.py, the one engine module the router imports), go through it."""

from __future__ import annotations

import json
import logging

import zmq
from specfleet.engine.kv_transfer.base import KVTransferError, KVTransferParams

log = logging.getLogger("specfleet.engine.kv_transfer")

__all__ = ["KVTransferError", "KVTransferParams", "release_hold"]


def _request(params: KVTransferParams, message: dict, timeout_s: float) -> list[bytes]:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, int(timeout_s * 1000))
    sock.setsockopt(zmq.SNDTIMEO, int(timeout_s * 1000))
    try:
        sock.connect(f"tcp://{params.remote_host}:{params.remote_port}")
        sock.send(json.dumps(message).encode())
        return sock.recv_multipart()
    except zmq.Again as exc:
        raise KVTransferError(
            f"prefill engine at {params.remote_host}:{params.remote_port} did not answer within {timeout_s}s"
        ) from exc
    except zmq.ZMQError as exc:  # an address that does not resolve, a context being torn down
        raise KVTransferError(f"prefill engine at {params.remote_host}:{params.remote_port}: {exc}") from exc
    finally:
        sock.close(linger=0)


def release_hold(params: KVTransferParams, timeout_s: float = 1.0) -> None:
    """Tell the prefill engine to drop a hold (best effort: its timeout covers a lost message)."""
    try:
        _request(params, {"transfer_id": params.transfer_id, "release": True}, timeout_s)
    except KVTransferError as exc:
        log.warning("event=kv_release_failed transfer_id=%s error=%s", params.transfer_id, exc)
