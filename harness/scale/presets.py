"""Link presets for `update_time.Links`: achievable one-direction numbers, each derived from a nominal
figure named here (the derating is ours and stated; `docs/scaling.md` shows what it changes).

- NVLink: H100/H200 SXM 900 GB/s per GPU, both directions together (NVIDIA H100 Tensor Core GPU
  datasheet; H200 datasheet), so 450 GB/s one way; H800 SXM 400 GB/s (NVIDIA H800 product brief), so
  200 one way. Derated to 80 % (what NCCL's bus bandwidth reaches on such nodes).
- PCIe Gen5 x16: 64 GB/s one way nominal (PCI-SIG), about 50 GB/s pinned in practice.
- InfiniBand NDR: ConnectX-7, 400 Gb/s = 50 GB/s per NIC, one NIC per GPU, 90 % of it.
- HBM copy: a device-to-device copy reads and writes, so about 40 % of the HBM bandwidth (H100 SXM
  3.35 TB/s, H200 4.8 TB/s, datasheets).
- Host memcpy, TCP, engine call and per-tensor costs are not datasheet numbers: for CPU they are
  measured on the host (`python -m harness.scale_model measure`, the run records); for GPU hosts the
  values here are order-of-magnitude assumptions (one thread copies ~10 GB/s; a gloo stream over TCP
  ~5 GB/s; a local HTTP call ~2 ms; ~100 us of Python per tensor; ~30 us per NCCL launch).
"""

from __future__ import annotations

from harness.scale.update_time import Links

_HOST = {"memcpy": 10.0, "tcp": 5.0, "call_s": 2e-3, "tensor_s": 1e-4, "collective_s": 3e-5}

PRESETS: dict[str, Links] = {
    "h100": Links(name="h100", nvlink=0.8 * 450, pcie=50.0, ib=0.9 * 50, hbm_copy=0.4 * 3350, **_HOST),
    "h200": Links(name="h200", nvlink=0.8 * 450, pcie=50.0, ib=0.9 * 50, hbm_copy=0.4 * 4800, **_HOST),
    "h800": Links(name="h800", nvlink=0.8 * 200, pcie=50.0, ib=0.9 * 50, hbm_copy=0.4 * 3350, **_HOST),
    # Two GPUs without NVLink: peer traffic goes over PCIe through the host bridge.
    "pcie-only": Links(name="pcie-only", nvlink=25.0, pcie=25.0, ib=0.9 * 50, hbm_copy=0.4 * 2000, **_HOST),
}


def preset(name: str) -> Links:
    """The preset called `name`.

    Raises:
        KeyError: no such preset (the message lists them).
    """
    if name not in PRESETS:
        raise KeyError(f"no link preset {name!r}; presets: {', '.join(sorted(PRESETS))}")
    return PRESETS[name]
