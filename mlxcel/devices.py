"""Which device a run uses: runner.device, and in a sweep whose launcher runs jobs side by side
(joblib, submitit, Ray), one GPU per job where the machine has several.

A job claims a GPU with an exclusive lock on <sweep dir>/.gpus/gpu-N.lock, held until its run ends
(the OS drops it if the process dies): first the GPU of its job number (job % GPUs), else the next
free one; with more jobs running than GPUs it shares its own. The basic launcher runs the jobs one
after another in one process: they keep the default GPU (and the weights it holds). Apple silicon
has one GPU, so there a claim never happens. MLXCEL_FAKE_GPU_COUNT=N claims as if there were N
GPUs but runs on the default device: how the tests check the claims on a machine with one or none.
"""

from __future__ import annotations

import fcntl
import os
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import mlx.core as mx

from mlxcel.errors import ConfigError, ConfigIssue, MlxcelError

FAKE_GPU_COUNT = "MLXCEL_FAKE_GPU_COUNT"


@dataclass
class GpuClaim:
    index: int
    gpus: int
    shared: bool  # every GPU was claimed: this job runs next to another on its job's GPU
    faked: bool  # MLXCEL_FAKE_GPU_COUNT: claimed, but the run stays on the default device
    lock: IO | None = None

    def describe(self) -> dict:
        return {"gpu": self.index, "gpus": self.gpus, "shared": self.shared, **({"faked": True} if self.faked else {})}

    def release(self) -> None:
        if self.lock is not None:
            self.lock.close()  # (closing the file drops its lock)
            self.lock = None


def count_gpus() -> tuple[int, bool]:
    """(GPUs this process sees, whether the count is MLXCEL_FAKE_GPU_COUNT's)."""
    fake = os.environ.get(FAKE_GPU_COUNT)
    if fake:
        if not fake.isdigit():
            raise MlxcelError(
                f"${FAKE_GPU_COUNT} must be a count of GPUs, like 2 (got {fake!r}); unset it to count the real ones"
            )
        return int(fake), True
    return (mx.device_count(mx.gpu) if mx.is_available(mx.gpu) else 0), False


def claim_gpu(sweep_dir: Path, job: int) -> GpuClaim | None:
    """A GPU for this sweep job, or None where there is one GPU or none."""
    gpus, faked = count_gpus()
    if gpus < 2:
        return None
    folder = Path(sweep_dir) / ".gpus"
    folder.mkdir(parents=True, exist_ok=True)
    for step in range(gpus):
        index = (job + step) % gpus
        lock = open(folder / f"gpu-{index}.lock", "a")  # noqa: SIM115 - held open for the run: it is the claim
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            continue
        return GpuClaim(index, gpus, shared=False, faked=faked, lock=lock)
    return GpuClaim(job % gpus, gpus, shared=True, faked=faked)


def select_device(device: str, claim: GpuClaim | None = None) -> None:
    if device == "cpu":
        mx.set_default_device(mx.cpu)
        return
    if device == "gpu" and not mx.is_available(mx.gpu):
        raise ConfigError(
            ConfigIssue("runner.device", "no GPU backend is available in this MLX build; use auto or cpu", device)
        )
    if claim is not None and not claim.faked:
        mx.set_default_device(mx.Device(mx.gpu, claim.index))
    elif device == "gpu":
        mx.set_default_device(mx.gpu)
