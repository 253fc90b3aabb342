"""moetext: a JAX framework for training Mixture-of-Experts decoder LLMs."""

import os as _os


def _quiet_cpu_defaults() -> None:
    # With libtpu installed (for ahead-of-time TPU compiles), importing jax on a machine with no
    # TPU probes for one and prints start-up noise. Default to the CPU platform there; AOT
    # compiles still reach the TPU compiler through jax.experimental.topologies.
    has_tpu = any(_os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))
    if not has_tpu:
        _os.environ.setdefault("JAX_PLATFORMS", "cpu")
        _os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        _os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
        _os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
        # Several CPU processes (tests, AOT scripts) may load libtpu for compiles at once.
        _os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


_quiet_cpu_defaults()
__version__ = "0.1.0"
