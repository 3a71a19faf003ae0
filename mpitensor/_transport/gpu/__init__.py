"""GPU transports: each module one job.

- `streams`: the device, the caller's stream and the copy stream of one call (`GpuCall`);
- `pinned`: the pool of pinned host buffers;
- `staging`: copies between the device and pinned buffers, on the copy stream;
- `fix_up`: MEAN's division, decoding and rounding back on the device;
- `after_event`: start an operation once the GPU work it reads is done (polled);
- `cuda_aware`, `data_path`: whether MPI takes device buffers, per context and kind of call;
- `staged`: the staged all-reduce, wrapping the host transport `select` chooses;
- `device_buffers`: the CUDA-aware all-reduce of device buffers.
"""
