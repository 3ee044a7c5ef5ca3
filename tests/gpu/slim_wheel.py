"""Repack a wheel without some of its top-level folders, for the GPU run's carry limit (64 MiB).

nixl-cu12's wheel is 68 MB, 37 MB of which is nixl_ep_cu12: NIXL's expert-parallel torch extension,
built three times (one per torch version), which mmfeat never imports. Without it the wheel is about
29 MB. RECORD loses the dropped files' lines, so the repacked wheel still installs cleanly with pip.

    python tests/gpu/slim_wheel.py WHEEL DROP [DROP ...]   (rewrites WHEEL in place)
"""

from __future__ import annotations

import os
import sys
import zipfile


def slim(path: str, drop: list[str]) -> tuple[int, int]:
    """Rewrite the wheel at ``path`` without the top-level entries named in ``drop``; (files dropped, bytes after)."""
    gone = tuple(d.rstrip("/") + "/" for d in drop)
    tmp = path + ".slim"
    dropped = 0
    with zipfile.ZipFile(path) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as dst:
        for info in src.infolist():
            if info.filename.startswith(gone):
                dropped += 1
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines()
                data = ("\n".join(line for line in lines if not line.startswith(gone)) + "\n").encode()
            dst.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
    os.replace(tmp, path)
    return dropped, os.path.getsize(path)


if __name__ == "__main__":
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    n, size = slim(sys.argv[1], sys.argv[2:])
    print(f"{sys.argv[1]}: {n} files dropped, {size / 2**20:.1f} MiB")
