"""Nothing of autofit outlives a run: short FSDP2 jobs, each rank its own Python process exiting
normally after destroy_process_group (as under torchrun), all exit 0 with no thread left running
and nothing printed by a C++ terminate."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built"),
              pytest.mark.slow]

JOBS = 6        # consecutive jobs of 2 ranks (each process imports torch and autofit: seconds each)
WORLD = 2
JOB_TIMEOUT = 240


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _job() -> list[subprocess.CompletedProcess]:
    script = Path(__file__).with_name("fsdp_job.py")
    init = f"tcp://127.0.0.1:{_free_port()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(script.parent.parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, str(script), str(r), str(WORLD), init], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(WORLD)]
    done = []
    for p in procs:
        try:
            out, err = p.communicate(timeout=JOB_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


def test_consecutive_fsdp2_jobs_all_exit_0_leaving_nothing_running():
    for job in range(JOBS):
        for rank, proc in enumerate(_job()):
            assert proc.returncode == 0, (job, rank, proc.returncode, proc.stderr[-2000:])
            assert "terminate called" not in proc.stderr, (job, rank, proc.stderr[-2000:])
            seen = json.loads(proc.stdout.strip().splitlines()[-1])
            assert seen == {"rank": rank, "steps": 3, "threads": []}, (job, seen)
