"""MoE kernels. Imports jax (and optional extras) only; never models/ or config/."""
