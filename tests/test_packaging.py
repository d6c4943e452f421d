"""What a non-editable install ships: every package of the source tree is listed in setup.cfg."""

from __future__ import annotations

import configparser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_listed_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    listed = {p.strip() for p in cfg["options"]["packages"].split() if p.strip()}
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "flashcl").rglob("__init__.py")}
    assert found <= listed, f"packages missing from setup.cfg [options] packages: {sorted(found - listed)}"
