"""Launch a test program on N ranks with mpiexec (MPICH or Open MPI) and check it passed."""
import os
import re
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


def _launch(script, n, args, env, simulator, timeout):
    """mpiexec ``tests/mpi/<script>`` (or ``script``, an absolute path) on ``n`` ranks:
    (command, return code, stdout + stderr)."""
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
    # MKNUMBA_TEST_TIMEOUT_S caps every run's bound: a GPU script that kills a group of tests
    # after some time sets it lower, so that a run past it fails with what it printed so far
    cap = os.environ.get("MKNUMBA_TEST_TIMEOUT_S")
    timeout = min(timeout, float(cap)) if cap else timeout
    with subprocess.Popen(cmd, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                          text=True) as p:
        try:
            out, err = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            p.terminate()           # mpiexec passes it on to the ranks; a kill would orphan them
            try:
                out, err = p.communicate(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            raise subprocess.TimeoutExpired(cmd, timeout, output=out, stderr=err) from None
    return cmd, p.returncode, out + err


def _timed_out_output(e):
    """What a run that timed out had printed (subprocess.TimeoutExpired's output)."""
    return "".join(x.decode(errors="replace") if isinstance(x, bytes) else x or ""
                   for x in (e.stdout, e.stderr))


def run_mpi(script, n, *args, env=None, simulator=True, timeout=600, expect_fail=False,
            gpus=None):
    """Run ``tests/mpi/<script>`` (or ``script``, an absolute path) on ``n`` ranks and return
    its output. The test fails if the program fails (or, with ``expect_fail``, if it
    succeeds). Off the simulator it is skipped where the machine has fewer than ``gpus``
    GPUs (default ``n``; see :func:`require_gpus`)."""
    if not simulator:
        require_gpus(n if gpus is None else gpus, env)
    try:
        cmd, rc, out = _launch(script, n, args, env, simulator, timeout)
    except subprocess.TimeoutExpired as e:
        raise AssertionError(f"{' '.join(e.cmd)} timed out after {e.timeout:g} s; its output "
                             f"so far:\n{_timed_out_output(e)[-6000:]}") from None
    if expect_fail:
        assert rc != 0, f"{' '.join(cmd)} succeeded but should have failed:\n{out}"
    else:
        assert rc == 0, f"{' '.join(cmd)} exited {rc}:\n{out[-6000:]}"
    return out


class SharedLaunch:
    """Simulator runs of several tests in one mpiexec start on ``n`` ranks
    (``tests/mpi/launch_sets.py``), which saves each later run the start (mpiexec, imports,
    the library's first-use work). Each test registers its run under its own name
    (``add``, at import) and gets that run's output from :meth:`output`, as :func:`run_mpi`
    would return it; the first call launches the runs of every test of the session's
    selection that registered one here (the test's own always). A test fails when its run
    failed (the output shows its lines and the job's), or did not run because an earlier run
    of the launch failed (naming that test), or when the job failed or timed out after every
    run had ended (at exit: any run may have left that behind, so each test fails)."""

    def __init__(self, n, timeout=600):
        self.n, self.timeout = n, timeout
        self.runs = {}            # test name -> (program, args, env)
        self.results = {}         # test name -> (passed, output), once launched

    def add(self, test, script, *args, env=None):
        """``test``: the test's name as pytest gives it (``request.node.name``, with the
        parameter ids); ``env``: variables for this run alone (mk.init reads them)."""
        assert test not in self.runs, test
        self.runs[test] = (script, [str(a) for a in args], dict(env or {}))

    def output(self, request):
        name = request.node.name
        assert name in self.runs, f"{name} registered no run with this launch"
        if name not in self.results:
            selected = {item.name for item in request.session.items
                        if getattr(item, "module", None) is request.module}
            self.launch([t for t in self.runs if (t in selected or t == name)
                         and t not in self.results])
        passed, out = self.results[name]
        assert passed, out
        return out

    def launch(self, names):
        """Run the runs of ``names``, in that order, in one mpiexec start; record each one's
        result: (True, its output) or (False, why it failed or did not run)."""
        argv = []
        for t in names:
            script, args, env = self.runs[t]
            argv += ["/"] + [f"{k}={'' if v is None else v}" for k, v in env.items()]
            argv += [script, *args]
        try:
            cmd, rc, out = _launch("launch_sets.py", self.n, argv[1:], None, True, self.timeout)
        except subprocess.TimeoutExpired as e:        # each test says so, none launches again
            cmd, rc = e.cmd, f"timed out after {e.timeout:g} s"
            out = _timed_out_output(e)
        self.returncode = rc
        lines = out.splitlines()
        rest = "\n".join(line for line in lines if not re.match(r"\d+\| ", line))  # no run's
        failed = None
        for i, t in enumerate(names):
            mine = [line[len(f"{i}| "):] for line in lines if line.startswith(f"{i}| ")]
            text = "\n".join(mine) + "\n"
            ended = sum(any(line.startswith(f"END rank {r} ") for line in mine)
                        for r in range(self.n)) == self.n
            if ended:
                self.results[t] = (True, text)
            elif failed is None:
                failed = t
                self.results[t] = (False, f"{t}: its run failed (exit {rc}) in the shared "
                                          f"launch {' '.join(cmd)}\n{text[-5000:]}\n"
                                          f"-- the job's other output:\n{rest[-2000:]}")
            else:
                self.results[t] = (False, f"{t}: did not run: the shared launch stopped at "
                                          f"{failed}'s run")
        if failed is None and rc != 0:
            # every run ended, then the job failed or hung on its way out (MPI_Finalize, a
            # thread, a crash at exit): state any run left behind, so no run's test passes
            for t in names:
                self.results[t] = (False, f"{t}: its run ended, but the shared launch "
                                          f"{' '.join(cmd)} then exited {rc} (after runs "
                                          f"{', '.join(names)}; run them alone to tell which "
                                          f"one):\n{rest[-3000:]}")


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
