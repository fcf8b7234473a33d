"""The device: CUDA, the simulated GPU and its allocator model, memory counting, OOM recognition."""
