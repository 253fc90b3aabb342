"""moetext: a JAX framework for training Mixture-of-Experts decoder LLMs."""

import os as _os


def _quiet_libtpu_off_tpu() -> None:
    # libtpu is installed for ahead-of-time TPU compiles. On a machine with no TPU, JAX's
    # platform detection still tries its TPU backend, and libtpu then queries the GCE metadata
    # server and prints start-up warnings before giving up. These defaults only answer libtpu's
    # questions so it fails fast and quietly; they never choose the platform: JAX_PLATFORMS is
    # left to the user, so a GPU jaxlib (or a TPU) is used when present, else the CPU.
    has_tpu = any(_os.path.exists(p) for p in ("/dev/accel0", "/dev/vfio/0"))
    if has_tpu:
        return
    _os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    _os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    _os.environ.setdefault("TPU_ACCELERATOR_TYPE", "v5p-8")
    # Several processes (tests, AOT scripts) may load libtpu for compiles at once.
    _os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


_quiet_libtpu_off_tpu()
__version__ = "0.1.0"
