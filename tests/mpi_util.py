"""Launch a test program on N ranks with mpiexec (MPICH or Open MPI) and check it passed."""
import os
import shutil
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def mpiexec():
    """mpiexec beside this Python (the mpich wheel puts it there), else the one on PATH."""
    local = os.path.join(os.path.dirname(sys.executable), "mpiexec")
    exe = local if os.path.exists(local) else shutil.which("mpiexec") or shutil.which("mpirun")
    if exe is None:
        raise RuntimeError("no mpiexec found: pip install 'mknumba[mpi]' brings MPICH's")
    cmd = [exe]
    version = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        cmd += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return cmd


def gpu_count():
    """CUDA GPUs visible to this process (0 without a driver)."""
    try:
        from numba import cuda
        return len(cuda.gpus) if cuda.is_available() else 0
    except Exception:
        return 0


def require_gpus(n, env=None):
    """Skip the calling test, with the reason, when ``n`` ranks would need more GPUs than this
    machine has, unless ``MKNUMBA_ALLOW_SHARED_GPU=1`` lets ranks share them (correctness
    only: shared GPUs time-slice the ranks)."""
    import pytest
    have = gpu_count()
    shared = dict(os.environ, **(env or {})).get("MKNUMBA_ALLOW_SHARED_GPU") == "1"
    if have < n and not shared:
        pytest.skip(f"needs {n} GPUs, this machine has {have} (set MKNUMBA_ALLOW_SHARED_GPU=1 "
                    "to run the ranks on shared GPUs, for correctness only)")


def run_mpi(script, n, *args, env=None, simulator=True, timeout=600, expect_fail=False,
            gpus=None):
    """Run ``tests/mpi/<script>`` (or ``script``, an absolute path) on ``n`` ranks and return
    its output. The test fails if the program fails (or, with ``expect_fail``, if it
    succeeds). Off the simulator it is skipped where the machine has fewer than ``gpus``
    GPUs (default ``n``; see :func:`require_gpus`)."""
    if not simulator:
        require_gpus(n if gpus is None else gpus, env)
    full_env = dict(os.environ)
    full_env["PYTHONPATH"] = ROOT + os.pathsep + full_env.get("PYTHONPATH", "")
    full_env["PYTHONUNBUFFERED"] = "1"
    if simulator:
        full_env["NUMBA_ENABLE_CUDASIM"] = "1"
    else:
        full_env["NUMBA_ENABLE_CUDASIM"] = "0"
    for key, value in (env or {}).items():      # None: leave the variable unset
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    # -m mpi4py: a rank's uncaught exception aborts the job at once, instead of leaving the
    # other ranks waiting in a collective until the timeout
    cmd = mpiexec() + ["-n", str(n), sys.executable, "-m", "mpi4py",
                       os.path.join(HERE, "mpi", script), *map(str, args)]
    p = subprocess.run(cmd, env=full_env, capture_output=True, text=True, timeout=timeout)
    out = p.stdout + p.stderr
    if expect_fail:
        assert p.returncode != 0, f"{' '.join(cmd)} succeeded but should have failed:\n{out}"
    else:
        assert p.returncode == 0, f"{' '.join(cmd)} exited {p.returncode}:\n{out[-6000:]}"
    return out


def run_python(code, *args, simulator=True, timeout=600):
    """Run ``code`` (a Python program's text) in a fresh interpreter with the repository and
    tests/mpi on its path, in numba's simulator or (``simulator=False``) with numba.cuda proper,
    GPU or not (compiling for sm_90a needs no GPU). Fails the test if it fails; returns its
    standard output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1",
               NUMBA_ENABLE_CUDASIM="1" if simulator else "0",
               PYTHONPATH=os.pathsep.join([ROOT, os.path.join(HERE, "mpi"),
                                           os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run([sys.executable, "-c", code, *map(str, args)], env=env,
                       capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    return p.stdout
