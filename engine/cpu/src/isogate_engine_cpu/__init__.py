"""CPU-ONLY development shims that let real SGLang 0.5.23 run PD on a machine without a GPU.

Nothing here is production code: the production plugin lives in `engine_patch/`. This
distribution (isogate-engine-cpu) is installed only by scripts/install-engine.
"""
