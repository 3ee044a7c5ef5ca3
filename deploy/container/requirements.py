"""Print a wheel's requirements as a pip requirements file: the base ones, those of the extras asked
for, less the packages named with --without.

The image installs mmfeat with --no-deps and these instead, so that the daemon's image leaves out
torch, which only the client's tensor API imports. Reading them from the wheel keeps pyproject.toml
the one list.
"""

from __future__ import annotations

import argparse
import re
import sys
import zipfile
from email.parser import Parser

_EXTRA = re.compile(r"""\s*(?:and\s+)?extra\s*==\s*["']([^"']+)["']\s*(?:and\s+)?""")
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


def requirements(wheel: str, extras: set[str], without: set[str], base: bool = True) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        headers = Parser().parsestr(z.read(meta).decode())
    out = []
    for req in headers.get_all("Requires-Dist") or []:
        spec, _, marker = req.partition(";")
        found = _EXTRA.search(marker)
        if found:
            if found.group(1) not in extras:
                continue
            marker = _EXTRA.sub(" ", marker).strip()
        elif not base:
            continue
        name = _NAME.match(spec).group(1).lower().replace("_", "-")
        if name in without:
            continue
        out.append(f"{spec.strip()}; {marker}" if marker else spec.strip())
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("wheel")
    ap.add_argument("--extra", action="append", default=[], help="an extra whose requirements to add")
    ap.add_argument("--without", action="append", default=[], help="a package to leave out")
    ap.add_argument("--extras-only", action="store_true", help="leave out the base requirements too")
    args = ap.parse_args(argv)
    for line in requirements(args.wheel, set(args.extra), {w.lower() for w in args.without}, not args.extras_only):
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
