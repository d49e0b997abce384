"""One gradient reducer for every framework (torch, TensorFlow, Keras on either backend).

- ``settings``: what an averager asks for (op, scale factors, compression, passes,
  groups, process set), refused alike for every framework;
- ``layout``: which gradients share a bucket, DDP's way, from the parameter list;
- ``bucket``: one flat buffer, the gradients viewing it, its pieces;
- ``buckets``: the ``Reducer``: flat buffers and views through the framework's tensor
  adapter, on the gradients' device, agreed across ranks in one exchange, pass
  counting, the buckets on a lane (or one prepared request per bucket), and the errors;
- ``lists``: the call ``averager(gradients, variables) -> gradients`` of the
  frameworks that hand every gradient over at once (TensorFlow, Keras).

A binding supplies only its hooks (torch) or its list call; the engine's fusion
stays for one-off collectives. Imports point down: bindings -> reducer -> api.
"""
