"""blockscope's version, and the versions of what it runs on (every sidecar records them)."""

import platform
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("blockscope")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0+unknown"


def versions(packages=("blockscope", "torch", "transformer-lens", "transformers")
             ) -> dict[str, str]:
    """Python's version and each installed package's (every sidecar records them)."""
    out = {"python": platform.python_version()}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return out
