"""The bottom layer: MPI lifecycle, errors, config, dtypes, devices, tensors, write protection, pools."""
