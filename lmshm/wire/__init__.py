"""lmshm's wire: the messages its peers exchange, and how they become bytes.

- ``protocol``: the spec -- every request and reply, its stable code (``MsgType``), its fields
  and their limits, the error codes (``ErrorCode``), the protocol version;
- ``codec``: msgpack via msgspec, wrappers under ext code 1 and the allow-list that decodes them;
- ``vllm_events``: vLLM's KV-event format, which the KV event stream and ``KV_EVENTS`` carry.

It sits below the core (the core takes and returns these structs as they are) and imports
nothing of lmshm but ``platform``'s wrapper module, lazily, when a wrapper crosses the wire.
"""
