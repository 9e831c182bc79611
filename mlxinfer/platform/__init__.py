"""The machine under everything: the fast BLAS, the CPU's name and cache folder, threads,
the device, progress bars. Importable before MLX (``blas.preload_openblas`` must run first)."""
