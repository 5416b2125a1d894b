"""Whether this process can use CUDA, without importing torch where it plainly cannot.

Both sides of a transfer ask it: the sender (`reference_impl.worker.TrainerWorker.connect_engine`) and the
process that launches the engine server (the vLLM adapter's `server`, run in an engine actor), so they pick the
same backend; the actor would otherwise import torch only for this, about 3 s of CPU and 0.5 GB. CUDA needs the
NVIDIA driver's device nodes (`/dev/nvidiactl`, `/dev/nvidia<N>`; under WSL 2, `/dev/dxg`): where none exists
the answer is False without torch; elsewhere torch is asked, so both sides agree on every host."""

from __future__ import annotations

import glob
import os

DEVICE_NODES = ("/dev/nvidiactl", "/dev/dxg")


def cuda_available() -> bool:
    """`torch.cuda.is_available()`, short-cut to False (torch not imported) on a host with no NVIDIA device
    node (`DEVICE_NODES`, `/dev/nvidia[0-9]*`)."""
    if not any(os.path.exists(p) for p in DEVICE_NODES) and not glob.glob("/dev/nvidia[0-9]*"):
        return False
    import torch

    return torch.cuda.is_available()
