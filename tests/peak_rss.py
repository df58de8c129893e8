"""Peak resident memory of a piece of work, measured in a fresh Python process.

The script's `main()` records `peak_rss()` as its baseline after the imports and set-up, does the
work, and prints one JSON line with `baseline`, `peak`, `written` and `seconds`. Peak RSS is
/proc/self/status VmHWM, which starts afresh at exec: ru_maxrss would start at the pytest
parent's peak (Linux counts what a vfork/fork child shares before exec).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.dist.launch import REPO, clean_env

SCRIPT_HEADER = """
import json, re, sys
from pathlib import Path

def peak_rss():
    with open("/proc/self/status") as f:
        return int(re.search(r"VmHWM:\\s+(\\d+) kB", f.read()).group(1)) * 1024
"""
SCRIPT_FOOTER = """
if __name__ == "__main__":
    main()
"""


def measure(tmp_path: Path, main_source: str, *args, label: str, timeout: int = 600) -> dict:
    """Runs `main_source` (defining main()) with `args` in a child; returns its JSON plus `above`
    (peak - baseline) and prints one line for the log."""
    script = tmp_path / "measure.py"
    script.write_text(SCRIPT_HEADER + main_source + SCRIPT_FOOTER)
    env = clean_env()
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    proc = subprocess.run(
        [sys.executable, str(script), *map(str, args)], env=env, capture_output=True, text=True, timeout=timeout
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["above"] = result["peak"] - result["baseline"]
    print(
        f"{label}: baseline {result['baseline'] / 2**20:.0f} MiB, peak {result['peak'] / 2**20:.0f} MiB "
        f"(+{result['above'] / 2**20:.0f} MiB), {result['written'] / 1e6 / result['seconds']:.0f} MB/s"
    )
    return result
