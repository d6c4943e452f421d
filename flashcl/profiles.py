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
    reg_file: int = 0       # 32-bit registers one compute unit (SP/SM/core) shares among the
                            # work-items of a work-group; 0 = the work-group size does not shrink
    # prefill layouts the tuner sweeps here (tuning.PREFILL_SPACE's layouts)
    prefill_variants: tuple[str, ...] = ("rows", "tiles")
    # decode layouts the tuner sweeps and the defaults take (tuning.DECODE_SPACE's layouts)
    decode_variants: tuple[str, ...] = ("lanes",)
    model_margin: int = 0   # registers a default leaves below regs_hard: the model's error where a
                            # compiler has shown it
    tile_cache: int = 0     # CPUs: the L1 data cache of a core, which the K/V tiles every work-item
                            # re-reads should fit (local memory is ordinary memory); 0 = no bound

    sources: tuple[str, ...] = field(default=())
    notes: str = ""

    def kernel_max_work_group(self, regs: int) -> int:
        """Modeled CL_KERNEL_WORK_GROUP_SIZE of a kernel using ``regs`` registers per work-item:
        a work-group must be resident on one compute unit (it has barriers), so it is bounded by
        the register file; rounded down to whole subgroups."""
        if not self.reg_file or regs <= 0:
            return self.max_work_group
        items = self.reg_file // min(regs, self.regs_hard)
        return max(self.subgroup, min(self.max_work_group, items // self.subgroup * self.subgroup))


_MESA_IR3 = ("Mesa freedreno ir3 (src/freedreno/ir3/ir3_ra.h RA_FULL_SIZE = 48 vec4; "
             "ir3.c ir3_get_reg_dependent_max_waves = reg_size_vec4 / (regs_vec4 * (wave128 ? 2 : 1)) "
             "* wave_granularity(2)): at most 48 vec4 = 192 full 32-bit registers per fiber, spills "
             "go to system memory")
_QCOM_GUIDE = ("Qualcomm Snapdragon Mobile Platform OpenCL General Programming and Optimization guide "
               "(80-NB295-11): 32 KiB local memory, max work-group 1024, wave64/wave128, private "
               "memory beyond the register file spills to system memory")

PROFILES: dict[str, DeviceProfile] = {p.name: p for p in (
    DeviceProfile(
        # 96 vec4 per lane x 128 lanes: 16 waves64 at <=12 vec4, 8 at 24, 6 at 32, 4 at 48 (192 regs),
        # i.e. 49152 32-bit registers per SP shared by the resident fibers; a work-group of 256
        # fibers still fits at 192 registers each.
        "adreno", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True, reg_file=96 * 4 * 128,
        sources=(_MESA_IR3,
                 "Mesa src/freedreno/common/freedreno_devices.py: a7xx reg_size_vec4 = 96",
                 _QCOM_GUIDE),
        notes="a7xx (Adreno 7xx, e.g. 730/740/750); budget = 24 vec4 = 8 waves64 per SP"),
    DeviceProfile(
        "adreno-6xx", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True, reg_file=96 * 4 * 128,
        sources=(_MESA_IR3,
                 "Mesa freedreno_devices.py: a6xx gen1..gen4 (a615/a618/a630/a640/a650/a660) "
                 "reg_size_vec4 = 96; the low-end a6xx_gen1_low (a610-class) has 48, i.e. half the "
                 "occupancy at the same per-fiber limit",
                 _QCOM_GUIDE),
        notes="a6xx; same per-fiber limit as a7xx, fewer SPs; a610-class parts have half the register file"),
    DeviceProfile(
        "adreno-8xx", "qualcomm", regs_hard=192, regs_budget=96, local_mem=32 * 1024, subgroup=64,
        max_work_group=1024, fp16=True, reg_file=96 * 4 * 128,
        sources=(_MESA_IR3,
                 "Mesa freedreno_devices.py: a8xx_base reg_size_vec4 = 96 (Adreno 830); a later a8xx "
                 "generation lists 128",),
        notes="a8xx (Adreno 830); register limits as a7xx until measured otherwise"),
    DeviceProfile(
        # Valhall/5th gen: up to 64 registers per thread; at most 32 keeps full thread occupancy,
        # more halves it (the Mali Offline Compiler reports "work registers" and occupancy).
        "mali", "arm", regs_hard=64, regs_budget=32, local_mem=32 * 1024, subgroup=16,
        max_work_group=1024, fp16=True, reg_file=32 * 1024,
        sources=("Arm Mali GPU Best Practices Developer Guide (workgroup sizes): the shader core "
                 "splits a fixed register file across a variable number of threads",
                 "Arm Mali Offline Compiler / Valhall: 64 work registers per thread at most, full "
                 "occupancy (1024 threads per core) at <=32, half above",
                 "Arm: local memory is ordinary system memory cached in L1; OpenCL reports 32 KiB"),
        notes="Valhall (Mali-G57..G720); Bifrost max work-group is 384 (the device's own limit wins)"),
    DeviceProfile(
        "apple", "apple", regs_hard=128, regs_budget=64, local_mem=32 * 1024, subgroup=32,
        max_work_group=1024, fp16=True,
        sources=("Apple Metal feature set tables: 32 KiB threadgroup memory, 1024 threads per threadgroup",
                 "Apple WWDC16 'Advanced Metal Shader Optimization': more registers, fewer threads; "
                 "maxTotalThreadsPerThreadgroup reports the kernel's limit",
                 "Dougall Johnson, applegpu (G13 ISA notes): 128 32-bit general registers per thread"),
        notes="register numbers are estimates for occupancy; the compiler reports none"),
    DeviceProfile(
        # Xe-LP/Xe-HPG: 128 GRF x 32 B = 4 KiB per hardware thread, shared by the SIMD lanes; the
        # compiler picks SIMD8 (512 B = 128 floats per work-item), SIMD16 (64) or SIMD32 (32).
        "intel", "intel", regs_hard=128, regs_budget=64, local_mem=64 * 1024, subgroup=16,
        max_work_group=512, fp16=True,
        sources=("Intel oneAPI GPU Optimization Guide: 128 GRF registers per hardware thread (32 B "
                 "wide on Xe-LP/HPG, 64 B on Xe-HPC; 256 in large-GRF mode), spills go to scratch memory",
                 "Intel compute-runtime: CL_KERNEL_SPILL_MEM_SIZE_INTEL (0x4109) reports the spill size",
                 "Intel GPU Occupancy Calculator: 64 KiB SLM per work-group"),
        notes="Xe-LP integrated GPUs: 128 floats per work-item at SIMD8, 64 at SIMD16; Arc reports max "
              "work-group 1024 (the device's own limit wins)"),
    DeviceProfile(
        "nvidia", "nvidia", regs_hard=255, regs_budget=128, local_mem=48 * 1024, subgroup=32,
        max_work_group=1024, fp16=False, reg_file=64 * 1024, model_margin=32,
        sources=("CUDA C Programming Guide, compute capabilities table: 255 registers per thread, "
                 "64 K 32-bit registers per SM, 48 KiB static shared memory per block",
                 "CUDA occupancy calculator: 128 registers per thread keeps 16 warps per SM, 255 "
                 "allows 256 threads per block",
                 "NVIDIA OpenCL reports no cl_khr_fp16; -cl-nv-verbose prints ptxas spill stores/loads",
                 "ptxas on H100 and H200: the prefill default at d=128 (BLOCK_N=8, DV_TILE=64), 254 modeled "
                 "registers, spilled 52 B, so the model under-counts by 14 or more there; the margin is "
                 "twice that"),
        notes="128 registers per thread keeps 16 warps per SM"),
    DeviceProfile(
        "cpu", "cpu", regs_hard=4096, regs_budget=4096, local_mem=1024 * 1024, subgroup=8,
        max_work_group=4096, fp16=False, simd=16, prefill_variants=("rows",),
        decode_variants=("rows",), tile_cache=48 * 1024,
        sources=("PoCL pthread device: local memory is ordinary memory; private arrays live in the "
                 "work-group context, so there is no register cliff",
                 "AMD Zen 5 and Intel cores since Sunny Cove: 48 KiB L1 data cache per core (32 KiB on "
                 "Zen 4 and older x86, 64-128 KiB on recent Arm and Apple cores)"),
        notes="PoCL / CPU drivers"),
)}

ARCH_PROFILE_ALIASES = {"a6": "adreno-6xx", "a7": "adreno", "a8": "adreno-8xx",
                        "adreno-7xx": "adreno", "a6xx": "adreno-6xx", "a7xx": "adreno", "a8xx": "adreno-8xx"}


def find_profile(name: str) -> DeviceProfile | None:
    """A profile by name or alias ("adreno", "a7xx", "adreno-6xx", "nvidia"), else None."""
    key = name.strip().lower()
    key = ARCH_PROFILE_ALIASES.get(key, key)
    return PROFILES.get(key)


def adreno_model(text: str) -> int | None:
    """The Adreno model number (e.g. 740) from a device name or OpenCL C version string."""
    import re

    m = re.search(r"Adreno\s*\(TM\)\s*(\d{3})", text, re.IGNORECASE)
    return int(m.group(1)) if m else None


# A device's architecture from the strings OpenCL reports (vendor, name, OpenCL C version), for
# the tuning database's nearest measured relative: (pattern, arch). NVIDIA (compute capability)
# and Adreno (model number) come first, in device_arch.
ARCH_PATTERNS = (
    (r"(?:Mali|Immortalis)-(G\d+)", "mali-{0}"),
    (r"\b(gfx\d+[0-9a-f]?)\b", "amd-{0}"),          # ROCm names the device by its gfx id
    (r"Arc\(TM\) A\d", "intel-xe-hpg"),
    (r"Arc\(TM\) B\d", "intel-xe2-hpg"),
    (r"Data Center GPU Max", "intel-xe-hpc"),
    (r"Data Center GPU Flex", "intel-xe-hpg"),
    (r"Iris\(R\) Xe", "intel-xe-lp"),
    (r"UHD Graphics 7\d\d", "intel-xe-lp"),
    (r"UHD Graphics P?6\d\d", "intel-gen9"),
    (r"Iris\(R\) Plus", "intel-gen11"),
)

# Mali GPUs of the Bifrost generation; every later G-series part is Valhall or its successor,
# which kept Valhall's register file per thread.
MALI_BIFROST = ("g31", "g51", "g52", "g71", "g72", "g76")


def device_arch(name: str, opencl_c_version: str = "", vendor: str = "",
                compute_capability: tuple | None = None) -> str | None:
    """"nvidia-sm90" from the compute capability, "adreno-740" from the OpenCL C version string,
    else the first of ARCH_PATTERNS that matches; None when nothing does."""
    import re

    if compute_capability:
        return f"nvidia-sm{compute_capability[0]}{compute_capability[1]}"
    model = adreno_model(f"{name} {opencl_c_version}")
    if model is not None:
        return f"adreno-{model}"
    text = f"{vendor} {name} {opencl_c_version}"
    for pattern, arch in ARCH_PATTERNS:
        m = re.search(pattern, text, re.IGNORECASE)
        if m:
            return arch.format(*m.groups()).lower()
    return None


def arch_family(arch: str | None) -> str | None:
    """The coarser group an architecture belongs to: NVIDIA by major compute capability
    ("nvidia-sm9x"), Adreno by series ("adreno-7xx"), Mali by generation ("mali-valhall"), AMD by
    gfx major ("amd-gfx9"). None for Intel: its product lines differ in SIMD width and register
    mode, so only the exact line is a relative."""
    import re

    if not arch:
        return None
    m = re.fullmatch(r"nvidia-sm(\d+)\d", arch)
    if m:
        return f"nvidia-sm{m.group(1)}x"
    m = re.fullmatch(r"adreno-(\d)\d\d", arch)
    if m:
        return f"adreno-{m.group(1)}xx"
    m = re.fullmatch(r"mali-(g\d+)", arch)
    if m:
        return "mali-bifrost" if m.group(1) in MALI_BIFROST else "mali-valhall"
    m = re.fullmatch(r"amd-(gfx\d+)[0-9a-f]{2}", arch)
    if m:
        return f"amd-{m.group(1)}"
    return None


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
