"""GPU transports: pinned staging buffers and CUDA-aware detection."""
