"""Exceptions raised by flashcl beyond the ValueError/TypeError of input validation."""


class FlashCLError(RuntimeError):
    """Base class of device-side failures."""


class KernelBuildError(FlashCLError):
    """An OpenCL program failed to build; the message names kernel, parameters, device and log."""

    def __init__(self, kernel: str, params: dict, device: str, log: str):
        self.kernel, self.params, self.device, self.log = kernel, dict(params), device, log
        super().__init__(
            f"building kernel {kernel!r} with {self.params} failed on {device}:\n{log.strip()}"
        )


class KernelLaunchError(FlashCLError):
    """A kernel could not be launched (out of resources, invalid work-group size, ...)."""

    def __init__(self, kernel: str, params: dict, device: str, reason: str):
        self.kernel, self.params, self.device = kernel, dict(params), device
        super().__init__(f"launching kernel {kernel!r} with {self.params} on {device} failed: {reason}")


class TuningDatabaseError(ValueError):
    """A tuning database file is not valid JSON, has the wrong structure, is nested too deeply or
    cannot be read; the message names the file."""
