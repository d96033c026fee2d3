"""Accelerator table for the planner: memory, peak FLOP/s, link bandwidths, GPUs per node.

Peak FLOP/s come from `pretrain.metrics.DEVICE_PEAK_TFLOPS`, the table the training loop
uses for MFU, so a planned MFU and a measured MFU are relative to the same peak.
Bandwidths are per GPU and per direction, from NVIDIA's datasheets:
  NVLink 4 (H100/H200 SXM): 900 GB/s bidirectional -> 450 GB/s each way.
  InfiniBand NDR, one 400 Gb/s NIC per GPU (DGX/HGX H100): 50 GB/s each way.
  H100 PCIe: no NVLink switch; PCIe Gen5 x16 is 64 GB/s each way.
Host side (optimizer CPU offload), per GPU of a DGX-class node (DGX H100/H200 datasheets):
  PCIe Gen5 x16 to the host, 64 GB/s each way; 2 TB of system memory for 8 GPUs (256 GB
  each); two Xeon 8480C sockets of 8 DDR5-4800 channels, 614 GB/s for 8 GPUs (77 each).
Memory is what `torch.cuda.get_device_properties().total_memory` reports (nvidia-smi's
81559 MiB for "80 GB" parts, 143771 MiB for H200), not the marketing figure.

Blackwell (B200 in DGX/HGX B200, GB200 in GB200 NVL72): vendor specs, none measured by us;
each number's source is written beside it below. Compute capability 10.0: MXFP8 runs there
(models.precision). A GB200 NVL72 rack is one NVLink domain of 72 GPUs built from compute
trays of 4 GPUs (what Slurm calls a node): `gpus_per_node=4`, `nvlink_gpus=72`.
"""

from __future__ import annotations

import dataclasses

from typing import Optional

from models.precision import FP8_RECIPES
from models.suggest import did_you_mean
from pretrain.metrics import DEVICE_PEAK_TFLOPS

GIB = 2**30


@dataclasses.dataclass(frozen=True, kw_only=True)
class Device:
    name: str
    memory_gib: float
    # Dense (no sparsity) peak TFLOP/s per dtype: bf16, fp16, fp8, fp32.
    peak_tflops: dict[str, float]
    intra_node_gbps: float  # GB/s per GPU per direction (NVLink, or PCIe without it)
    inter_node_gbps: float  # GB/s per GPU per direction (InfiniBand)
    # HBM bandwidth, GB/s (datasheets: H100 SXM 3.35 TB/s, H100 PCIe 2.0, H200 4.8): the
    # element-wise kernels are bound by it.
    hbm_gbps: float = 3350.0
    gpus_per_node: int = 8
    # GPUs one NVLink domain joins (NVLink bandwidth for groups inside it); None = a node.
    nvlink_domain: Optional[int] = None
    # CUDA compute capability: which FP8 recipes the device runs (models.precision.FP8_RECIPES).
    capability: Optional[tuple[int, int]] = (9, 0)
    pcie_gbps: float = 64.0  # GB/s per GPU per direction to the host (PCIe Gen5 x16)
    host_memory_gib: float = 2000 * 1e9 / GIB / 8  # host memory per GPU
    host_memory_gbps: float = 614.0 / 8  # host DRAM bandwidth per GPU (CPU optimizer step)

    @property
    def nvlink_gpus(self) -> int:
        return self.nvlink_domain or self.gpus_per_node

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * GIB

    @property
    def host_memory_bytes(self) -> float:
        return self.host_memory_gib * GIB

    def fp8_problem(self, recipe: Optional[str]) -> Optional[str]:
        """Why this device cannot run the FP8 recipe (None if it can or there is no FP8): the
        compute-capability rule the training checks at start-up (models.precision), e.g. MXFP8
        needs Blackwell."""
        if recipe is None:
            return None
        needs = FP8_RECIPES[recipe]
        cc = self.capability
        if cc is None or cc < needs.min_capability or (needs.below_capability and cc >= needs.below_capability):
            have = "no GPU" if cc is None else f"compute capability {cc[0]}.{cc[1]}"
            return (f"{needs.title} (runtime.fp8_recipe={recipe}) needs compute capability "
                    f"{needs.min_capability[0]}.{needs.min_capability[1]} or newer; {self.name} has {have}")
        return None

    def peak(self, dtype: str, fp8: bool = False) -> float:
        """Peak FLOP/s (not TFLOP/s) for the math dtype."""
        return self.peak_tflops["fp8" if fp8 else dtype] * 1e12


DEVICES: dict[str, Device] = {
    "h100-80gb": Device(name="h100-80gb", memory_gib=81559 / 1024, peak_tflops=DEVICE_PEAK_TFLOPS["h100-sxm"],
                        intra_node_gbps=450.0, inter_node_gbps=50.0),
    "h100-pcie": Device(name="h100-pcie", memory_gib=81559 / 1024, peak_tflops=DEVICE_PEAK_TFLOPS["h100-pcie"],
                        intra_node_gbps=64.0, inter_node_gbps=50.0, hbm_gbps=2000.0),
    "h200-141gb": Device(name="h200-141gb", memory_gib=143771 / 1024, peak_tflops=DEVICE_PEAK_TFLOPS["h200"],
                         intra_node_gbps=450.0, inter_node_gbps=50.0, hbm_gbps=4800.0),
    # DGX/HGX B200. Peaks: pretrain.metrics (NVIDIA's table, dense). Memory: 179 GB per GPU as
    # nvidia-smi reads it on an HGX B200 (third-party reading: Vultr's HGX B200 hardware
    # overview, docs.vultr.com; datasheet 180 GB). NVLink 5: 1.8 TB/s bidirectional per GPU ->
    # 900 GB/s each way (NVIDIA's table; docs.nvidia.com DGX GB200 user guide). InfiniBand: one
    # 400 Gb/s ConnectX-7 per GPU (docs.nvidia.com DGX BasePOD reference architecture, "8x
    # single-port ConnectX-7 VPI, up to 400Gb/s"). HBM3e 7.7 TB/s (NVIDIA's table). Host side:
    # the DGX H100 defaults above, not sourced for B200.
    "b200-180gb": Device(name="b200-180gb", memory_gib=179.0, peak_tflops=DEVICE_PEAK_TFLOPS["b200"],
                         intra_node_gbps=900.0, inter_node_gbps=50.0, hbm_gbps=7700.0, capability=(10, 0)),
    # GB200 NVL72. Peaks: pretrain.metrics (NVIDIA's table, dense, 1,200 W). Memory: 186 GB
    # HBM3e (NVIDIA's table), taken as 185 GiB visible by B200's ratio of reading to datasheet
    # (179 / 180): an estimate, no reading. HBM3e 8 TB/s, NVLink 5 900 GB/s each way over all
    # 72 GPUs of the rack (NVIDIA's table). InfiniBand between racks: one 400 Gb/s NIC per GPU
    # assumed, as DGX B200 (some racks ship 800 Gb/s ConnectX-8: raise inter_node_gbps).
    # Host: Grace over NVLink-C2C, 900 GB/s bidirectional per superchip of 2 GPUs (deploybase.ai's
    # GB200 NVL72 page) -> 225 GB/s each way per GPU; host memory and bandwidth: the defaults.
    "gb200-186gb": Device(name="gb200-186gb", memory_gib=186 * 179 / 180, peak_tflops=DEVICE_PEAK_TFLOPS["gb200"],
                          intra_node_gbps=900.0, inter_node_gbps=50.0, hbm_gbps=8000.0, capability=(10, 0),
                          gpus_per_node=4, nvlink_domain=72, pcie_gbps=225.0),
    # A CPU (runs through gloo): nominal numbers, not a datasheet. They only set the scale that
    # --calibrate fits efficiencies against; plan CPU runs after calibrating on one.
    "cpu": Device(name="cpu", memory_gib=16.0, peak_tflops={"bf16": 0.2, "fp16": 0.2, "fp8": 0.2, "fp32": 0.2},
                  intra_node_gbps=10.0, inter_node_gbps=1.0, hbm_gbps=20.0, capability=None),
}
ALIASES = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "h200": "h200-141gb", "b200": "b200-180gb",
           "gb200": "gb200-186gb"}


class UnknownDeviceError(ValueError):
    pass


def get_device(name: str) -> Device:
    """The device called `name` (or an alias); unknown names list the known ones."""
    key = ALIASES.get(name.lower(), name.lower())
    if key in DEVICES:
        return DEVICES[key]
    names = sorted([*DEVICES, *ALIASES])
    raise UnknownDeviceError(
        f"unknown GPU type {name!r}.{did_you_mean(name.lower(), names, sentence=True)} Known: {', '.join(sorted(DEVICES))} "
        f"(aliases: {', '.join(f'{a}={t}' for a, t in ALIASES.items())})"
    )
