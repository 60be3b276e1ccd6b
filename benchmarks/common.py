"""What every benchmark result records about where it ran: the machine and the package versions."""

import os
import platform

PACKAGES = ("jax", "jaxlib", "flax", "optax", "gymnax", "rejax")


def versions() -> dict:
    from importlib import metadata

    found = {}
    for package in PACKAGES:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


def machine() -> dict:
    model = platform.processor()
    try:
        model = next(
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo")
            if line.startswith("model name")
        )
    except (OSError, StopIteration):
        pass
    import jax  # late: report.py describes results without importing jax

    return dict(
        cpu=model,
        cores=os.cpu_count(),
        devices=[str(d) for d in jax.devices()],
        python=platform.python_version(),
    )


def describe(info: dict, found: dict) -> str:
    """The machine and the versions, for the header of a results table."""
    return (
        f"{info['cpu']} ({info['cores']} cores), devices {', '.join(info['devices'])}, "
        f"Python {info['python']}; "
        + ", ".join(f"{k} {v}" for k, v in found.items() if v)
    )
