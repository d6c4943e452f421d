"""The tiles flashcl would use on an Adreno GPU, from the register model (no device needed)."""

import subprocess
import sys

cmd = [sys.executable, "-m", "flashcl", "show-config", "--device", "adreno", "--d", "128"]
print(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
