"""Prints the wheel file names in a cache folder that match a release's list, one per line.

Usage: python3 select_wheels.py vllm-<release>.txt CACHE_DIR
Each `name==version` line of the list must match exactly one wheel in CACHE_DIR (the cache holds
every release's wheels); a missing or doubled one is an error, so the archive holds one version
of each package and nothing else.
"""

import sys
from pathlib import Path

try:
    from packaging.utils import canonicalize_name, parse_wheel_filename
    from packaging.version import Version
except ImportError:  # pip vendors packaging
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename
    from pip._vendor.packaging.version import Version


def read_pins(path):
    pins = {}
    for line in Path(path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            sys.exit(f"{path}: '{line}' is not name==version; pin every wheel exactly")
        pins[canonicalize_name(name)] = Version(version)
    return pins


def main(list_path, cache_dir):
    pins = read_pins(list_path)
    found = {}
    for wheel in sorted(Path(cache_dir).glob("*.whl")):
        name, version, _, _ = parse_wheel_filename(wheel.name)
        if pins.get(name) == version:
            found.setdefault(name, []).append(wheel.name)
    missing = sorted(set(pins) - set(found))
    doubled = {n: f for n, f in found.items() if len(f) > 1}
    if missing or doubled:
        for n in missing:
            print(f"no wheel for {n}=={pins[n]} in {cache_dir}: did pip download fail?", file=sys.stderr)
        for n, f in doubled.items():
            print(f"several wheels for {n}: {' '.join(f)}; remove all but one", file=sys.stderr)
        sys.exit(1)
    for name in sorted(found):
        print(found[name][0])


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    main(*sys.argv[1:])
