"""The GPUs `plan --gpu` knows: memory, HBM bandwidth, links and the NVLink domain, each figure with its source.

Peak FLOP/s per precision are `pretrain.observe.flops.PEAK_TFLOPS` (the trainer's MFU reads them too). The rest is here,
the one table the planner's memory verdict and step-time model read:

- memory: what torch can allocate (GiB); the fit verdict keeps a reserve of it free (`common.fit_limit_gib`);
- HBM bandwidth (TB/s): the roofline of memory-bound kernels;
- NVLink (GB/s per GPU, one direction) and the NVLink domain: the GPUs that reach each other over NVLink — the 8 GPUs
  of a DGX/HGX node, or the 72 GPUs of a GB200/GB300 NVL72 rack whatever the node (a compute tray of 4 GPUs)
  boundary; a communication group whose ranks stay inside one domain runs on NVLink, one that spans domains on the
  scale-out network;
- scale-out network (GB/s per GPU, one direction): one NIC per GPU;
- streaming multiprocessors: what communication kernels that run beside compute take a share of;
- the host link (GB/s, one direction): PCIe to the CPU's memory, NVLink-C2C on a Grace superchip (activation
  offloading);
- whether its FP8 GEMMs take operands in any layout (Blackwell, compute capability 10.x: Transformer Engine's
  `is_non_tn_fp8_gemm_supported`, `(10, 0) <= capability < (12, 0)`) or only the TN layout (Hopper): a per-tensor-scaled
  FP8 tensor (the `tensorwise` and `delayed` recipes) then needs no transposed copy — TE's `Float8TensorStorage.
  update_usage` serves column-wise use from the row-wise data and drops the transpose (`planner.precision`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from pretrain.observe.flops import PEAK_TFLOPS


@dataclass(frozen=True)
class Gpu:
    """One GPU kind (SXM part, or one GPU of a GB200/GB300 superchip)."""

    name: str
    memory_gib: float
    hbm_tbps: float
    nvlink_gbps: float
    nvlink_domain: int  # GPUs in one NVLink domain
    rack_scale: bool  # the domain spans nodes (NVL72): it does not end at the node boundary
    network_gbps: float
    sms: int
    source: str
    host_link_gbps: float = 64.0  # GPU <-> host memory, one direction: PCIe Gen5 x16 unless stated
    fp8_any_layout: bool = False  # FP8 GEMMs in any operand layout (Blackwell): no FP8 transposes (module docstring)

    @property
    def peaks(self) -> dict[str, float]:
        return PEAK_TFLOPS[self.name]


_B_NVLINK = "NVLink 5: 1.8 TB/s per GPU both ways"


def _usable(smi_mib: int) -> float:
    """GiB torch can allocate of a GPU whose nvidia-smi total is `smi_mib`: as on the B200 (183,359 MiB in
    nvidia-smi, 178.4 GiB in torch), 0.66 GiB less."""
    return round(smi_mib / 1024 - 0.66, 1)
GPUS: dict[str, Gpu] = {g.name: g for g in (
    Gpu("h100", 79.6, 3.35, 450.0, 8, False, 50.0, 132,
        "H100 SXM datasheet: 80 GB HBM3 at 3.35 TB/s, NVLink 4 900 GB/s both ways, 132 SMs; DGX H100: 8 GPUs per "
        "NVLink domain, one 400 Gb/s ConnectX-7 per GPU"),
    Gpu("h200", 140.4, 4.8, 450.0, 8, False, 50.0, 132,
        "H200 SXM datasheet: 141 GB HBM3e at 4.8 TB/s, NVLink 4, 132 SMs; HGX H200: 8 per domain, 400 Gb/s per GPU"),
    Gpu("a100", 79.2, 2.039, 300.0, 8, False, 25.0, 108,
        "A100 80GB SXM datasheet: 2.039 TB/s, NVLink 3 600 GB/s both ways, 108 SMs; 200 Gb/s per GPU; PCIe Gen4 x16",
        host_link_gbps=32.0),
    Gpu("b200", 178.4, 8.0, 900.0, 8, False, 50.0, 148,
        f"DGX B200 datasheet: 8 GPUs, 1,440 GB HBM3e at 8 TB/s per GPU, {_B_NVLINK}, 8x ConnectX-7 400 Gb/s (one per "
        "GPU); 148 SMs; memory as torch reports it (nvidia-smi: 183,359 MiB)", fp8_any_layout=True),
    Gpu("b300", _usable(284208), 8.0, 900.0, 8, False, 100.0, 160,
        f"HGX B300 datasheet: 8 GPUs, 288 GB HBM3e per GPU at 8 TB/s, {_B_NVLINK}, ConnectX-8 800 Gb/s per GPU; "
        "Blackwell Ultra: 160 SMs; memory: the GB300's (same HBM3e stacks); PCIe Gen6 x16", host_link_gbps=128.0,
        fp8_any_layout=True),
    Gpu("gb200", _usable(189471), 8.0, 900.0, 72, True, 50.0, 148,
        f"GB200 NVL72 datasheet: 72 GPUs in one NVLink domain, 186 GB HBM3e per GPU at 8 TB/s, {_B_NVLINK}; compute "
        "tray of 4 GPUs with 4x ConnectX-7 400 Gb/s; 148 SMs; nvidia-smi: 189,471 MiB per GPU; NVLink-C2C to Grace "
        "900 GB/s both ways", host_link_gbps=450.0, fp8_any_layout=True),
    Gpu("gb300", _usable(284208), 8.0, 900.0, 72, True, 100.0, 160,
        f"GB300 NVL72 datasheet: 72 GPUs in one NVLink domain, 288 GB HBM3e per GPU at 8 TB/s, {_B_NVLINK}; "
        "ConnectX-8 800 Gb/s per GPU; Blackwell Ultra: 160 SMs; nvidia-smi: 284,208 MiB per GPU; NVLink-C2C to Grace "
        "900 GB/s both ways", host_link_gbps=450.0, fp8_any_layout=True),
)}
# GPUs per node (Slurm node) when a table does not say: a DGX/HGX node of 8, a GB200/GB300 compute tray of 4.
DEFAULT_GPUS_PER_NODE = {name: 4 if g.rack_scale else 8 for name, g in GPUS.items()}


def gpu(name: str) -> Gpu:
    """The GPU called `name` (KeyError when unknown: callers check `name in GPUS`)."""
    return GPUS[name]


def nvlink_domain(name: str, gpus_per_node: int) -> int:
    """GPUs that reach each other over NVLink: the rack's 72 on NVL72, else the node's GPUs (at most the domain)."""
    g = GPUS[name]
    return g.nvlink_domain if g.rack_scale else min(gpus_per_node, g.nvlink_domain)


def domains_spanned(span: int, domain: int) -> int:
    """NVLink domains a group of `span` consecutive ranks reaches (ranks placed in order, domains filled in order)."""
    return max(1, math.ceil(span / domain))


def table() -> list[tuple[str, float, str, str]]:
    """(name, value, unit, source) of every hardware figure, for the constants table."""
    rows = []
    for g in GPUS.values():
        rows += [(f"memory[{g.name}]", round(g.memory_gib, 1), "GiB", g.source),
                 (f"hbm_bandwidth[{g.name}]", g.hbm_tbps, "TB/s", g.source),
                 (f"nvlink[{g.name}]", g.nvlink_gbps, "GB/s per GPU, one direction", g.source),
                 (f"nvlink_domain[{g.name}]", g.nvlink_domain, "GPUs", g.source),
                 (f"network[{g.name}]", g.network_gbps, "GB/s per GPU, one direction", g.source),
                 (f"sms[{g.name}]", g.sms, "streaming multiprocessors", g.source),
                 (f"host_link[{g.name}]", g.host_link_gbps, "GB/s per GPU, one direction", g.source)]
    return rows
