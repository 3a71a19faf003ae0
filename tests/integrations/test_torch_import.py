"""torch is imported by mpitensor.torch only, never by ``import mpitensor``."""

from __future__ import annotations

import subprocess
import sys


def test_import_mpitensor_does_not_import_torch():
    code = "import sys, mpitensor; print('torch' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False", "import mpitensor imported torch"
