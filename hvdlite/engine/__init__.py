"""The background engine, the one thread that talks to the transport (``engine``), and
what it runs: the executor, which packs tensors into fusion buffers and hands them to the
chain of backends, the handles user threads wait on, and how the engine stops."""
