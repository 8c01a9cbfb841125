"""kvsm: a KV-cache transfer connector for vLLM disaggregated serving, built on
explicit per-request state machines, one event loop per process and a
replayable event log."""


def _version() -> str:
    """pyproject.toml's [project] version, the one source: read from the installed
    metadata (an editable install's metadata is rewritten by every ``pip install
    -e``, which tools/dev.sh reruns whenever pyproject.toml changes), or, for a
    checkout imported without installing, from the pyproject.toml beside it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvsm")
    except PackageNotFoundError:
        import tomllib
        from pathlib import Path

        try:
            with open(Path(__file__).resolve().parent.parent / "pyproject.toml", "rb") as f:
                return str(tomllib.load(f)["project"]["version"])
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "0+unknown"


__version__ = _version()
