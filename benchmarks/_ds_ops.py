"""``make bench-setup``: build DeepSpeed's CPU ops once (JIT: g++ + ninja), so no compare.py row pays the build.

DeepSpeed on a CPU-only machine (``DS_ACCELERATOR=cpu``) builds its pin_memory op on import and its
shm_comm op at init, steps ZeRO-3 with its FusedAdam (CPU build), ZeRO-Offload with DeepSpeedCPUAdam,
and swaps to NVMe through its async_io op (libaio). Each op is compiled the first time it is loaded
and cached under ``$TORCH_EXTENSIONS_DIR`` (the Makefile: the venv's); loading it here puts that
compile in the setup instead of in a benchmark row's first step.
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")


def main() -> int:
    from deepspeed.accelerator import get_accelerator

    failed = []
    for name in ("CPUAdamBuilder", "FusedAdamBuilder", "AsyncIOBuilder", "PinMemoryBuilder", "ShareMemCommBuilder"):
        builder = get_accelerator().create_op_builder(name)
        try:
            builder.load()
            print(f"deepspeed op {name}: built")
        except Exception as e:  # keep going: compare.py's row then says why
            failed.append(name)
            print(f"deepspeed op {name}: FAILED: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
