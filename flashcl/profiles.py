"""Device profiles: what a kernel may assume about a class of GPUs, as data with sources.

Registers are counted in 32-bit registers per work-item (fiber/lane). ``regs_hard`` is the most a
work-item can address before the compiler spills; ``regs_budget`` is what keeps the occupancy the
tuner aims for. Sizes are bytes. An attached device's own OpenCL limits (local memory, max
work-group) always win over the profile's numbers; the profile supplies what OpenCL does not
report (the register file) and stands in for the device in model mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class DeviceProfile:
    name: str
    vendor: str
    regs_hard: int          # 32-bit registers per work-item before spilling
    regs_budget: int        # registers per work-item that keep the target occupancy
    local_mem: int          # local memory per work-group, bytes
    subgroup: int           # wave / warp / SIMD width the hardware schedules
    max_work_group: int
    fp16: bool              # cl_khr_fp16 (native half arithmetic) present
    simd: int = 4           # vector width a work-item computes with (VEC): 4 on GPUs, SIMD lanes on CPUs
    sources: tuple[str, ...] = field(default=())
    notes: str = ""


PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile(
        "adreno", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True,
        sources=("Mesa freedreno (src/freedreno/ir3): a7xx at most 48 vec4 = 192 full registers per "
                 "fiber; 96 vec4 per lane per SP, so wave64 occupancy is 16 waves at <=12 vec4, 8 at "
                 "24, 6 at 32, 4 at 48",
                 "Qualcomm Snapdragon OpenCL General Programming and Optimization guide: 32 KiB local "
                 "memory per SP, max work-group 1024, spills go to system memory"),
        notes="a7xx (Adreno 7xx, e.g. 740/750); budget = 24 vec4, 8 waves of 64 per SP"),
    DeviceProfile(
        "adreno-6xx", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True,
        sources=("Mesa freedreno ir3: the 48-vec4 per-fiber limit is shared by a6xx and a7xx",
                 "Qualcomm OpenCL optimization guide (Adreno 6xx): 32 KiB local memory"),
        notes="a6xx (Adreno 6xx); same per-fiber limits as a7xx, fewer SPs"),
    DeviceProfile(
        "adreno-8xx", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True,
        sources=("Mesa freedreno ir3 a8xx support: same 48-vec4 per-fiber register limit",),
        notes="a8xx; register limits as a7xx until measured otherwise"),
    DeviceProfile(
        "mali", "arm", regs_hard=64, regs_budget=32, local_mem=32 * 1024, subgroup=16,
        max_work_group=512, fp16=True,
        sources=("Arm Mali GPU Best Practices / Valhall: 64 32-bit registers per thread at full "
                 "occupancy halves above 32",),
        notes="Valhall; registers beyond 32 halve the resident threads"),
    DeviceProfile(
        "apple", "apple", regs_hard=128, regs_budget=64, local_mem=32 * 1024, subgroup=32,
        max_work_group=1024, fp16=True,
        sources=("Apple Metal feature set tables: 32 KiB threadgroup memory, 1024 threads per group",),
        notes="register numbers are estimates for occupancy; the compiler reports none"),
    DeviceProfile(
        "intel", "intel", regs_hard=256, regs_budget=128, local_mem=64 * 1024, subgroup=16,
        max_work_group=1024, fp16=True,
        sources=("Intel oneAPI GPU optimization guide: 128 GRF x 32 B per thread (256 with large "
                 "GRF mode), SIMD16 -> 256 B / 4 B per lane",),
        notes="Xe: 128-register GRF per hardware thread, SIMD16 lanes"),
    DeviceProfile(
        "nvidia", "nvidia", regs_hard=255, regs_budget=128, local_mem=48 * 1024, subgroup=32,
        max_work_group=1024, fp16=False,
        sources=("CUDA C Programming Guide, compute capabilities table: 255 registers per thread, "
                 "64 K registers per SM, 48 KiB static shared memory per block",
                 "NVIDIA OpenCL reports no cl_khr_fp16"),
        notes="128 registers per thread keeps 16 warps per SM"),
    DeviceProfile(
        "cpu", "cpu", regs_hard=4096, regs_budget=4096, local_mem=1024 * 1024, subgroup=8,
        max_work_group=4096, fp16=False, simd=16,
        sources=("PoCL pthread device: local memory is ordinary memory; private arrays live in the "
                 "work-group context, so there is no register cliff",),
        notes="PoCL / CPU drivers"),
)}

ARCH_PROFILE_ALIASES = {"a6": "adreno-6xx", "a7": "adreno", "a8": "adreno-8xx"}


def adreno_model(text: str) -> int | None:
    """The Adreno model number (e.g. 740) from a device name or OpenCL C version string."""
    import re

    m = re.search(r"Adreno\s*\(TM\)\s*(\d{3})", text, re.IGNORECASE)
    return int(m.group(1)) if m else None


def profile_for(vendor: str, name: str, opencl_c_version: str = "", device_type: str = "gpu") -> DeviceProfile:
    """Match an attached device to a profile by vendor, name and OpenCL C version."""
    text = f"{vendor} {name} {opencl_c_version}".lower()
    if device_type == "cpu" or "pocl" in text and "cpu" in text:
        return PROFILES["cpu"]
    if "adreno" in text or "qualcomm" in text:
        model = adreno_model(f"{name} {opencl_c_version}")
        if model is not None and 600 <= model < 700:
            return PROFILES["adreno-6xx"]
        if model is not None and model >= 800:
            return PROFILES["adreno-8xx"]
        return PROFILES["adreno"]
    for key, prof in (("nvidia", "nvidia"), ("mali", "mali"), ("arm", "mali"), ("apple", "apple"),
                      ("intel", "intel")):
        if key in text:
            return PROFILES[prof]
    return PROFILES["cpu"] if device_type == "cpu" else PROFILES["nvidia" if "cuda" in text else "intel"]
