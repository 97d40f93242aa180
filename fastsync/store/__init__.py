"""The control store: fastsync's own small key/value server (``kv``: handshake on the job
secret, AES-GCM frames, checked chunked values) and a ``torch.distributed.Store`` over its
connection (``torch_store``, for gloo rendezvous). :class:`fastsync.control.TCPStoreControl` is
the interface the rest of fastsync uses."""
