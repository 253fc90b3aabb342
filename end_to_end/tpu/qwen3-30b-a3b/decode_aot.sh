#!/usr/bin/env bash
# Ahead-of-time compile of the Qwen3-30B-A3B decode step that decode.sh runs (one new token per
# row against a 4096-slot KV cache, bf16 params, prefused experts, fsdp) for v5e:2x4 and v6e:2x2,
# at batch 8. No TPU needed (libtpu topologies). Prints one JSON line per topology: memory per
# chip against HBM ("fits"), XLA's FLOPs and bytes accessed, lower and compile times. Measured:
#   v5e:2x4  7.54 GiB of 16 GiB (7.48 arguments + 0.05 temporaries + 0.38 outputs - 0.38 alias)
#   v6e:2x2  15.01 GiB of 32 GiB
# (batch 8 is 64 (token, expert) rows <= 128 experts: the gathered loop, which reads only the
# routed experts' slabs; docs/performance.md "Decoding")
# The alias is the donated KV cache (48 layers x k, v x [8, 4096, 4, 128] bf16 / chips).
# tests/generate/test_decode_aot.py asserts the same in CI. Other topologies: pass
# --aot v5p:2x2x1 (extra arguments go to scripts/bench_decode.py; --aot_batch, --aot_cache).
set -euo pipefail
cd "$(dirname "$0")/../../.."
exec .venv/bin/python scripts/bench_decode.py --aot v5e:2x4,v6e:2x2 --shapes "" "$@"
